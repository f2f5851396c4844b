//! One lane: an independent shard of the store with its own index, memory, eviction queues,
//! leases and lock. Keys map to lanes by hash, so lanes never coordinate.
//!
//! The lane holds its parts under one lock: the index (`index`), S3-FIFO's eviction queues
//! (`s3fifo`), the leases (`leases`), and the counts of bytes being received and sent, held by
//! the handles of `pins`. Each value belongs to a tenant (`crate::tenants`): the lane charges
//! it to the tenant's quota from reservation until it leaves the index, and under the tenant's
//! own pressure (its quota full) evicts only that tenant's values (`Lane::evict_own`). A full
//! lane makes room for a tenant at its share of the lane from that tenant's values first, too
//! (`Lane::evict_for`).

mod index;
mod leases;
mod own;
mod pins;
mod s3fifo;
#[cfg(test)]
mod testing;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use memkv_proto::Status;

use crate::arena::{footprint, LaneMemory};
use crate::tenants::usage::Usage;
use crate::tenants::TenantId;
pub use index::{index_charge, Value, ENTRY_OVERHEAD};
use index::{Entry, Key};
use leases::Leases;
use own::OwnQueues;
pub use pins::{Pinned, Reservation};
use s3fifo::Queues;

/// Keys an EXISTS looks up under one hold of a lane's lock: taking it once per key cost more
/// than the lookup itself, and this many lookups hold it for a few microseconds at most, so a
/// PUT or GET on the lane never waits long behind a large batch.
const LOOKUPS_PER_LOCK: usize = 256;

struct Inner {
    index: HashMap<Key, Entry>,
    queues: Queues,
    /// The values of each tenant with a quota, oldest first (`evict_own`'s victims).
    own: OwnQueues,
    leases: Leases,
    /// Bytes of values being sent.
    in_transfer: u64,
    /// Bytes of reservations being filled.
    receiving: u64,
    /// Index memory charged against the lane's capacity, with the value bytes.
    index_bytes: u64,
    next_gen: u64,
    /// Each tenant's charge against its quota; shared by every lane of the store.
    usage: Arc<Usage>,
}

impl Inner {
    fn pinned(&self) -> u64 {
        self.leases.bytes + self.in_transfer
    }

    /// Queue and lease items go stale when a key is overwritten or deleted; they are dropped
    /// once they outnumber the live entries, so overwrites cannot grow them without bound.
    fn compact(&mut self) {
        let live = 2 * self.index.len() + 64;
        self.queues.compact(&self.index, live);
        self.leases.compact(&self.index, live);
    }

    /// Indexes `tenant`'s `value` under `key` (its charge already counted, to the lane and to
    /// the tenant's quota), replacing any older value.
    fn insert(&mut self, key: Key, value: Arc<Value>, charge: u64, tenant: TenantId) {
        self.remove(&key);
        let gen = self.next_gen;
        self.next_gen += 1;
        let len = value.span.len();
        let in_main = self.queues.admit(&key, gen, len);
        self.index.insert(
            key.clone(),
            Entry {
                value,
                gen,
                freq: 0,
                in_main,
                lease_until: None,
                charge,
                tenant,
            },
        );
        self.usage
            .slot(tenant)
            .items
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.usage.bounded(tenant) {
            self.own
                .admit(tenant, &key, gen, footprint(len) + charge, &self.index);
        }
        self.compact();
    }

    /// Unlinks `key`; its memory returns once no reader holds the value. Queue entries for it go
    /// stale (their generation no longer matches) and are skipped when popped.
    fn remove(&mut self, key: &[u8]) -> bool {
        let Some(mut e) = self.index.remove(key) else {
            return false;
        };
        self.queues.forget(&e);
        self.leases.release(&mut e);
        self.index_bytes -= e.charge;
        let charged = footprint(e.value.span.len()) + e.charge;
        self.usage.release(e.tenant, charged);
        if self.usage.bounded(e.tenant) {
            self.own.forget(e.tenant, charged);
        }
        self.usage
            .slot(e.tenant)
            .items
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        true
    }
}

