//! The index's entries: committed values, their S3-FIFO and lease state, and the memory each is
//! charged for.

use std::sync::Arc;
use std::time::Instant;

use crate::arena::Span;

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
/// ghost (a tenant with a quota pays `OWN_QUEUE_CHARGE` more). docs/security.md states the bound
/// this gives.
pub const ENTRY_OVERHEAD: u64 = 512;

/// What an entry of `key_len` and `len` bytes is charged for its index memory.
pub fn index_charge(key_len: usize, len: u64) -> u64 {
    let chunks = len.div_ceil(memkv_proto::CHECKSUM_CHUNK as u64).max(1);
    ENTRY_OVERHEAD + key_len as u64 + 8 * chunks
}

pub(super) type Key = Arc<[u8]>;

pub(super) struct Entry {
    pub(super) value: Arc<Value>,
    /// Tells this entry's queue and lease items from those of an earlier value of its key.
    pub(super) gen: u64,
    /// S3-FIFO's access count (0 to 3).
    pub(super) freq: u8,
    /// Queued in S3-FIFO's main queue (else in its small one).
    pub(super) in_main: bool,
    pub(super) lease_until: Option<Instant>,
    /// Index bytes charged for this entry (`index_charge`).
    pub(super) charge: u64,
    /// Whose value it is (charged to that tenant's quota).
    pub(super) tenant: crate::tenants::TenantId,
}

#[cfg(test)]
mod tests {
    use memkv_proto::Status;

    use super::*;
    use crate::lane::testing::put_len;
    use crate::lane::Lane;

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
