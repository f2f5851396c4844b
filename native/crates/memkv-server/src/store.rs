//! The store: lanes addressed by key hash, plus the server-wide limits and counters.

use std::time::Duration;

use memkv_proto::Status;

use crate::lane::{Lane, LaneStats, Pinned, Reservation, Value};
use crate::metrics::Metrics;
use std::sync::Arc;

pub struct Store {
    lanes: Vec<Lane>,
    pub max_value_len: u64,
    pub metrics: Arc<Metrics>,
}

impl Store {
    /// Splits `memory` bytes evenly over `lanes` lanes, reserving and pre-faulting all of it now.
    /// Each lane's share bounds its values and its index together (see `lane::index_charge`).
    pub fn new(memory: u64, lanes: usize, max_leased_fraction: f64) -> std::io::Result<Store> {
        let lanes = lanes.max(1);
        let per_lane = (memory / lanes as u64) as usize;
        let lanes = (0..lanes)
            .map(|_| Lane::new(per_lane, max_leased_fraction))
            .collect::<std::io::Result<Vec<_>>>()?;
        // Announced for the longest key, so a value under the limit fits under any key.
        let max_value_len = lanes[0].max_value_len(memkv_proto::MAX_KEY_LEN);
        Ok(Store {
            lanes,
            max_value_len,
            metrics: Arc::default(),
        })
    }

    fn lane(&self, key: &[u8]) -> &Lane {
        let h = twox_hash::XxHash3_64::oneshot(key);
        &self.lanes[(h % self.lanes.len() as u64) as usize]
    }

    pub fn reserve(&self, key: &[u8], len: u64) -> Result<Reservation<'_>, Status> {
        if len > self.max_value_len {
            return Err(Status::TooLarge);
        }
        self.lane(key).reserve(key.len(), len)
    }

    pub fn commit(&self, key: &[u8], res: Reservation<'_>, checksums: Vec<u64>) {
        self.lane(key).commit(key, res, checksums)
    }

    /// EXISTS, with a lease of at most `MAX_LEASE_MS` (longer asks are cut to it).
    pub fn exists(&self, key: &[u8], lease: Duration) -> (Status, u64) {
        let lease = lease.min(Duration::from_millis(memkv_proto::MAX_LEASE_MS));
        self.lane(key).exists(key, lease)
    }

    /// GET lookup. The first chunk (all of a value up to `CHECKSUM_CHUNK`) is verified here,
    /// so a mismatch there is reported as `Corrupt` before the reply starts; every later chunk is
    /// verified before it is sent, by the verifier pool (see `cmd::get`, `verify`). The value is
    /// pinned until the returned guard drops; NoSpace when the lane's pinned bytes are at their
    /// bound.
    pub fn fetch_verified(&self, key: &[u8]) -> Result<Pinned<'_>, Status> {
        match self.lane(key).fetch(key)? {
            None => Err(Status::NotFound),
            Some(v) if v.chunk_ok(0) => Ok(v),
            Some(v) => {
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

    pub fn delete(&self, key: &[u8]) -> Status {
        self.lane(key).delete(key)
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
        self.metrics.to_json(&self.lane_stats(), self.lanes.len())
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
        assert_eq!(s.exists(b"k", forty_nine_days).0, Status::Ok);
        let left = s.lane(b"k").lease_left(b"k").unwrap();
        assert!(
            left <= Duration::from_millis(memkv_proto::MAX_LEASE_MS),
            "{left:?}"
        );
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
