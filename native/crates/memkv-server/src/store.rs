//! The store: lanes addressed by key hash, plus the server-wide limits and counters, and the
//! tenants whose quotas the lanes charge (`crate::tenants`).

use std::time::Duration;

use memkv_proto::Status;

use crate::arena::LaneMemory;
use crate::disk::stats::DramCounters;
use crate::disk::DiskTier;
use crate::lane::{Lane, LaneStats, Pinned, Reservation, Value};
use crate::metrics::Metrics;
use crate::tenants::usage::Usage;
use crate::tenants::{TenantId, Tenants};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

pub struct Store {
    lanes: Vec<Lane>,
    pub max_value_len: u64,
    pub metrics: Arc<Metrics>,
    pub tenants: Arc<Tenants>,
    /// Each tenant's memory and counters, shared with the lanes.
    pub usage: Arc<Usage>,
    /// The disk tier behind the lanes (`--disk`), when there is one.
    disk: Option<Arc<DiskTier>>,
    dram: DramCounters,
}

impl Store {
    /// Splits `memory` bytes evenly over `lanes` lanes, reserving and pre-faulting all of it now.
    /// Each lane's share bounds its values and its index together (see `lane::index_charge`).
    pub fn new(memory: u64, lanes: usize, max_leased_fraction: f64) -> std::io::Result<Store> {
        Store::with_tenants(
            memory,
            lanes,
            max_leased_fraction,
            Tenants::implicit(None),
            false,
        )
    }

    /// `new`, with the values charged to `tenants`' quotas; with `share_values`, each lane's
    /// memory is a sealed memfd that same-host clients may map read-only (`lane_reader_fd`).
    pub fn with_tenants(
        memory: u64,
        lanes: usize,
        max_leased_fraction: f64,
        tenants: Tenants,
        share_values: bool,
    ) -> std::io::Result<Store> {
        let lanes = lanes.max(1);
        let per_lane = (memory / lanes as u64) as usize;
        let usage = Arc::new(Usage::new(tenants.iter().map(|t| t.quota)));
        let lanes = (0..lanes)
            .map(|i| {
                let mem = if share_values {
                    LaneMemory::new_shared(per_lane, &format!("memkv-lane-{i}"))?
                } else {
                    LaneMemory::new(per_lane)?
                };
                Ok(Lane::over(mem, max_leased_fraction, usage.clone()))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        // Announced for the longest key, so a value under the limit fits under any key.
        let max_value_len = lanes[0].max_value_len(memkv_proto::MAX_KEY_LEN);
        Ok(Store {
            lanes,
            max_value_len,
            metrics: Arc::default(),
            tenants: Arc::new(tenants),
            usage,
            disk: None,
            dram: DramCounters::default(),
        })
    }

    /// Lane `i`'s memory: its length and, when it is shared, a new read-only descriptor of it.
    /// None for a lane that does not exist.
    pub fn lane_reader_fd(&self, i: usize) -> Option<(u64, Option<std::io::Result<OwnedFd>>)> {
        let mem = self.lanes.get(i)?.memory();
        Some((mem.range().1 as u64, mem.reader_fd()))
    }

    /// The lane whose memory holds `addr`, and where in it (`--shm-share-values`: what a
    /// same-host client finds in its mapping of that lane).
    pub(crate) fn lane_at(&self, addr: usize) -> Option<(u32, u64)> {
        self.lanes.iter().enumerate().find_map(|(i, l)| {
            let (start, len) = l.memory_range();
            (addr >= start && addr < start + len).then(|| (i as u32, (addr - start) as u64))
        })
    }

    /// Puts `disk` behind the lanes: what they evict is spilled to it, and GET, EXISTS and
    /// DELETE look there after DRAM.
    pub fn attach_disk(&mut self, disk: Arc<DiskTier>) {
        for lane in &self.lanes {
            let d = disk.clone();
            lane.set_spill(Arc::new(move |k: &[u8], v: Arc<Value>| d.offer(k, v)));
        }
        self.disk = Some(disk);
    }

    pub fn disk(&self) -> Option<&Arc<DiskTier>> {
        self.disk.as_ref()
    }

    fn lane_index(&self, key: &[u8]) -> usize {
        let h = twox_hash::XxHash3_64::oneshot(key);
        (h % self.lanes.len() as u64) as usize
    }

    pub(crate) fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    pub(crate) fn lane(&self, key: &[u8]) -> &Lane {
        &self.lanes[self.lane_index(key)]
    }

    pub fn reserve(&self, key: &[u8], len: u64) -> Result<Reservation<'_>, Status> {
        self.reserve_as(0, key, len)
    }

    /// Room for `tenant`'s value of `len` bytes under `key`. When its quota is full the
    /// tenant's own values go first, in its key's lane and then in the others (each lane
    /// locked on its own); OverQuota when none of them can go (all leased or being sent), and
    /// then no other tenant's value was touched.
    pub fn reserve_as(
        &self,
        tenant: TenantId,
        key: &[u8],
        len: u64,
    ) -> Result<Reservation<'_>, Status> {
        self.reserve_for(tenant, key, len, None)
    }

