//! One lane: an independent shard of the store with its own index, memory, eviction queues,
//! leases and lock. Keys map to lanes by hash, so lanes never coordinate.
//!
//! Eviction is S3-FIFO (SOSP'23): new values enter a small FIFO (10% of memory); values read
//! again while there move to the main FIFO, one-hit wonders are evicted early and remembered in a
//! ghost list so that a quick re-put goes straight to main. Only committed values that are neither
//! leased nor being transferred (span shared with a reader) are evicted.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memkv_proto::Status;

use crate::arena::{footprint, LaneMemory, Span};

/// A committed value. Shared (Arc) between the index and readers streaming it out.
pub struct Value {
    pub span: Span,
    /// One checksum per `memkv_proto::CHECKSUM_CHUNK` bytes.
    pub checksums: Vec<u64>,
}

impl Value {
    /// The `i`-th `CHECKSUM_CHUNK` of the value.
    pub fn chunk(&self, i: usize) -> &[u8] {
        let data = self.span.as_slice();
        let start = (i * memkv_proto::CHECKSUM_CHUNK).min(data.len());
        let end = (start + memkv_proto::CHECKSUM_CHUNK).min(data.len());
        &data[start..end]
    }

    /// Whether the `i`-th chunk still matches the checksum taken at PUT.
    pub fn chunk_ok(&self, i: usize) -> bool {
        self.checksums.get(i) == Some(&memkv_proto::checksum(self.chunk(i)))
    }

    pub fn chunks(&self) -> usize {
        self.checksums.len()
    }
}

/// Heap bytes charged per index entry on top of its key and checksums: the hash table slot (at
/// its worst load factor), the key's and the value's allocations, its places in the eviction
/// queues (which hold up to twice the live entries before compaction), a lease heap item and a
/// ghost. docs/security.md states the bound this gives.
pub const ENTRY_OVERHEAD: u64 = 512;

/// Keys an EXISTS looks up under one hold of a lane's lock: taking it once per key cost more
/// than the lookup itself, and this many lookups hold it for a few microseconds at most, so a
/// PUT or GET on the lane never waits long behind a large batch.
const LOOKUPS_PER_LOCK: usize = 256;

/// What an entry of `key_len` and `len` bytes is charged for its index memory.
pub fn index_charge(key_len: usize, len: u64) -> u64 {
    let chunks = len.div_ceil(memkv_proto::CHECKSUM_CHUNK as u64).max(1);
    ENTRY_OVERHEAD + key_len as u64 + 8 * chunks
}

/// A reserved, not yet visible value: becomes visible only through `Lane::commit`. While it is
/// filled it counts as bytes being received and its index charge is held; dropping it
/// uncommitted (a connection lost mid-value) gives back both and its memory.
pub struct Reservation<'a> {
    span: Option<Span>,
    lane: &'a Lane,
    charge: u64,
}

impl Reservation<'_> {
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.span
            .as_mut()
            .expect("filled before commit")
            .as_mut_slice()
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(span) = self.span.take() {
            let mut inner = self.lane.inner.lock().unwrap();
            inner.index_bytes -= self.charge;
            inner.receiving -= span.len();
            drop(inner);
            drop(span);
        }
    }
}

/// A committed value being sent: counted as pinned until dropped (the reply ended).
pub struct Pinned<'a> {
    pub value: Arc<Value>,
    lane: &'a Lane,
}

impl std::ops::Deref for Pinned<'_> {
    type Target = Arc<Value>;
    fn deref(&self) -> &Arc<Value> {
        &self.value
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        self.lane.inner.lock().unwrap().in_transfer -= self.value.span.len();
    }
}

struct Entry {
    value: Arc<Value>,
    gen: u64,
    freq: u8,
    in_main: bool,
    lease_until: Option<Instant>,
    /// Index bytes charged for this entry (`index_charge`).
    charge: u64,
}

type Key = Arc<[u8]>;