/// Heap bytes an entry of a tenant with a quota costs on top of `ENTRY_OVERHEAD`: its places in
/// the tenant's own queue (`own`), which holds up to about twice its live entries.
pub const OWN_QUEUE_CHARGE: u64 = 64;

/// The index charge of `tenant`'s value of `len` bytes under a key of `key_len` bytes.
pub fn tenant_charge(usage: &Usage, tenant: TenantId, key_len: usize, len: u64) -> u64 {
    let own = if usage.bounded(tenant) {
        OWN_QUEUE_CHARGE
    } else {
        0
    };
    index_charge(key_len, len) + own
}

/// Counters a lane reports; summed over lanes by the store.
#[derive(Default, Debug, Clone, Copy)]
pub struct LaneStats {
    pub items: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub leased_bytes: u64,
    pub in_transfer_bytes: u64,
    pub receiving_bytes: u64,
    pub index_bytes: u64,
    pub evictions: u64,
}

/// Where a lane hands the values it evicts (the disk tier's spill queue). Called without the
/// lane's lock held; it must not block (it copies the value or drops it) and it is the last
/// holder of the value, so the value's memory is free once it returns.
pub type SpillHook = Arc<dyn Fn(&[u8], Arc<Value>) + Send + Sync>;

pub struct Lane {
    mem: Arc<LaneMemory>,
    spill: OnceLock<SpillHook>,
    inner: Mutex<Inner>,
    /// Bound on pinned bytes (leased or being sent), and on bytes being received.
    max_pinned_bytes: u64,
    evictions: std::sync::atomic::AtomicU64,
    /// What `Inner` holds too, readable without the lock (the quotas never change).
    usage: Arc<Usage>,
}

impl Lane {
    /// A lane whose values all belong to the implicit tenant, without a quota.
    pub fn new(bytes: usize, max_leased_fraction: f64) -> std::io::Result<Lane> {
        Lane::with_usage(bytes, max_leased_fraction, Arc::new(Usage::unbounded()))
    }

    /// A lane charging its values to the tenants of `usage`.
    pub fn with_usage(
        bytes: usize,
        max_leased_fraction: f64,
        usage: Arc<Usage>,
    ) -> std::io::Result<Lane> {
        Ok(Lane::over(
            LaneMemory::new(bytes)?,
            max_leased_fraction,
            usage,
        ))
    }

    /// A lane over `mem` (private or shared memory), charging its values to `usage`.
    pub fn over(mem: Arc<LaneMemory>, max_leased_fraction: f64, usage: Arc<Usage>) -> Lane {
        let max_pinned_bytes = (mem.capacity() as f64 * max_leased_fraction) as u64;
        Lane {
            mem,
            inner: Mutex::new(Inner {
                index: HashMap::new(),
                queues: Queues::default(),
                own: OwnQueues::default(),
                leases: Leases::default(),
                in_transfer: 0,
                receiving: 0,
                index_bytes: 0,
                next_gen: 1,
                usage: usage.clone(),
            }),
            max_pinned_bytes,
            evictions: Default::default(),
            usage,
            spill: OnceLock::new(),
        }
    }

    /// The lane's memory, for a same-host client that maps it (`--shm-share-values`).
    pub fn memory(&self) -> &Arc<LaneMemory> {
        &self.mem
    }

    /// Hands every value this lane evicts from now on to `hook` instead of dropping it.
    pub fn set_spill(&self, hook: SpillHook) {
        let _ = self.spill.set(hook);
    }

    pub fn capacity(&self) -> u64 {
        self.mem.capacity()
    }

    /// The lane's memory (start, length): every value's bytes lie inside it.
    pub fn memory_range(&self) -> (usize, usize) {
        self.mem.range()
    }

