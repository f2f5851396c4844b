//! Leases on disk-resident values, and their bound.
//!
//! A lease keeps its value's record readable until a GET loads it or the lease lapses, so the
//! segment holding it cannot be evicted meanwhile: a lease holds a whole segment's bytes, not
//! just its value's. The segments held by leases are bounded per directory (a share of its
//! capacity, `--max-leased-fraction` as for DRAM), so that eviction always has unleased
//! segments to take and leases can never fill the tier: an EXISTS whose lease would pass the
//! bound answers OK_NO_LEASE (the value is there, unprotected), as DRAM does at its own bound.

use std::collections::HashMap;
use std::time::Instant;

use super::Key;

/// The leases of one segment.
struct SegmentLeases {
    /// Bytes the segment is charged while leased: at most what it can grow to.
    charge: u64,
    keys: HashMap<Key, Instant>,
    /// The latest lease end among `keys`: the segment is held until then.
    until: Instant,
}

/// Every directory's leased segments, by (directory, segment id).
pub(super) struct DiskLeases {
    segments: HashMap<(u16, u64), SegmentLeases>,
    /// Per directory: bytes of segments that leases may hold.
    limits: Vec<u64>,
}

impl DiskLeases {
    pub(super) fn new(limits: Vec<u64>) -> DiskLeases {
        DiskLeases {
            segments: HashMap::new(),
            limits,
        }
    }

    /// Leases `key` in segment `seg` of `dir` until `until` (or extends its lease to then; a
    /// lease never shortens). False, with nothing changed, when the segment is not held yet
    /// and holding it (`charge` bytes) would pass the directory's bound.
    pub(super) fn grant(
        &mut self,
        (dir, seg): (u16, u64),
        charge: u64,
        key: &Key,
        until: Instant,
        now: Instant,
    ) -> bool {
        let held = self
            .segments
            .get(&(dir, seg))
            .is_some_and(|s| s.until > now);
        if !held {
            self.segments.remove(&(dir, seg));
            let limit = self.limits.get(dir as usize).copied().unwrap_or(0);
            if self.held_bytes(dir, now) + charge > limit {
                return false;
            }
        }
        let s = self
            .segments
            .entry((dir, seg))
            .or_insert_with(|| SegmentLeases {
                charge,
                keys: HashMap::new(),
                until,
            });
        let end = s.keys.entry(key.clone()).or_insert(until);
        *end = (*end).max(until);
        s.until = s.until.max(until);
        true
    }

    /// Ends `key`'s lease in segment `seg` of `dir`, if it has one (a GET loads it, or the key
    /// is forgotten).
    pub(super) fn release(&mut self, (dir, seg): (u16, u64), key: &[u8]) {
        let Some(s) = self.segments.get_mut(&(dir, seg)) else {
            return;
        };
        if s.keys.remove(key).is_none() {
            return;
        }
        match s.keys.values().max() {
            Some(&until) => s.until = until,
            None => {
                self.segments.remove(&(dir, seg));
            }
        }
    }

    /// Whether a lease holds segment `seg` of `dir` now.
    pub(super) fn held(&self, dir: u16, seg: u64, now: Instant) -> bool {
        self.segments
            .get(&(dir, seg))
            .is_some_and(|s| s.until > now)
    }

    /// Forgets the leases of a segment that is gone.
    pub(super) fn segment_gone(&mut self, dir: u16, seg: u64) {
        self.segments.remove(&(dir, seg));
    }

    /// Bytes of `dir`'s segments held by leases now, dropping the lapsed ones.
    fn held_bytes(&mut self, dir: u16, now: Instant) -> u64 {
        self.segments.retain(|_, s| s.until > now);
        self.segments
            .iter()
            .filter(|((d, _), _)| *d == dir)
            .map(|(_, s)| s.charge)
            .sum()
    }

    /// Bytes of segments held by leases now, over all directories.
    pub(super) fn held_total(&mut self, now: Instant) -> u64 {
        self.segments.retain(|_, s| s.until > now);
        self.segments.values().map(|s| s.charge).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key(s: &str) -> Key {
        Key::from(s.as_bytes())
    }

    #[test]
    fn leases_hold_segments_up_to_the_bound_and_release_them() {
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut l = DiskLeases::new(vec![200, 100]);
        assert!(l.grant((0, 1), 100, &key("a"), later, now));
        assert!(l.grant((0, 1), 100, &key("b"), later, now), "held already");
        assert!(l.grant((0, 2), 100, &key("c"), later, now));
        assert!(
            !l.grant((0, 3), 100, &key("d"), later, now),
            "past the bound"
        );
        assert!(
            l.grant((1, 3), 100, &key("d"), later, now),
            "bounds are per directory"
        );
        assert_eq!(l.held_total(now), 300);
        l.release((0, 1), b"a");
        assert!(l.held(0, 1, now), "b still holds it");
        l.release((0, 1), b"b");
        assert!(!l.held(0, 1, now));
        assert!(l.grant((0, 3), 100, &key("d"), later, now));
        // Lapsed leases hold nothing.
        let after = later + Duration::from_secs(1);
        assert!(!l.held(0, 2, after));
        assert_eq!(l.held_total(after), 0);
        assert!(l.grant(
            (0, 4),
            200,
            &key("e"),
            after + Duration::from_secs(1),
            after
        ));
    }
}