struct Inner {
    index: HashMap<Key, Entry>,
    small: VecDeque<(Key, u64)>,
    main: VecDeque<(Key, u64)>,
    small_bytes: u64,
    ghost: HashSet<u64>,
    ghost_order: VecDeque<u64>,
    leases: BinaryHeap<Reverse<(Instant, u64, Key)>>,
    leased_bytes: u64,
    /// Bytes of values being sent.
    in_transfer: u64,
    /// Bytes of reservations being filled.
    receiving: u64,
    /// Index memory charged against the lane's capacity, with the value bytes.
    index_bytes: u64,
    next_gen: u64,
}

impl Inner {
    fn pinned(&self) -> u64 {
        self.leased_bytes + self.in_transfer
    }

    /// Queue items go stale when a key is overwritten or deleted; they are dropped once they
    /// outnumber the live entries, so overwrites cannot grow the queues without bound.
    fn compact(&mut self) {
        let live = 2 * self.index.len() + 64;
        let index = &self.index;
        let current = |k: &Key, g: u64| index.get(k).is_some_and(|e| e.gen == g);
        if self.small.len() + self.main.len() > live {
            self.small.retain(|(k, g)| current(k, *g));
            self.main.retain(|(k, g)| current(k, *g));
        }
        if self.leases.len() > live {
            let leased = |k: &Key, g: u64, u: Instant| {
                index
                    .get(k)
                    .is_some_and(|e| e.gen == g && e.lease_until == Some(u))
            };
            self.leases.retain(|Reverse((u, g, k))| leased(k, *g, *u));
        }
    }
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

pub struct Lane {
    mem: Arc<LaneMemory>,
    inner: Mutex<Inner>,
    /// Bound on pinned bytes (leased or being sent), and on bytes being received.
    max_pinned_bytes: u64,
    evictions: std::sync::atomic::AtomicU64,
}

impl Lane {
    pub fn new(bytes: usize, max_leased_fraction: f64) -> std::io::Result<Lane> {
        let mem = LaneMemory::new(bytes)?;
        let max_pinned_bytes = (mem.capacity() as f64 * max_leased_fraction) as u64;
        Ok(Lane {
            mem,
            inner: Mutex::new(Inner {
                index: HashMap::new(),
                small: VecDeque::new(),
                main: VecDeque::new(),
                small_bytes: 0,
                ghost: HashSet::new(),
                ghost_order: VecDeque::new(),
                leases: BinaryHeap::new(),
                leased_bytes: 0,
                in_transfer: 0,
                receiving: 0,
                index_bytes: 0,
                next_gen: 1,
            }),
            max_pinned_bytes,
            evictions: Default::default(),
        })
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
        let charge = index_charge(key_len, len);
        if footprint(len).saturating_add(charge) > self.capacity() {
            return Err(Status::TooLarge);
        }
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        if inner.receiving > 0 && inner.receiving + len > self.max_pinned_bytes {
            return Err(Status::NoSpace);
        }
        loop {
            let need = footprint(len) + charge;
            let room = self.mem.used() + inner.index_bytes + need <= self.capacity();
            if let Some(span) = room.then(|| self.mem.alloc(len)).flatten() {
                inner.index_bytes += charge;
                inner.receiving += len;
                return Ok(Reservation {
                    span: Some(span),
                    lane: self,
                    charge,
                });
            }
            if !self.evict_one(inner) {
                return Err(Status::NoSpace);
            }
        }
    }

