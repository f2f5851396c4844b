//! The disk tier under the store, on a real directory (the system's temporary directory).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use memkv_proto::Status;

use super::{DiskConfig, DiskTier};
use crate::store::Store;

const V: usize = 300 << 10;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("memkv-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }

    fn segments(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config(dir: &TempDir, size: u64) -> DiskConfig {
    DiskConfig {
        dirs: vec![dir.0.clone()],
        size,
        queue_bytes: 16 << 20,
        index_bytes: 1 << 20,
        read_threads: 2,
        recovery_timeout: Duration::from_secs(30),
        max_leased_fraction: 0.5,
        flush_timeout: Duration::from_secs(30),
    }
}

/// A store of 4 MiB DRAM (a dozen values) over `dir`.
fn store(dir: &TempDir, size: u64) -> Store {
    let mut s = Store::new(4 << 20, 1, 0.5).unwrap();
    s.attach_disk(DiskTier::open(&config(dir, size)).unwrap());
    s
}

fn value(i: usize) -> Vec<u8> {
    (0..V).map(|j| (i * 131 + j * 7 % 251) as u8).collect()
}

fn put(s: &Store, key: &str, data: &[u8]) {
    let mut r = s.reserve(key.as_bytes(), data.len() as u64).ok().unwrap();
    r.bytes_mut().copy_from_slice(data);
    s.commit(key.as_bytes(), r, memkv_proto::chunk_checksums(data));
}

fn get(s: &Store, key: &str) -> Option<Vec<u8>> {
    s.fetch_verified(key.as_bytes())
        .ok()
        .map(|v| v.span.as_slice().to_vec())
}

fn disk(s: &Store) -> &Arc<DiskTier> {
    s.disk().unwrap()
}

/// Puts 40 values (three times DRAM) and waits for the spills.
fn fill(s: &Store) {
    for i in 0..40 {
        put(s, &format!("k{i}"), &value(i));
    }
    disk(s).flush();
}

#[test]
fn evicted_values_come_back_from_disk_byte_exact_and_promote_on_the_second_hit() {
    let dir = TempDir::new("spill");
    let s = store(&dir, 64 << 20);
    fill(&s);
    let st = disk(&s).stats();
    assert!(
        st.spills.load(Relaxed) >= 25,
        "{} spills",
        st.spills.load(Relaxed)
    );
    for i in 0..40 {
        assert_eq!(get(&s, &format!("k{i}")), Some(value(i)), "k{i}");
    }
    assert!(st.hits.load(Relaxed) >= 25);
    assert_eq!(st.promotions.load(Relaxed), 0, "one hit does not promote");
    assert_eq!(get(&s, "k0"), Some(value(0)));
    assert_eq!(st.promotions.load(Relaxed), 1);
    let hits = st.hits.load(Relaxed);
    assert_eq!(get(&s, "k0"), Some(value(0)));
    assert_eq!(
        st.hits.load(Relaxed),
        hits,
        "a promoted value is served from DRAM"
    );
}

use std::sync::atomic::Ordering::Relaxed;

#[test]
fn a_flipped_byte_on_disk_is_a_miss_and_the_record_is_dropped() {
    let dir = TempDir::new("rot");
    let s = store(&dir, 64 << 20);
    fill(&s);
    // k0 was the first evicted: its value starts after the first segment's first header block.
    let seg = &dir.segments()[0];
    let mut bytes = std::fs::read(seg).unwrap();
    bytes[4096 + V / 2] ^= 0x40;
    std::fs::write(seg, &bytes).unwrap();
    assert_eq!(s.fetch_verified(b"k0").err(), Some(Status::NotFound));
    assert_eq!(disk(&s).stats().corrupt.load(Relaxed), 1);
    assert_eq!(s.exists(&[b"k0"], Duration::ZERO)[0].0, Status::NotFound);
    assert_eq!(get(&s, "k1"), Some(value(1)), "its neighbours are intact");
}

#[test]
fn a_restart_serves_what_was_on_disk_and_forgets_what_was_deleted() {
    let dir = TempDir::new("restart");
    {
        let s = store(&dir, 64 << 20);
        fill(&s);
        assert_eq!(s.delete(b"k1"), Status::Ok);
        put(&s, "k2", &value(99));
        disk(&s).flush();
    }
    let s = store(&dir, 64 << 20);
    let st = disk(&s).stats();
    assert!(st.recovered_items.load(Relaxed) >= 20);
    assert_eq!(get(&s, "k0"), Some(value(0)));
    assert_eq!(get(&s, "k1"), None, "a deleted value came back");
    assert_eq!(get(&s, "k2"), None, "an overwritten value came back");
    assert_eq!(get(&s, "k3"), Some(value(3)));
}

#[test]
fn a_record_cut_short_is_dropped_at_restart_and_the_rest_kept() {
    let dir = TempDir::new("torn");
    {
        let s = store(&dir, 64 << 20);
        fill(&s);
    }
    let seg = dir.segments().last().unwrap().clone();
    let len = std::fs::metadata(&seg).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(len - 4096).unwrap();
    let s = store(&dir, 64 << 20);
    let on_disk: Vec<usize> = (0..40)
        .filter(|i| s.exists(&[format!("k{i}").as_bytes()], Duration::ZERO)[0].0 == Status::Ok)
        .collect();
    let newest_spilled = (0..40)
        .rev()
        .find(|i| !on_disk.contains(i))
        .expect("one value was lost");
    for i in on_disk {
        assert_eq!(get(&s, &format!("k{i}")), Some(value(i)), "k{i}");
    }
    assert!(
        newest_spilled > 20,
        "k{newest_spilled} is not the newest record"
    );
}

#[test]
fn a_leased_value_on_disk_outlives_a_flood_until_it_is_loaded() {
    let dir = TempDir::new("lease");
    let s = store(&dir, 16 << 20);
    fill(&s);
    assert_eq!(
        s.exists(&[b"k0"], Duration::from_secs(60))[0],
        (Status::Ok, V as u64)
    );
    let spills = disk(&s).stats().spills.load(Relaxed);
    for i in 100..200 {
        put(&s, &format!("k{i}"), &value(i));
    }
    disk(&s).flush();
    let st = disk(&s).stats();
    assert_eq!(st.dropped("leased"), 0, "one lease held up the whole tier");
    assert!(st.spills.load(Relaxed) >= spills + 80);
    assert_eq!(get(&s, "k0"), Some(value(0)), "the lease did not hold");
    for i in 200..300 {
        put(&s, &format!("k{i}"), &value(i));
    }
    disk(&s).flush();
    assert_eq!(
        get(&s, "k0"),
        None,
        "loaded, the value is evicted like any other"
    );
    assert!(disk(&s).stats().used.load(Relaxed) <= 16 << 20);
}

#[test]
fn leases_hold_at_most_their_share_of_the_tier_and_spills_go_on() {
    let dir = TempDir::new("lease-bound");
    let s = store(&dir, 16 << 20);
    fill(&s);
    // Half of 16 MiB may be held: eight of its 1 MiB segments, three values each.
    let now = std::time::Instant::now();
    let answers: Vec<(usize, Status)> = (0..40)
        .map(|i| {
            (
                i,
                disk(&s)
                    .exists(format!("k{i}").as_bytes(), Duration::from_secs(60), now)
                    .0,
            )
        })
        .filter(|(_, st)| *st != Status::NotFound)
        .collect();
    let leased: Vec<usize> = answers
        .iter()
        .filter(|(_, st)| *st == Status::Ok)
        .map(|(i, _)| *i)
        .collect();
    let refused = answers.len() - leased.len();
    assert!(leased.len() >= 8 && refused > 0, "{answers:?}");
    assert!(answers
        .iter()
        .all(|(_, st)| matches!(st, Status::Ok | Status::OkNoLease)));
    let st = disk(&s).stats();
    assert!(st.leased_bytes.load(Relaxed) <= 8 << 20);
    assert_eq!(st.lease_denied.load(Relaxed), refused as u64);
    let spills = st.spills.load(Relaxed);
    for i in 100..200 {
        put(&s, &format!("k{i}"), &value(i));
    }
    disk(&s).flush();
    let st = disk(&s).stats();
    assert!(
        st.spills.load(Relaxed) >= spills + 80,
        "spills stopped behind the leases"
    );
    assert!(st.used.load(Relaxed) <= 16 << 20);
    for i in leased {
        assert_eq!(
            get(&s, &format!("k{i}")),
            Some(value(i)),
            "leased k{i} lost"
        );
    }
    assert_eq!(
        disk(&s).stats().leased_bytes.load(Relaxed),
        0,
        "loads release"
    );
}