    /// The largest value a key of `key_len` bytes can have here, its index charge included.
    pub fn max_value_len(&self, key_len: usize) -> u64 {
        // Less one alignment unit, the most `footprint` rounds a value up.
        self.capacity()
            .saturating_sub(index_charge(key_len, self.capacity()) + 64)
    }

    /// Whether `len` more pinned bytes fit the bound. A lane with nothing pinned always takes
    /// one value, so a value larger than the bound can still be stored and read.
    fn may_pin(&self, inner: &Inner, len: u64) -> bool {
        inner.pinned() == 0 || inner.pinned() + len <= self.max_pinned_bytes
    }

    /// Reserves room for a value of `len` bytes under a key of `key_len` bytes, evicting as
    /// needed so that values and index together stay within the lane's capacity. The caller
    /// fills the span without any lock held, then commits it. NoSpace when nothing more can be
    /// evicted or the bytes being received are at their bound (the same share as pins: slow
    /// writers cannot reserve the whole lane, nor readers pin it).
    pub fn reserve(&self, key_len: usize, len: u64) -> Result<Reservation<'_>, Status> {
        self.reserve_as(0, key_len, len)
    }

    /// `reserve` for tenant `tenant`, charged to its quota first: OverQuota, with nothing
    /// evicted, when the charge does not fit (the store then evicts the tenant's own values,
    /// `evict_own`, and asks again).
    pub fn reserve_as(
        &self,
        tenant: TenantId,
        key_len: usize,
        len: u64,
    ) -> Result<Reservation<'_>, Status> {
        self.reserve_in(tenant, key_len, len, None)
    }

    /// `reserve_as`, with the span starting on a multiple of `align` and rounded up to one: the
    /// buffer of a direct read from the disk tier.
    pub fn reserve_aligned(
        &self,
        tenant: TenantId,
        key_len: usize,
        len: u64,
        align: u64,
    ) -> Result<Reservation<'_>, Status> {
        self.reserve_in(tenant, key_len, len, Some(align))
    }

    fn reserve_in(
        &self,
        tenant: TenantId,
        key_len: usize,
        len: u64,
        align: Option<u64>,
    ) -> Result<Reservation<'_>, Status> {
        let charge = tenant_charge(&self.usage, tenant, key_len, len);
        let size = align.map_or(footprint(len), |a| len.max(1).div_ceil(a) * a);
        if size.saturating_add(charge) > self.capacity() {
            return Err(Status::TooLarge);
        }
        let mut guard = self.inner.lock().unwrap();
        if guard.receiving > 0 && guard.receiving + len > self.max_pinned_bytes {
            return Err(Status::NoSpace);
        }
        // The quota counts the arena footprint, as the value's release does (`Inner::remove`).
        let quota_need = footprint(len) + charge;
        if !guard.usage.try_charge(tenant, quota_need) {
            return Err(Status::OverQuota);
        }
        loop {
            let inner = &mut *guard;
            let need = size + charge;
            let room = self.mem.used() + inner.index_bytes + need <= self.capacity();
            let alloc = || match align {
                None => self.mem.alloc(len),
                Some(a) => self.mem.alloc_aligned(len, a),
            };
            if let Some(span) = room.then(alloc).flatten() {
                inner.index_bytes += charge;
                inner.receiving += len;
                return Ok(Reservation {
                    span: Some(span),
                    lane: self,
                    charge,
                    tenant,
                });
            }
            let Some((key, value)) = self.evict_for(inner, tenant, need) else {
                inner.usage.release(tenant, quota_need);
                return Err(Status::NoSpace);
            };
            // The spill copies the value out (or drops it), so the lock is not held meanwhile;
            // dropping the value here without a spill frees its memory at once.
            if let Some(spill) = self.spill.get() {
                drop(guard);
                spill(&key, value);
                guard = self.inner.lock().unwrap();
            }
        }
    }

    /// Makes a filled reservation visible under `key`, replacing any older value.
    pub fn commit(&self, key: &[u8], mut res: Reservation<'_>, checksums: Vec<u64>) {
        let span = res.span.take().expect("committed once");
        let value = Arc::new(Value { span, checksums });
        let mut inner = self.inner.lock().unwrap();
        inner.receiving -= value.span.len();
        inner.insert(Arc::from(key), value, res.charge, res.tenant);
    }

    /// A value read back from the disk tier, to send: committed under `key` (a promotion) when
    /// `promote` agrees, asked under the lane's lock with whether `key` holds a value here now;
    /// else sent without entering the index and freed when the send ends. Pinned either way,
    /// like a GET hit.
    pub fn commit_or_detach(
        &self,
        key: &[u8],
        mut res: Reservation<'_>,
        checksums: Vec<u64>,
        promote: impl FnOnce(bool, &Arc<Value>) -> bool,
    ) -> Pinned<'_> {
        let span = res.span.take().expect("committed once");
        let value = Arc::new(Value { span, checksums });
        let mut inner = self.inner.lock().unwrap();
        let len = value.span.len();
        inner.receiving -= len;
        inner.in_transfer += len;
        if promote(inner.index.contains_key(key), &value) {
            inner.insert(Arc::from(key), value.clone(), res.charge, res.tenant);
        } else {
            inner.index_bytes -= res.charge;
            inner.usage.release(res.tenant, footprint(len) + res.charge);
        }
        Pinned { value, lane: self }
    }

    /// EXISTS of the keys `at` names in `keys`: each answer (status, value length) goes to the
    /// same place in `out`. With `lease` > 0 a hit is protected from eviction until the lease
    /// ends or a GET releases it, within the lane's leased-bytes bound. The lock is taken once
    /// per `LOOKUPS_PER_LOCK` keys, not once per key.
    pub fn exists(&self, keys: &[&[u8]], at: &[u32], lease: Duration, out: &mut [(Status, u64)]) {
        for part in at.chunks(LOOKUPS_PER_LOCK) {
            let now = Instant::now();
            let mut guard = self.inner.lock().unwrap();
            let inner = &mut *guard;
            inner.leases.expire(&mut inner.index, now);
            for &i in part {
                let i = i as usize;
                out[i] = self.exists_locked(inner, keys[i], now, lease);
            }
        }
    }

    fn exists_locked(
        &self,
        inner: &mut Inner,
        key: &[u8],
        now: Instant,
        lease: Duration,
    ) -> (Status, u64) {
        let Some((k, e)) = inner.index.get_key_value(key) else {
            return (Status::NotFound, 0);
        };
        let len = e.value.span.len();
        if lease.is_zero() {
            return (Status::Ok, len);
        }
        if e.lease_until.is_none() && inner.pinned() + len > self.max_pinned_bytes {
            return (Status::OkNoLease, len);
        }
        let k = k.clone();
        let e = inner.index.get_mut(key).unwrap();
        if inner.leases.grant(e, k, now + lease) {
            inner.compact();
        }
        (Status::Ok, len)
    }

    /// GET: takes a pinned reference to the value (so eviction cannot free it mid-send), counts
    /// the access for S3-FIFO and turns any lease on it into the transfer's pin. Err(NoSpace)
    /// when pinning it would pass the lane's bound on pinned bytes.
    pub fn fetch(&self, key: &[u8]) -> Result<Option<Pinned<'_>>, Status> {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.leases.expire(&mut inner.index, Instant::now());
        let Some(e) = inner.index.get(key) else {
            return Ok(None);
        };
        let (len, leased) = (e.value.span.len(), e.lease_until.is_some());
        if !leased && !self.may_pin(inner, len) {
            return Err(Status::NoSpace);
        }
        let e = inner.index.get_mut(key).unwrap();
        e.freq = (e.freq + 1).min(3);
        inner.leases.release(e);
        let value = e.value.clone();
        inner.in_transfer += len;
        Ok(Some(Pinned { value, lane: self }))
    }

    /// Drops `key` if it still holds `value` (used after a checksum mismatch).
    pub fn drop_if_same(&self, key: &[u8], value: &Arc<Value>) {
        let mut inner = self.inner.lock().unwrap();
        if inner
            .index
            .get(key)
            .is_some_and(|e| Arc::ptr_eq(&e.value, value))
        {
            inner.remove(key);
        }
    }

    pub fn delete(&self, key: &[u8]) -> Status {
        let mut inner = self.inner.lock().unwrap();
        if inner.remove(key) {
            Status::Ok
        } else {
            Status::NotFound
        }
    }

    pub fn stats(&self) -> LaneStats {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.leases.expire(&mut inner.index, Instant::now());
        LaneStats {
            items: inner.index.len() as u64,
            used_bytes: self.mem.used(),
            capacity_bytes: self.capacity(),
            leased_bytes: inner.leases.bytes,
            in_transfer_bytes: inner.in_transfer,
            receiving_bytes: inner.receiving,
            index_bytes: inner.index_bytes,
            evictions: self.evictions.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Every value the lane holds, hottest first (S3-FIFO's main queue before its small one,
    /// then by access count): what a graceful stop writes to the disk tier, in the order that
    /// keeps the most useful values when its time runs out.
    pub fn resident(&self) -> Vec<(Arc<[u8]>, Arc<Value>)> {
        let inner = self.inner.lock().unwrap();
        let mut v: Vec<_> = inner
            .index
            .iter()
            .map(|(k, e)| ((e.in_main, e.freq), k.clone(), e.value.clone()))
            .collect();
        drop(inner);
        v.sort_by_key(|(hot, _, _)| std::cmp::Reverse(*hot));
        v.into_iter().map(|(_, k, e)| (k, e)).collect()
    }

    /// One S3-FIFO eviction step over all values, leases already expired: the key and value
    /// it unlinked. None when nothing can be evicted (all leased or in transfer).
    fn evict_s3fifo(&self, inner: &mut Inner) -> Option<(Key, Arc<Value>)> {
        let key = inner
            .queues
            .victim(&mut inner.index, self.capacity() / 10)?;
        self.evict(inner, key)
    }

    /// The eviction that makes room in a full lane (the quotas add up to more than the memory)
    /// for `tenant`'s new value of `need` bytes. A tenant that the value would take past its
    /// share of the lane (`Usage::share`) pays with its own values, as under its quota
    /// (`evict_own`), so its writes leave the other tenants' hits alone; one within its share
    /// takes from the tenant furthest over its own, so an idle tenant cannot keep more than
    /// its share from the others for good. S3-FIFO's pick over all values when no tenant has a
    /// quota (a server without tenants), or none of the chosen tenant's values here may go.
    fn evict_for(
        &self,
        inner: &mut Inner,
        tenant: TenantId,
        need: u64,
    ) -> Option<(Key, Arc<Value>)> {
        inner.leases.expire(&mut inner.index, Instant::now());
        let share = |t| (self.capacity() as f64 * self.usage.share(t)) as u64;
        let past_share = inner.own.bytes(tenant) + need > share(tenant);
        let payer = if self.usage.bounded(tenant) && past_share {
            Some(tenant)
        } else {
            inner.own.most_over(share)
        };
        if let Some(key) = payer.and_then(|t| inner.own.victim(t, &inner.index)) {
            return self.evict(inner, key);
        }
        self.evict_s3fifo(inner)
    }

    /// Evicts `key`, counting it for the lane and for its tenant: the key and value it unlinked.
    fn evict(&self, inner: &mut Inner, key: Key) -> Option<(Key, Arc<Value>)> {
        let e = inner.index.get(&key)?;
        let (tenant, value) = (e.tenant, e.value.clone());
        inner.remove(&key);
        self.evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slot = inner.usage.slot(tenant);
        slot.evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some((key, value))
    }

    /// Evicts one of `tenant`'s values here, to make room under its quota (its own pressure
    /// never takes another tenant's values): its oldest unpinned value, one not read since it
    /// was stored first (`own::OwnQueues::victim`), spilled to the disk tier like any other
    /// eviction. False when the lane holds none it may evict.
    pub fn evict_own(&self, tenant: TenantId) -> bool {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.leases.expire(&mut inner.index, Instant::now());
        let Some(key) = inner.own.victim(tenant, &inner.index) else {
            return false;
        };
        let Some((key, value)) = self.evict(inner, key) else {
            return false;
        };
        inner
            .usage
            .slot(tenant)
            .quota_evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(guard);
        if let Some(spill) = self.spill.get() {
            spill(&key, value);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use memkv_proto::Status;

    use super::index_charge;
    use super::testing::{exists, lane, put_len, V};

    #[test]
    fn overwrite_and_delete_free_memory() {
        let l = lane(4, 0.5);
        put_len(&l, "a", 1024);
        put_len(&l, "a", 2048);
        assert_eq!(l.stats().used_bytes, 2048);
        assert_eq!(l.stats().index_bytes, index_charge(1, 2048));
        assert_eq!(l.delete(b"a"), Status::Ok);
        assert_eq!(l.delete(b"a"), Status::NotFound);
        assert_eq!((l.stats().used_bytes, l.stats().index_bytes), (0, 0));
        assert_eq!(put_len(&l, "big", 8 * V), Status::TooLarge);
    }

    /// Tenants 0 and 1 with equal quotas, each above the lane, in a lane of 8 values.
    fn shared_lane() -> super::Lane {
        let usage = std::sync::Arc::new(crate::tenants::usage::Usage::new([1 << 30, 1 << 30]));
        let per = V + super::tenant_charge(&usage, 0, 2, V);
        super::Lane::with_usage((8 * per + 63) as usize, 0.5, usage).unwrap()
    }

    fn put_as(l: &super::Lane, tenant: u32, k: &str) {
        let mut r = l.reserve_as(tenant as _, k.len(), V).unwrap();
        let c = memkv_proto::chunk_checksums(r.bytes_mut());
        l.commit(k.as_bytes(), r, c);
    }

    fn held(l: &super::Lane, prefix: char) -> usize {
        (0..10)
            .filter(|i| super::testing::has(l, &format!("{prefix}{i}")))
            .count()
    }

    #[test]
    fn a_full_lane_takes_from_the_tenant_over_its_share_and_then_the_writers_own() {
        let l = shared_lane();
        for i in 0..8 {
            put_as(&l, 1, &format!("b{i}"));
        }
        // b holds the whole lane, twice its share: a's first writes take b's oldest values.
        for i in 0..4 {
            put_as(&l, 0, &format!("a{i}"));
        }
        assert_eq!((held(&l, 'a'), held(&l, 'b')), (4, 4));
        assert!((4..8).all(|i| super::testing::has(&l, &format!("b{i}"))));
        // A fifth value would take a past its share: its writes take its own values, b's stay.
        for i in 4..10 {
            put_as(&l, 0, &format!("a{i}"));
        }
        assert_eq!((held(&l, 'a'), held(&l, 'b')), (4, 4));
        assert!((6..10).all(|i| super::testing::has(&l, &format!("a{i}"))));
        assert_eq!(l.stats().evictions, 10);
    }

    #[test]
    fn overwrites_and_lease_renewals_do_not_grow_the_queues() {
        let l = lane(4, 0.5);
        for i in 0..100_000u64 {
            put_len(&l, "a", 64);
            exists(&l, b"a", Duration::from_secs(1 + i % 7));
        }
        let inner = l.inner.lock().unwrap();
        let queued = inner.queues.len();
        assert!(queued <= 2 * inner.index.len() + 64, "{queued} queue items");
        assert!(inner.leases.len() <= 2 * inner.index.len() + 64);
    }
}
