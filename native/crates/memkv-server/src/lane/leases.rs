//! Leases: an EXISTS with a lease protects a hit from eviction until the lease ends or a GET
//! takes it over as its transfer's pin. Leased bytes count against the lane's bound on pinned
//! bytes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use super::index::{Entry, Key};

/// The lane's leases, in order of their ends. A heap item goes stale when its lease is extended
/// or released or its key's value replaced: it is skipped when due, and dropped by `compact`.
#[derive(Default)]
pub(super) struct Leases {
    due: BinaryHeap<Reverse<(Instant, u64, Key)>>,
    /// Bytes of the values under a lease.
    pub(super) bytes: u64,
}

impl Leases {
    /// Leases `e` (under `key`) until `until`, or extends its lease to then; a lease never
    /// shortens. The caller has checked that a value not yet leased fits the pinned bound.
    /// Returns whether a heap item was added (the caller then compacts).
    pub(super) fn grant(&mut self, e: &mut Entry, key: Key, until: Instant) -> bool {
        let leased = e.lease_until;
        if leased.is_none() {
            self.bytes += e.value.span.len();
        }
        if leased.is_none_or(|u| u < until) {
            e.lease_until = Some(until);
            self.due.push(Reverse((until, e.gen, key)));
            return true;
        }
        false
    }

    /// Ends `e`'s lease, if it has one (a GET takes it over, or the entry leaves the index).
    pub(super) fn release(&mut self, e: &mut Entry) {
        if e.lease_until.take().is_some() {
            self.bytes -= e.value.span.len();
        }
    }

    /// Ends the leases due by `now`.
    pub(super) fn expire(&mut self, index: &mut HashMap<Key, Entry>, now: Instant) {
        while self
            .due
            .peek()
            .is_some_and(|Reverse((until, _, _))| *until <= now)
        {
            let Reverse((until, gen, key)) = self.due.pop().unwrap();
            // Stale heap items (lease extended, released, or value replaced) are skipped.
            if let Some(e) = index.get_mut(&key) {
                if e.gen == gen && e.lease_until == Some(until) {
                    e.lease_until = None;
                    self.bytes -= e.value.span.len();
                }
            }
        }
    }

    /// Drops the stale heap items once there are more than `live` items.
    pub(super) fn compact(&mut self, index: &HashMap<Key, Entry>, live: usize) {
        if self.due.len() > live {
            let leased = |k: &Key, g: u64, u: Instant| {
                index
                    .get(k)
                    .is_some_and(|e| e.gen == g && e.lease_until == Some(u))
            };
            self.due.retain(|Reverse((u, g, k))| leased(k, *g, *u));
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.due.len()
    }
}

#[cfg(test)]
impl super::Lane {
    /// How long the lease on `key` has left, if it has one.
    pub fn lease_left(&self, key: &[u8]) -> Option<std::time::Duration> {
        let inner = self.inner.lock().unwrap();
        let until = inner.index.get(key)?.lease_until?;
        Some(until.saturating_duration_since(Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use memkv_proto::Status;

    use crate::lane::testing::{exists, fetch, lane, put, V};

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
}