    /// `reserve_as`, with the span aligned as `Lane::reserve_aligned` says when `align` is set.
    pub(crate) fn reserve_for(
        &self,
        tenant: TenantId,
        key: &[u8],
        len: u64,
        align: Option<u64>,
    ) -> Result<Reservation<'_>, Status> {
        if len > self.max_value_len {
            return Err(Status::TooLarge);
        }
        // Larger than the whole quota: refused before any of the tenant's values goes for it.
        let need = crate::arena::footprint(len)
            + crate::lane::tenant_charge(&self.usage, tenant, key.len(), len);
        if need > self.usage.slot(tenant).quota {
            return Err(Status::OverQuota);
        }
        let home = self.lane_index(key);
        loop {
            let lane = &self.lanes[home];
            let res = match align {
                None => lane.reserve_as(tenant, key.len(), len),
                Some(a) => lane.reserve_aligned(tenant, key.len(), len, a),
            };
            match res {
                Err(Status::OverQuota) => {
                    let n = self.lanes.len();
                    if !(0..n).any(|i| self.lanes[(home + i) % n].evict_own(tenant)) {
                        return Err(Status::OverQuota);
                    }
                }
                r => return r,
            }
        }
    }

    /// Makes a filled reservation visible under `key`. Any copy of an older value on disk is
    /// forgotten after the new one is in DRAM, so no GET in between can find neither.
    pub fn commit(&self, key: &[u8], res: Reservation<'_>, checksums: Vec<u64>) {
        self.lane(key).commit(key, res, checksums);
        if let Some(d) = &self.disk {
            d.forget(key);
        }
    }

    /// EXISTS of a batch, one (status, value length) per key in order, with a lease of at most
    /// `MAX_LEASE_MS` (longer asks are cut to it). Keys are grouped by lane so that each lane
    /// is locked once per run of its keys (`Lane::exists`), not once per key.
    pub fn exists(&self, keys: &[&[u8]], lease: Duration) -> Vec<(Status, u64)> {
        let lease = lease.min(Duration::from_millis(memkv_proto::MAX_LEASE_MS));
        let mut out = vec![(Status::NotFound, 0); keys.len()];
        if let [lane] = &self.lanes[..] {
            let at: Vec<u32> = (0..keys.len() as u32).collect();
            lane.exists(keys, &at, lease, &mut out);
            self.exists_on_disk(keys, lease, &mut out);
            return out;
        }
        // A counting sort of the key positions by lane: `at[start[l]..start[l + 1]]` are lane
        // l's keys, in batch order.
        let lane_of: Vec<u32> = keys.iter().map(|k| self.lane_index(k) as u32).collect();
        let mut start = vec![0usize; self.lanes.len() + 1];
        for &l in &lane_of {
            start[l as usize + 1] += 1;
        }
        let mut sum = 0;
        for s in start.iter_mut() {
            sum += *s;
            *s = sum;
        }
        let mut next = start.clone();
        let mut at = vec![0u32; keys.len()];
        for (i, &l) in lane_of.iter().enumerate() {
            at[next[l as usize]] = i as u32;
            next[l as usize] += 1;
        }
        for (l, lane) in self.lanes.iter().enumerate() {
            lane.exists(keys, &at[start[l]..start[l + 1]], lease, &mut out);
        }
        self.exists_on_disk(keys, lease, &mut out);
        out
    }

    /// Answers from the disk tier the keys DRAM did not have.
    fn exists_on_disk(&self, keys: &[&[u8]], lease: Duration, out: &mut [(Status, u64)]) {
        let Some(d) = &self.disk else { return };
        let now = std::time::Instant::now();
        for (k, o) in keys.iter().zip(out.iter_mut()) {
            if o.0 == Status::NotFound {
                *o = d.exists(k, lease, now);
            }
        }
    }

    /// GET lookup. The first chunk (all of a value up to `CHECKSUM_CHUNK`) is verified here,
    /// so a mismatch there is reported as `Corrupt` before the reply starts; every later chunk is
    /// verified before it is sent, by the verifier pool (see `cmd::get`, `verify`). The value is
    /// pinned until the returned guard drops; NoSpace when the lane's pinned bytes are at their
    /// bound.
    pub fn fetch_verified(&self, key: &[u8]) -> Result<Pinned<'_>, Status> {
        let v = match self.lane(key).fetch(key)? {
            None => return self.fetch_from_disk(key),
            Some(v) => {
                self.dram.hits.fetch_add(1, Relaxed);
                self.dram.read_bytes.fetch_add(v.span.len(), Relaxed);
                v
            }
        };
        match v {
            v if v.chunk_ok(0) => Ok(v),
            v => {
                self.drop_corrupt(key, &v);
                Err(Status::Corrupt)
            }
        }
    }

    /// Drops a value whose bytes no longer match their checksum, so it is never served again.
    pub fn drop_corrupt(&self, key: &[u8], v: &Arc<Value>) {
        tracing::error!(key = %String::from_utf8_lossy(key), "checksum mismatch; value dropped");
        self.metrics.error("corrupt");
        self.lane(key).drop_if_same(key, v);
    }

    /// Deletes `key` from both tiers: from disk first, so that no GET in between promotes the
    /// disk copy back into DRAM.
    pub fn delete(&self, key: &[u8]) -> Status {
        let on_disk = self.disk.as_ref().is_some_and(|d| d.forget(key));
        match self.lane(key).delete(key) {
            Status::NotFound if on_disk => Status::Ok,
            s => s,
        }
    }

    /// Every lane's memory (start, length), for RDMA registration.
    pub fn memory_ranges(&self) -> Vec<(usize, usize)> {
        self.lanes.iter().map(Lane::memory_range).collect()
    }

    pub fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    pub fn lane_stats(&self) -> LaneStats {
        self.lanes
            .iter()
            .map(|l| l.stats())
            .fold(LaneStats::default(), |a, b| LaneStats {
                items: a.items + b.items,
                used_bytes: a.used_bytes + b.used_bytes,
                capacity_bytes: a.capacity_bytes + b.capacity_bytes,
                leased_bytes: a.leased_bytes + b.leased_bytes,
                in_transfer_bytes: a.in_transfer_bytes + b.in_transfer_bytes,
                receiving_bytes: a.receiving_bytes + b.receiving_bytes,
                index_bytes: a.index_bytes + b.index_bytes,
                evictions: a.evictions + b.evictions,
            })
    }

    pub fn stats_json(&self) -> String {
        let lanes = self.lane_stats();
        let tenants = self.tenants.is_named().then(|| self.tenant_rows());
        let mut v: serde_json::Value = serde_json::from_str(&self.metrics.to_json(
            &lanes,
            self.lanes.len(),
            tenants.as_deref(),
        ))
        .expect("the metrics render valid JSON");
        let disk = self.disk.as_ref().map(|d| {
            let dirs = d.dirs().into_iter();
            (
                d.stats(),
                dirs.map(|(p, g)| (p.display().to_string(), g)).collect(),
            )
        });
        v["tiers"] = crate::disk::stats::tiers_json(&self.dram, &lanes, disk);
        v.to_string()
    }

    /// The Prometheus text: the server's counters, the per-tenant and the per-tier ones.
    pub fn prometheus(&self) -> String {
        let lanes = self.lane_stats();
        let tenants = self.tenants.is_named().then(|| self.tenant_rows());
        let mut s = self.metrics.to_prometheus(&lanes, tenants.as_deref());
        let disk = self.disk.as_ref().map(|d| d.stats());
        s.push_str(&crate::disk::stats::tiers_prometheus(
            &self.dram, &lanes, disk,
        ));
        s
    }

    /// Each tenant's name with its slot, in table order.
    fn tenant_rows(&self) -> Vec<(&str, &crate::tenants::usage::Slot)> {
        self.tenants
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), self.usage.slot(i as TenantId)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_cut_to_an_hour() {
        let s = Store::new(1 << 20, 1, 0.5).unwrap();
        let r = s.reserve(b"k", 10).ok().unwrap();
        s.commit(b"k", r, memkv_proto::chunk_checksums(&[0; 10]));
        let forty_nine_days = Duration::from_millis(u32::MAX as u64);
        assert_eq!(s.exists(&[b"k"], forty_nine_days)[0].0, Status::Ok);
        let left = s.lane(b"k").lease_left(b"k").unwrap();
        assert!(
            left <= Duration::from_millis(memkv_proto::MAX_LEASE_MS),
            "{left:?}"
        );
    }

    fn put(s: &Store, key: &[u8], len: u64) {
        let r = s.reserve(key, len).ok().unwrap();
        s.commit(key, r, memkv_proto::chunk_checksums(&vec![0; len as usize]));
    }

    /// A batch spread over every lane answers each key at its own place, repeats included, and
    /// leases a key named twice once.
    #[test]
    fn a_batch_over_several_lanes_answers_in_order() {
        for lanes in [1, 4] {
            let s = Store::new(4 << 20, lanes, 0.5).unwrap();
            let names: Vec<Vec<u8>> = (0..600).map(|i| format!("k/{i}").into_bytes()).collect();
            for (i, k) in names.iter().enumerate().filter(|(i, _)| i % 3 != 0) {
                put(&s, k, 1 + i as u64);
            }
            let mut keys: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
            keys.push(&names[1]);
            keys.push(&names[3]);
            let want = |i: usize| match i % 3 {
                0 => (Status::NotFound, 0),
                _ => (Status::Ok, 1 + i as u64),
            };
            let got = s.exists(&keys, Duration::ZERO);
            assert_eq!(got.len(), 602);
            for (i, g) in got[..600].iter().enumerate() {
                assert_eq!(*g, want(i), "lanes {lanes}, key {i}");
            }
            assert_eq!(got[600..], [want(1), want(3)]);
            assert_eq!(s.lane_stats().leased_bytes, 0);
            let leased = s.exists(&[&names[1], &names[1], &names[2]], Duration::from_secs(60));
            assert_eq!(leased, [(Status::Ok, 2), (Status::Ok, 2), (Status::Ok, 3)]);
            assert_eq!(
                s.lane_stats().leased_bytes,
                5,
                "a repeated key is leased once"
            );
            assert!(s.exists(&[], Duration::ZERO).is_empty());
        }
    }

    fn two_tenants(quota_a: u64, lanes: usize) -> Store {
        let t = |name: &str, key: u8, quota: u64| crate::tenants::Tenant {
            name: name.into(),
            auth_key: Some(vec![key; 32]),
            cert_subject: None,
            prefix: format!("{name}/").into_bytes(),
            quota,
            read_only: false,
        };
        let tenants = Tenants::named(vec![t("a", 1, quota_a), t("b", 2, 1 << 30)]).unwrap();
        Store::with_tenants(8 << 20, lanes, 0.5, tenants, false).unwrap()
    }

    fn put_as(s: &Store, t: TenantId, key: &str, len: u64) -> Status {
        match s.reserve_as(t, key.as_bytes(), len) {
            Ok(r) => {
                s.commit(
                    key.as_bytes(),
                    r,
                    memkv_proto::chunk_checksums(&vec![0; len as usize]),
                );
                Status::Ok
            }
            Err(st) => st,
        }
    }

    fn items(s: &Store, t: TenantId) -> u64 {
        s.usage
            .slot(t)
            .items
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn used(s: &Store, t: TenantId) -> u64 {
        s.usage
            .slot(t)
            .used
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One value of 64 KiB under a key like "a/1", as the lanes charge it to a tenant.
    const CHARGE: u64 =
        (64 << 10) + crate::lane::ENTRY_OVERHEAD + crate::lane::OWN_QUEUE_CHARGE + 3 + 8;

    /// Over several lanes the victim is the oldest of the tenant's values in the first lane
    /// that has one (its key's own, first): lanes never lock each other.
    #[test]
    fn a_tenant_at_its_quota_evicts_its_own_values_and_no_one_elses() {
        for lanes in [1, 4] {
            let s = two_tenants(4 * CHARGE, lanes);
            for i in 0..4 {
                assert_eq!(put_as(&s, 1, &format!("b/{i}"), 64 << 10), Status::Ok);
            }
            for i in 0..10 {
                assert_eq!(put_as(&s, 0, &format!("a/{i}"), 64 << 10), Status::Ok);
                assert!(used(&s, 0) <= 4 * CHARGE, "{} over the quota", used(&s, 0));
            }
            let has = |k: &str| s.exists(&[k.as_bytes()], Duration::ZERO)[0].0 == Status::Ok;
            assert!(
                (0..4).all(|i| has(&format!("b/{i}"))),
                "b's values untouched"
            );
            assert!(has("a/9"), "the value just stored stays");
            if lanes == 1 {
                assert!(
                    (6..10).all(|i| has(&format!("a/{i}"))),
                    "a keeps its newest"
                );
            }
            let (a, b) = (s.usage.slot(0), s.usage.slot(1));
            let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(
                (n(&a.evictions), n(&a.quota_evictions), n(&a.items)),
                (6, 6, 4)
            );
            assert_eq!((n(&b.evictions), n(&b.items)), (0, 4));
            assert_eq!(used(&s, 1), 4 * CHARGE);
        }
    }

    #[test]
    fn a_tenant_keeps_the_values_it_read_and_evicts_its_own_behind_many_of_anothers() {
        // Room for three of a's values under keys of up to six bytes ("a/2999").
        let s = two_tenants(3 * CHARGE + 9, 1);
        for i in 0..8000 {
            assert_eq!(put_as(&s, 1, &format!("b/{i}"), 64), Status::Ok);
        }
        for i in 0..3 {
            assert_eq!(put_as(&s, 0, &format!("a/{i}"), 64 << 10), Status::Ok);
        }
        drop(s.fetch_verified(b"a/0").ok().unwrap());
        assert_eq!(put_as(&s, 0, "a/3", 64 << 10), Status::Ok);
        let has = |k: &str| s.exists(&[k.as_bytes()], Duration::ZERO)[0].0 == Status::Ok;
        assert!(
            has("a/0") && !has("a/1"),
            "the value read again stays, the oldest unread goes"
        );
        // Thousands of evictions of a's own, each without a walk over b's 8000 values.
        for i in 4..3000 {
            assert_eq!(put_as(&s, 0, &format!("a/{i}"), 64 << 10), Status::Ok);
        }
        assert_eq!(items(&s, 1), 8000);
        assert_eq!(items(&s, 0), 3);
    }

    #[test]
    fn a_tenant_with_nothing_of_its_own_to_evict_is_refused_and_others_keep_theirs() {
        let s = two_tenants(2 * CHARGE, 4);
        assert_eq!(put_as(&s, 1, "b/0", 64 << 10), Status::Ok);
        assert_eq!(put_as(&s, 0, "a/0", 64 << 10), Status::Ok);
        assert_eq!(put_as(&s, 0, "a/1", 64 << 10), Status::Ok);
        // Both of a's values leased: none of its own can go.
        let leased = s.exists(&[b"a/0", b"a/1"], Duration::from_secs(60));
        assert!(leased.iter().all(|(st, _)| *st == Status::Ok));
        assert_eq!(put_as(&s, 0, "a/2", 64 << 10), Status::OverQuota);
        assert_eq!(s.exists(&[b"b/0"], Duration::ZERO)[0].0, Status::Ok);
        assert_eq!(used(&s, 0), 2 * CHARGE, "a refused PUT charges nothing");
        assert_eq!(s.lane_stats().evictions, 0);
        // A value larger than the whole quota is refused without evicting anything.
        let s = two_tenants(2 * CHARGE, 4);
        assert_eq!(put_as(&s, 0, "a/0", 64 << 10), Status::Ok);
        assert_eq!(put_as(&s, 0, "a/big", 3 * CHARGE), Status::OverQuota);
        assert_eq!(s.exists(&[b"a/0"], Duration::ZERO)[0].0, Status::Ok);
    }

    #[test]
    fn overwrites_deletes_and_dropped_reservations_give_the_quota_back() {
        let s = two_tenants(1 << 30, 4);
        assert_eq!(put_as(&s, 0, "a/x", 1000), Status::Ok);
        let one = used(&s, 0);
        assert_eq!(put_as(&s, 0, "a/x", 1000), Status::Ok);
        assert_eq!(used(&s, 0), one, "an overwrite replaces the charge");
        let r = s.reserve_as(0, b"a/y", 5000).ok().unwrap();
        assert!(used(&s, 0) > one, "a value being received is charged");
        drop(r);
        assert_eq!(used(&s, 0), one);
        assert_eq!(s.delete(b"a/x"), Status::Ok);
        assert_eq!(used(&s, 0), 0);
        assert_eq!(items(&s, 0), 0);
    }

    #[test]
    fn stats_show_each_tenant_only_with_a_tenants_file() {
        let s = two_tenants(1 << 20, 4);
        put_as(&s, 1, "b/k", 10);
        let v: serde_json::Value = serde_json::from_str(&s.stats_json()).unwrap();
        assert_eq!(v["tenants"]["b"]["items"], 1);
        assert_eq!(v["tenants"]["a"]["quota_bytes"], 1 << 20);
        let prom = s.prometheus();
        assert!(
            prom.contains("memkv_tenant_items{tenant=\"b\"} 1"),
            "{prom}"
        );
        assert!(
            prom.contains("# TYPE memkv_tenant_puts_total counter"),
            "{prom}"
        );
        let plain = Store::new(1 << 20, 1, 0.5).unwrap();
        assert!(!plain.stats_json().contains("tenants"));
        assert!(!plain.prometheus().contains("tenant"));
    }

    #[test]
    fn corrupt_values_are_dropped_not_served() {
        let s = Store::new(1 << 20, 2, 0.5).unwrap();
        let mut r = s.reserve(b"k", 100).ok().unwrap();
        r.bytes_mut().fill(7);
        let sums = memkv_proto::chunk_checksums(r.bytes_mut());
        s.commit(b"k", r, sums);
        let Ok(v) = s.fetch_verified(b"k") else {
            panic!("intact value must be served")
        };
        v.span.corrupt_for_test(42);
        drop(v);
        assert_eq!(s.fetch_verified(b"k").err(), Some(Status::Corrupt));
        assert_eq!(
            s.fetch_verified(b"k").err(),
            Some(Status::NotFound),
            "dropped after mismatch"
        );
        assert_eq!(s.metrics.errors("corrupt"), 1);
        assert_eq!(s.lane_stats().used_bytes, 0);
    }
}