    /// Makes a filled reservation visible under `key`, replacing any older value.
    pub fn commit(&self, key: &[u8], mut res: Reservation<'_>, checksums: Vec<u64>) {
        let span = res.span.take().expect("committed once");
        let charge = res.charge;
        let value = Arc::new(Value { span, checksums });
        let key: Key = Arc::from(key);
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let len = value.span.len();
        inner.receiving -= len;
        self.remove_locked(inner, &key);
        let gen = inner.next_gen;
        inner.next_gen += 1;
        let h = ghost_hash(&key);
        let in_main = inner.ghost.remove(&h);
        if in_main {
            inner.main.push_back((key.clone(), gen));
        } else {
            inner.small.push_back((key.clone(), gen));
            inner.small_bytes += len;
        }
        inner.index.insert(
            key,
            Entry {
                value,
                gen,
                freq: 0,
                in_main,
                lease_until: None,
                charge,
            },
        );
        inner.compact();
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
            expire_leases(inner, now);
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
        let (k, leased, gen) = (k.clone(), e.lease_until, e.gen);
        let until = now + lease;
        if leased.is_none() {
            if inner.pinned() + len > self.max_pinned_bytes {
                return (Status::OkNoLease, len);
            }
            inner.leased_bytes += len;
        }
        if leased.is_none_or(|u| u < until) {
            inner.index.get_mut(key).unwrap().lease_until = Some(until);
            inner.leases.push(Reverse((until, gen, k)));
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
        expire_leases(inner, Instant::now());
        let Some(e) = inner.index.get(key) else {
            return Ok(None);
        };
        let (len, leased) = (e.value.span.len(), e.lease_until.is_some());
        if !leased && !self.may_pin(inner, len) {
            return Err(Status::NoSpace);
        }
        let e = inner.index.get_mut(key).unwrap();
        e.freq = (e.freq + 1).min(3);
        if e.lease_until.take().is_some() {
            inner.leased_bytes -= len;
        }
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
            self.remove_locked(&mut inner, key);
        }
    }

    pub fn delete(&self, key: &[u8]) -> Status {
        let mut inner = self.inner.lock().unwrap();
        if self.remove_locked(&mut inner, key) {
            Status::Ok
        } else {
            Status::NotFound
        }
    }

