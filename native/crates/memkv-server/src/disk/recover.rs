//! The index rebuilt from the segments at start: each directory is scanned by a thread of its
//! own, newest segment first, reading only the records' headers (one block each, for values of
//! up to about 125 MiB under a short key). The newest record of a key wins; a tombstone kills
//! the older ones. A record cut short (a `kill -9` or a crash in the middle of its write) or a
//! header that does not match its checksum ends its segment: the file is cut there. A value
//! whose bytes were torn under a valid header is caught by its chunk checksums at its first
//! read, and dropped then.
//!
//! The scan stops at the recovery deadline: the segments not read by then (the oldest) are
//! removed, so the start stays bounded and nothing unindexed takes room.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::dir::{segment_path, Recovered, Segment};
use super::io::{open_segment, AlignedBuf};
use super::record::{self, Kind, BLOCK};
use super::{Key, Loc, Shared};

/// How often the scan logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// A record found by the scan.
struct Found {
    key: Key,
    kind: Kind,
    seq: u64,
    /// Index of its segment in the directory's list, and the value's offset in it.
    segment: usize,
    at: u64,
    len: u64,
    checksums: Arc<[u64]>,
}

struct Scanned {
    path: PathBuf,
    segments: Vec<Segment>,
    found: Vec<Found>,
    next_id: u64,
    degraded: bool,
}

