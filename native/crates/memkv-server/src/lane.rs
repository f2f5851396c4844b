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

use crate::arena::{LaneMemory, Span};

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

/// A reserved, not yet visible value: becomes visible only through `Lane::commit`.
pub struct Reservation {
    pub span: Span,
}

struct Entry {
    value: Arc<Value>,
    gen: u64,
    freq: u8,
    in_main: bool,
    lease_until: Option<Instant>,
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
    next_gen: u64,
}

/// Counters a lane reports; summed over lanes by the store.
#[derive(Default, Debug, Clone, Copy)]
pub struct LaneStats {
    pub items: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub leased_bytes: u64,
    pub evictions: u64,
}

pub struct Lane {
    mem: Arc<LaneMemory>,
    inner: Mutex<Inner>,
    max_leased_bytes: u64,
    evictions: std::sync::atomic::AtomicU64,
}

impl Lane {
    pub fn new(bytes: usize, max_leased_fraction: f64) -> std::io::Result<Lane> {
        let mem = LaneMemory::new(bytes)?;
        let max_leased_bytes = (mem.capacity() as f64 * max_leased_fraction) as u64;
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
                next_gen: 1,
            }),
            max_leased_bytes,
            evictions: Default::default(),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.mem.capacity()
    }

    /// Reserves room for a value of `len` bytes, evicting as needed. The caller fills the span
    /// without any lock held, then commits it.
    pub fn reserve(&self, len: u64) -> Result<Reservation, Status> {
        if len > self.capacity() {
            return Err(Status::TooLarge);
        }
        if let Some(span) = self.mem.alloc(len) {
            return Ok(Reservation { span });
        }
        let mut inner = self.inner.lock().unwrap();
        loop {
            if let Some(span) = self.mem.alloc(len) {
                return Ok(Reservation { span });
            }
            if !self.evict_one(&mut inner) {
                return Err(Status::NoSpace);
            }
        }
    }

    /// Makes a filled reservation visible under `key`, replacing any older value.
    pub fn commit(&self, key: &[u8], res: Reservation, checksums: Vec<u64>) {
        let value = Arc::new(Value {
            span: res.span,
            checksums,
        });
        let key: Key = Arc::from(key);
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        self.remove_locked(inner, &key);
        let gen = inner.next_gen;
        inner.next_gen += 1;
        let h = ghost_hash(&key);
        let in_main = inner.ghost.remove(&h);
        let len = value.span.len();
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
            },
        );
    }

    /// EXISTS: the status and value length; with `lease` > 0 a hit is protected from eviction
    /// until the lease ends or a GET releases it, within the lane's leased-bytes bound.
    pub fn exists(&self, key: &[u8], lease: Duration) -> (Status, u64) {
        let now = Instant::now();
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        expire_leases(inner, now);
        let Some((k, e)) = inner.index.get_key_value(key) else {
            return (Status::NotFound, 0);
        };
        let (k, len, leased, gen) = (k.clone(), e.value.span.len(), e.lease_until, e.gen);
        if lease.is_zero() {
            return (Status::Ok, len);
        }
        let until = now + lease;
        if leased.is_none() {
            if inner.leased_bytes + len > self.max_leased_bytes {
                return (Status::OkNoLease, len);
            }
            inner.leased_bytes += len;
        }
        if leased.is_none_or(|u| u < until) {
            inner.index.get_mut(key).unwrap().lease_until = Some(until);
            inner.leases.push(Reverse((until, gen, k)));
        }
        (Status::Ok, len)
    }

    /// GET: takes a reference to the value (so eviction cannot free it mid-send), counts the
    /// access for S3-FIFO and releases any lease on it.
    pub fn fetch(&self, key: &[u8]) -> Option<Arc<Value>> {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        expire_leases(inner, Instant::now());
        let e = inner.index.get_mut(key)?;
        e.freq = (e.freq + 1).min(3);
        if e.lease_until.take().is_some() {
            inner.leased_bytes -= e.value.span.len();
        }
        Some(e.value.clone())
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

    fn put(l: &Lane, k: &str, len: u64) -> Status {
        match l.reserve(len) {
            Ok(mut r) => {
                r.span.as_mut_slice().fill(k.as_bytes()[0]);
                let c = memkv_proto::chunk_checksums(r.span.as_slice());
                l.commit(k.as_bytes(), r, c);
                Status::Ok
            }
            Err(s) => s,
        }
    }

    fn has(l: &Lane, k: &str) -> bool {
        l.exists(k.as_bytes(), Duration::ZERO).0 == Status::Ok
    }

    #[test]
    fn one_hit_wonders_go_first_and_read_values_survive() {
        let l = Lane::new(10 * 1024, 0.5).unwrap();
        for i in 0..10 {
            assert_eq!(put(&l, &format!("k{i}"), 1024), Status::Ok);
        }
        // Read k0 and k1 so they are promoted instead of evicted.
        for k in ["k0", "k1"] {
            assert!(l.fetch(k.as_bytes()).is_some());
        }
        assert_eq!(put(&l, "new1", 1024), Status::Ok);
        assert_eq!(put(&l, "new2", 1024), Status::Ok);
        assert!(has(&l, "k0") && has(&l, "k1"), "read values must survive");
        assert!(
            !has(&l, "k2") && !has(&l, "k3"),
            "oldest unread values go first"
        );
        assert_eq!(l.stats().evictions, 2);
    }

    #[test]
    fn leased_and_in_transfer_values_are_not_evicted() {
        let l = Lane::new(4 * 1024, 1.0).unwrap();
        for k in ["a", "b", "c", "d"] {
            put(&l, k, 1024);
        }
        assert_eq!(l.exists(b"a", Duration::from_secs(60)).0, Status::Ok);
        let held = match l.fetch(b"b") {
            Some(v) => v,
            None => panic!("b missing"),
        };
        put(&l, "e", 1024);
        put(&l, "f", 1024);
        assert!(has(&l, "a"), "leased value evicted");
        assert!(has(&l, "b"), "value in transfer evicted");
        assert!(held.span.as_slice().iter().all(|&x| x == b'b'));
        // Everything left is pinned: a new put finds no space rather than evicting a pinned one.
        l.exists(b"e", Duration::from_secs(60));
        l.exists(b"f", Duration::from_secs(60));
        assert_eq!(put(&l, "g", 1024), Status::NoSpace);
        drop(held);
    }

    #[test]
    fn leases_expire_and_get_releases_them() {
        let l = Lane::new(4 * 1024, 1.0).unwrap();
        put(&l, "a", 1024);
        l.exists(b"a", Duration::from_millis(30));
        assert_eq!(l.stats().leased_bytes, 1024);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(l.stats().leased_bytes, 0);
        l.exists(b"a", Duration::from_secs(60));
        assert_eq!(l.stats().leased_bytes, 1024);
        let _ = l.fetch(b"a");
        assert_eq!(l.stats().leased_bytes, 0);
    }

    #[test]
    fn leased_bytes_are_bounded() {
        let l = Lane::new(4 * 1024, 0.5).unwrap();
        for k in ["a", "b", "c"] {
            put(&l, k, 1024);
        }
        assert_eq!(l.exists(b"a", Duration::from_secs(9)).0, Status::Ok);
        assert_eq!(l.exists(b"b", Duration::from_secs(9)).0, Status::Ok);
        assert_eq!(l.exists(b"c", Duration::from_secs(9)).0, Status::OkNoLease);
    }

    #[test]
    fn overwrite_and_delete_free_memory() {
        let l = Lane::new(4 * 1024, 0.5).unwrap();
        put(&l, "a", 1024);
        put(&l, "a", 2048);
        assert_eq!(l.stats().used_bytes, 2048);
        assert_eq!(l.delete(b"a"), Status::Ok);
        assert_eq!(l.delete(b"a"), Status::NotFound);
        assert_eq!(l.stats().used_bytes, 0);
        assert_eq!(put(&l, "big", 8192), Status::TooLarge);
    }
}
