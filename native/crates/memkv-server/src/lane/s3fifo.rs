//! Eviction by S3-FIFO (SOSP'23): new values enter a small FIFO (10% of memory); values read
//! again while there move to the main FIFO, one-hit wonders are evicted early and remembered in a
//! ghost list so that a quick re-put goes straight to main. Only committed values that are neither
//! leased nor being transferred (span shared with a reader) are evicted.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::index::{Entry, Key};

/// S3-FIFO's queues of (key, generation) and its ghost list. A queue item goes stale when its
/// key is overwritten or deleted (the generation no longer matches): it is skipped when popped,
/// and dropped by `compact`.
#[derive(Default)]
pub(super) struct Queues {
    small: VecDeque<(Key, u64)>,
    main: VecDeque<(Key, u64)>,
    /// Bytes of the values queued in small.
    small_bytes: u64,
    ghost: HashSet<u64>,
    ghost_order: VecDeque<u64>,
}

impl Queues {
    /// Queues a new value of `len` bytes under `key` (generation `gen`): into main when the key
    /// is a ghost, else into small. Returns whether it went into main.
    pub(super) fn admit(&mut self, key: &Key, gen: u64, len: u64) -> bool {
        let in_main = self.ghost.remove(&ghost_hash(key));
        if in_main {
            self.main.push_back((key.clone(), gen));
        } else {
            self.small.push_back((key.clone(), gen));
            self.small_bytes += len;
        }
        in_main
    }

    /// Accounts for `e` having left the index (its queue item is stale from now).
    pub(super) fn forget(&mut self, e: &Entry) {
        if !e.in_main {
            self.small_bytes -= e.value.span.len();
        }
    }

    /// One S3-FIFO eviction step over the entries of `index`, with small kept to about
    /// `small_target` bytes: the key to evict (a small one is remembered as a ghost), which the
    /// caller removes. None when nothing can be evicted (all leased or in transfer).
    pub(super) fn victim(
        &mut self,
        index: &mut HashMap<Key, Entry>,
        small_target: u64,
    ) -> Option<Key> {
        // Each queued item is looked at a bounded number of times: freq <= 3 decrements, plus a
        // move from small to main, plus one skip for pinned values.
        let mut budget = 6 * (self.small.len() + self.main.len()) + 1;
        while budget > 0 {
            budget -= 1;
            let from_small =
                !self.small.is_empty() && (self.small_bytes > small_target || self.main.is_empty());
            let popped = if from_small {
                self.small.pop_front()
            } else {
                self.main.pop_front()
            };
            let (key, gen) = popped?;
            let Some(e) = index.get_mut(&key) else {
                continue;
            };
            if e.gen != gen {
                continue;
            }
            if from_small && e.freq > 0 {
                e.freq = 0;
                e.in_main = true;
                self.small_bytes -= e.value.span.len();
                self.main.push_back((key, gen));
                continue;
            }
            if !from_small && e.freq > 0 {
                e.freq -= 1;
                self.main.push_back((key, gen));
                continue;
            }
            // Pinned: leased, or a reader/writer holds the value right now.
            if e.lease_until.is_some() || Arc::strong_count(&e.value) > 1 {
                if from_small {
                    self.small.push_back((key, gen));
                } else {
                    self.main.push_back((key, gen));
                }
                continue;
            }
            if from_small {
                self.remember(&key);
            }
            return Some(key);
        }
        None
    }

    /// Adds `key`, evicted from small, to the ghost list.
    fn remember(&mut self, key: &[u8]) {
        let h = ghost_hash(key);
        if self.ghost.insert(h) {
            self.ghost_order.push_back(h);
        }
        // The ghost list remembers about as many keys as main holds.
        let cap = self.main.len().max(64);
        while self.ghost_order.len() > cap {
            if let Some(old) = self.ghost_order.pop_front() {
                self.ghost.remove(&old);
            }
        }
    }

    /// Drops the stale queue items once there are more than `live` items.
    pub(super) fn compact(&mut self, index: &HashMap<Key, Entry>, live: usize) {
        let current = |k: &Key, g: u64| index.get(k).is_some_and(|e| e.gen == g);
        if self.small.len() + self.main.len() > live {
            self.small.retain(|(k, g)| current(k, *g));
            self.main.retain(|(k, g)| current(k, *g));
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}

fn ghost_hash(key: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(0x67_686f_7374, key)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use memkv_proto::Status;

    use crate::lane::testing::{exists, fetch, has, lane, put};

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
}