/// Scans every directory (in parallel) and indexes what they hold.
pub(super) fn recover_all(dirs: &[PathBuf], deadline: Instant, shared: &Shared) -> Vec<Recovered> {
    let t = Instant::now();
    let scanned: Vec<Scanned> = std::thread::scope(|s| {
        let hs: Vec<_> = dirs
            .iter()
            .map(|d| s.spawn(move || scan_dir(d, deadline)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Newest record per key, over all directories (a key moves between them when their number
    // changes or one degrades).
    let mut newest: HashMap<Key, (usize, usize)> = HashMap::new();
    for (d, sc) in scanned.iter().enumerate() {
        for (i, f) in sc.found.iter().enumerate() {
            match newest.get(&f.key) {
                Some(&(od, oi)) if scanned[od].found[oi].seq > f.seq => {}
                _ => {
                    newest.insert(f.key.clone(), (d, i));
                }
            }
        }
    }
    let max_seq = scanned
        .iter()
        .flat_map(|s| s.found.iter().map(|f| f.seq))
        .max()
        .unwrap_or(0);
    shared.seq.store(max_seq + 1, Relaxed);
    let mut out: Vec<Recovered> = Vec::with_capacity(scanned.len());
    let mut items = 0u64;
    for (d, sc) in scanned.into_iter().enumerate() {
        let mut segments = sc.segments;
        for (i, f) in sc.found.into_iter().enumerate() {
            if f.kind != Kind::Value || newest.get(&f.key) != Some(&(d, i)) {
                continue;
            }
            let seg = &mut segments[f.segment];
            seg.records.push((f.key.clone(), f.seq));
            let loc = Loc {
                file: seg.file.clone(),
                dir: d as u16,
                seg: seg.id,
                at: f.at,
                len: f.len,
                seq: f.seq,
                checksums: f.checksums,
                hits: 0,
                promoted_as: 0,
            };
            let mut s = shared.shard(&f.key).lock().unwrap();
            shared.insert(&mut s, f.key, loc);
            items += 1;
        }
        // Scanned newest first; the writer wants them oldest first.
        segments.sort_by_key(|s| s.id);
        out.push(Recovered {
            path: sc.path,
            segments: VecDeque::from(segments),
            next_id: sc.next_id,
            degraded: sc.degraded,
        });
    }
    shared.stats.recovered_items.store(items, Relaxed);
    shared
        .stats
        .recovery_ms
        .store(t.elapsed().as_millis() as u64, Relaxed);
    tracing::info!(
        "disk tier: {items} values indexed from {} directories in {:.1} s",
        dirs.len(),
        t.elapsed().as_secs_f64()
    );
    out
}

/// The segment files of `dir`, newest first.
fn list_segments(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut ids: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            u64::from_str_radix(name.strip_suffix(".seg")?, 16).ok()
        })
        .collect();
    ids.sort_unstable_by(|a, b| b.cmp(a));
    Ok(ids)
}

fn scan_dir(dir: &Path, deadline: Instant) -> Scanned {
    let mut sc = Scanned {
        path: dir.to_path_buf(),
        segments: Vec::new(),
        found: Vec::new(),
        next_id: 1,
        degraded: false,
    };
    let ids = match std::fs::create_dir_all(dir).and_then(|()| list_segments(dir)) {
        Ok(ids) => ids,
        Err(e) => {
            tracing::error!(
                dir = %dir.display(),
                "disk tier: directory unusable ({e}); the server runs without it"
            );
            sc.degraded = true;
            return sc;
        }
    };
    sc.next_id = ids.first().map_or(1, |m| m + 1);
    let mut last_log = Instant::now();
    for (n, &id) in ids.iter().enumerate() {
        let path = segment_path(dir, id);
        if Instant::now() > deadline {
            tracing::warn!(
                dir = %dir.display(),
                "disk tier: recovery timeout; removing {} older segments unread",
                ids.len() - n
            );
            for &old in &ids[n..] {
                let _ = std::fs::remove_file(segment_path(dir, old));
            }
            break;
        }
        if last_log.elapsed() >= PROGRESS_EVERY {
            last_log = Instant::now();
            tracing::info!(
                dir = %dir.display(),
                "disk tier: recovery: {n}/{} segments, {} records",
                ids.len(),
                sc.found.len()
            );
        }
        // Writable to cut a torn tail; a read-only filesystem still gives its records.
        match open_segment(&path, true).or_else(|_| open_segment(&path, false)) {
            Ok((file, _)) => scan_segment(id, file, &path, &mut sc),
            Err(e) => tracing::error!(
                segment = %path.display(),
                "disk tier: cannot open segment ({e}); skipped"
            ),
        }
    }
    sc
}

/// Reads the headers of one segment into `sc`; cuts the file at a torn or unreadable record.
fn scan_segment(id: u64, file: File, path: &Path, sc: &mut Scanned) {
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let file = Arc::new(file);
    let index = sc.segments.len();
    let mut off = 0u64;
    let mut block = AlignedBuf::new(BLOCK as usize);
    let torn = loop {
        if off + BLOCK > size {
            break off < size;
        }
        if file.read_exact_at(&mut block, off).is_err() {
            break true;
        }
        let Some(hlen) = record::announced_len(&block) else {
            break true;
        };
        let header = if hlen > BLOCK {
            let mut big = AlignedBuf::new(hlen as usize);
            if file.read_exact_at(&mut big, off).is_err() {
                break true;
            }
            record::decode_header(&big)
        } else {
            record::decode_header(&block)
        };
        let Some(h) = header else {
            break true;
        };
        let rlen = hlen + record::round_up(h.value_len);
        if off + rlen > size {
            break true;
        }
        sc.found.push(Found {
            key: Arc::from(h.key),
            kind: h.kind,
            seq: h.seq,
            segment: index,
            at: off + hlen,
            len: h.value_len,
            checksums: h.checksums.into(),
        });
        off += rlen;
    };
    if torn {
        tracing::warn!(
            segment = %path.display(),
            "disk tier: segment ends in a torn or unreadable record at {off}; cut there"
        );
        if let Err(e) = file.set_len(off) {
            tracing::warn!(segment = %path.display(), "disk tier: cannot cut the segment: {e}");
        }
    }
    if off == 0 {
        let _ = std::fs::remove_file(path);
        return;
    }
    sc.segments.push(Segment {
        id,
        file,
        len: off,
        records: Vec::new(),
    });
}