    pub fn stats(&self) -> LaneStats {
        let mut inner = self.inner.lock().unwrap();
        expire_leases(&mut inner, Instant::now());
        LaneStats {
            items: inner.index.len() as u64,
            used_bytes: self.mem.used(),
            capacity_bytes: self.capacity(),
            leased_bytes: inner.leased_bytes,
            in_transfer_bytes: inner.in_transfer,
            receiving_bytes: inner.receiving,
            index_bytes: inner.index_bytes,
            evictions: self.evictions.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Unlinks `key`; its memory returns once no reader holds the value. Queue entries for it go
    /// stale (their generation no longer matches) and are skipped when popped.
    fn remove_locked(&self, inner: &mut Inner, key: &[u8]) -> bool {
        let Some(e) = inner.index.remove(key) else {
            return false;
        };
        if !e.in_main {
            inner.small_bytes -= e.value.span.len();
        }
        if e.lease_until.is_some() {
            inner.leased_bytes -= e.value.span.len();
        }
        inner.index_bytes -= e.charge;
        true
    }

    /// One S3-FIFO eviction step. False when nothing can be evicted (all leased or in transfer).
    fn evict_one(&self, inner: &mut Inner) -> bool {
        let now = Instant::now();
        expire_leases(inner, now);
        let small_target = self.capacity() / 10;
        // Each queued item is looked at a bounded number of times: freq <= 3 decrements, plus a
        // move from small to main, plus one skip for pinned values.
        let mut budget = 6 * (inner.small.len() + inner.main.len()) + 1;
        while budget > 0 {
            budget -= 1;
            let from_small = !inner.small.is_empty()
                && (inner.small_bytes > small_target || inner.main.is_empty());
            let popped = if from_small {
                inner.small.pop_front()
            } else {
                inner.main.pop_front()
            };
            let Some((key, gen)) = popped else {
                return false;
            };
            let Some(e) = inner.index.get_mut(&key) else {
                continue;
            };
            if e.gen != gen {
                continue;
            }
            if from_small && e.freq > 0 {
                e.freq = 0;
                e.in_main = true;
                inner.small_bytes -= e.value.span.len();
                inner.main.push_back((key, gen));
                continue;
            }
            if !from_small && e.freq > 0 {
                e.freq -= 1;
                inner.main.push_back((key, gen));
                continue;
            }
            // Pinned: leased, or a reader/writer holds the value right now.
            if e.lease_until.is_some() || Arc::strong_count(&e.value) > 1 {
                if from_small {
                    inner.small.push_back((key, gen));
                } else {
                    inner.main.push_back((key, gen));
                }
                continue;
            }
            self.remove_locked(inner, &key);
            if from_small {
                let h = ghost_hash(&key);
                if inner.ghost.insert(h) {
                    inner.ghost_order.push_back(h);
                }
                // The ghost list remembers about as many keys as main holds.
                let cap = inner.main.len().max(64);
                while inner.ghost_order.len() > cap {
                    if let Some(old) = inner.ghost_order.pop_front() {
                        inner.ghost.remove(&old);
                    }
                }
            }
            self.evictions
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return true;
        }
        false
    }
}

#[cfg(test)]
impl Lane {
    /// How long the lease on `key` has left, if it has one.
    pub fn lease_left(&self, key: &[u8]) -> Option<Duration> {
        let inner = self.inner.lock().unwrap();
        let until = inner.index.get(key)?.lease_until?;
        Some(until.saturating_duration_since(Instant::now()))
    }
}

fn ghost_hash(key: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(0x67_686f_7374, key)
}

fn expire_leases(inner: &mut Inner, now: Instant) {
    while inner
        .leases
        .peek()
        .is_some_and(|Reverse((until, _, _))| *until <= now)
    {
        let Reverse((until, gen, key)) = inner.leases.pop().unwrap();
        // Stale heap items (lease extended, released, or value replaced) are skipped.
        if let Some(e) = inner.index.get_mut(&key) {
            if e.gen == gen && e.lease_until == Some(until) {
                e.lease_until = None;
                inner.leased_bytes -= e.value.span.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in these tests are V bytes under 2-byte keys.
    const V: u64 = 4096;

    /// A lane that holds exactly `n` values of V bytes, index charges included.
    fn lane(n: u64, max_pinned_fraction: f64) -> Lane {
        let bytes = n * (V + index_charge(2, V)) + 63;
        Lane::new(bytes as usize, max_pinned_fraction).unwrap()
    }

    fn put_len(l: &Lane, k: &str, len: u64) -> Status {
        match l.reserve(k.len(), len) {
            Ok(mut r) => {
                r.bytes_mut().fill(k.as_bytes()[0]);
                let c = memkv_proto::chunk_checksums(r.bytes_mut());
                l.commit(k.as_bytes(), r, c);
                Status::Ok
            }
            Err(s) => s,
        }
    }

    fn put(l: &Lane, k: &str) -> Status {
        put_len(l, k, V)
    }

    fn exists(l: &Lane, k: &[u8], lease: Duration) -> (Status, u64) {
        let mut out = [(Status::InvalidKey, 0)];
        l.exists(&[k], &[0], lease, &mut out);
        out[0]
    }

    fn has(l: &Lane, k: &str) -> bool {
        exists(l, k.as_bytes(), Duration::ZERO).0 == Status::Ok
    }

    fn fetch<'a>(l: &'a Lane, k: &str) -> Pinned<'a> {
        match l.fetch(k.as_bytes()) {
            Ok(Some(p)) => p,
            _ => panic!("{k} not served"),
        }
    }

    #[test]
    fn one_hit_wonders_go_first_and_read_values_survive() {
        let l = lane(10, 0.5);
        for i in 0..10 {
            assert_eq!(put(&l, &format!("k{i}")), Status::Ok);
        }
        // Read k0 and k1 so they are promoted instead of evicted.
        for k in ["k0", "k1"] {
            drop(fetch(&l, k));
        }
        assert_eq!(put(&l, "n1"), Status::Ok);
        assert_eq!(put(&l, "n2"), Status::Ok);
        assert!(has(&l, "k0") && has(&l, "k1"), "read values must survive");
        assert!(
            !has(&l, "k2") && !has(&l, "k3"),
            "oldest unread values go first"
        );
        assert_eq!(l.stats().evictions, 2);
    }

    #[test]
    fn leased_and_in_transfer_values_are_not_evicted() {
        let l = lane(4, 1.0);
        for k in ["a", "b", "c", "d"] {
            put(&l, k);
        }
        assert_eq!(exists(&l, b"a", Duration::from_secs(60)).0, Status::Ok);
        let held = fetch(&l, "b");
        put(&l, "e");
        put(&l, "f");
        assert!(has(&l, "a"), "leased value evicted");
        assert!(has(&l, "b"), "value in transfer evicted");
        assert!(held.span.as_slice().iter().all(|&x| x == b'b'));
        // Everything left is pinned: a new put finds no space rather than evicting a pinned one.
        exists(&l, b"e", Duration::from_secs(60));
        exists(&l, b"f", Duration::from_secs(60));
        assert_eq!(put(&l, "g"), Status::NoSpace);
        drop(held);
    }

    #[test]
    fn leases_expire_and_get_releases_them() {
        let l = lane(4, 1.0);
        put(&l, "a");
        exists(&l, b"a", Duration::from_millis(30));
        assert_eq!(l.stats().leased_bytes, V);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(l.stats().leased_bytes, 0);
        exists(&l, b"a", Duration::from_secs(60));
        assert_eq!(l.stats().leased_bytes, V);
        let p = fetch(&l, "a");
        assert_eq!(
            (l.stats().leased_bytes, l.stats().in_transfer_bytes),
            (0, V)
        );
        drop(p);
        assert_eq!(l.stats().in_transfer_bytes, 0);
    }

    #[test]
    fn leased_bytes_are_bounded() {
        let l = lane(4, 0.5);
        for k in ["a", "b", "c"] {
            put(&l, k);
        }
        assert_eq!(exists(&l, b"a", Duration::from_secs(9)).0, Status::Ok);
        assert_eq!(exists(&l, b"b", Duration::from_secs(9)).0, Status::Ok);
        assert_eq!(
            exists(&l, b"c", Duration::from_secs(9)).0,
            Status::OkNoLease
        );
    }

    #[test]
    fn values_in_transfer_count_against_the_pinned_bound() {
        let l = lane(8, 0.5);
        for k in ["a", "b", "c", "d", "e", "f"] {
            put(&l, k);
        }
        // A slow reader holds four values mid-send: half the lane, the whole bound.
        let held: Vec<Pinned> = ["a", "b", "c", "d"].iter().map(|k| fetch(&l, k)).collect();
        assert_eq!(l.fetch(b"e").err(), Some(Status::NoSpace));
        assert_eq!(
            exists(&l, b"e", Duration::from_secs(9)).0,
            Status::OkNoLease
        );
        // Writers are bounded apart from readers: new values still find room by evicting,
        // up to half the lane being received at once.
        let rs: Vec<Reservation> = (0..4).map(|_| l.reserve(1, V).ok().unwrap()).collect();
        assert_eq!(l.reserve(1, V).err(), Some(Status::NoSpace));
        drop(rs);
        drop(held);
        assert_eq!(l.stats().in_transfer_bytes, 0);
        assert!(matches!(l.fetch(b"a"), Ok(Some(_))));
    }

    #[test]
    fn an_uncommitted_reservation_gives_back_its_memory_charge_and_pin() {
        let l = lane(2, 0.5);
        let r = l.reserve(1, V).ok().unwrap();
        assert!(l.stats().index_bytes > 0 && l.stats().receiving_bytes == V);
        drop(r);
        let s = l.stats();
        assert_eq!((s.used_bytes, s.index_bytes, s.receiving_bytes), (0, 0, 0));
    }

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

    #[test]
    fn overwrites_and_lease_renewals_do_not_grow_the_queues() {
        let l = lane(4, 0.5);
        for i in 0..100_000u64 {
            put_len(&l, "a", 64);
            exists(&l, b"a", Duration::from_secs(1 + i % 7));
        }
        let inner = l.inner.lock().unwrap();
        let queued = inner.small.len() + inner.main.len();
        assert!(queued <= 2 * inner.index.len() + 64, "{queued} queue items");
        assert!(inner.leases.len() <= 2 * inner.index.len() + 64);
    }

    #[test]
    fn index_memory_counts_against_the_capacity() {
        // Tiny values under long keys: the index, not the values, fills the lane.
        let l = Lane::new(1 << 20, 0.5).unwrap();
        let key = |i: u32| format!("{i:01000}");
        for i in 0..10_000 {
            assert_eq!(put_len(&l, &key(i), 1), Status::Ok);
        }
        let s = l.stats();
        assert!(s.used_bytes + s.index_bytes <= l.capacity());
        let per = 64 + index_charge(1000, 1);
        assert!(s.items <= l.capacity() / per, "{} items", s.items);
        assert!(s.evictions >= 10_000 - l.capacity() / per);
    }
}
