//! The handles that hold lane memory while a value moves: `Reservation` while a new value is
//! received, `Pinned` while a committed one is sent. Each gives back what it counts when
//! dropped.

use std::sync::Arc;

use crate::arena::Span;

use super::index::Value;
use super::Lane;

/// A reserved, not yet visible value: becomes visible only through `Lane::commit`. While it is
/// filled it counts as bytes being received and its index charge is held; dropping it
/// uncommitted (a connection lost mid-value) gives back both and its memory.
pub struct Reservation<'a> {
    pub(super) span: Option<Span>,
    pub(super) lane: &'a Lane,
    pub(super) charge: u64,
}

impl Reservation<'_> {
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.span
            .as_mut()
            .expect("filled before commit")
            .as_mut_slice()
    }
}

impl<'a> Reservation<'a> {
    /// The reserved memory, rounding included, for a direct read into it: the span of
    /// `Lane::reserve_aligned` starts on its alignment and covers whole blocks.
    pub fn raw_buf(&mut self) -> (*mut u8, usize) {
        self.span
            .as_mut()
            .expect("filled before commit")
            .as_mut_ptr_cap()
    }

    /// The lane this reservation belongs to.
    pub fn lane(&self) -> &'a Lane {
        self.lane
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
    pub(super) lane: &'a Lane,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use memkv_proto::Status;

    use super::*;
    use crate::lane::testing::{exists, fetch, lane, put, V};

    #[test]
    fn values_in_transfer_count_against_the_pinned_bound() {
        let l = lane(8, 0.5);
        for k in ["a", "b", "c", "d", "e", "f"] {
            put(&l, k);
        }
        // A slow reader holds four values mid-send: half the lane, the whole bound.
        let held: Vec<Pinned<'_>> = ["a", "b", "c", "d"].iter().map(|k| fetch(&l, k)).collect();
        assert_eq!(l.fetch(b"e").err(), Some(Status::NoSpace));
        assert_eq!(
            exists(&l, b"e", Duration::from_secs(9)).0,
            Status::OkNoLease
        );
        // Writers are bounded apart from readers: new values still find room by evicting,
        // up to half the lane being received at once.
        let rs: Vec<Reservation<'_>> = (0..4).map(|_| l.reserve(1, V).ok().unwrap()).collect();
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
}
