//! The commands, one module each, and `rma_batch`, the RDMA transfer of `put_rdma` and
//! `get_rdma`. Every command decodes its key table only after taking its share of
//! the byte budget for the decoded table and the reply (`PER_KEY` bytes a key, `key_share`).

mod delete;
mod exists;
mod get;
mod get_mapped;
mod get_rdma;
mod put;
mod put_rdma;
mod rdma_hello;
#[cfg(test)]
mod rdma_test_client;
mod rdma_transfer;
mod rma_batch;
mod shm_common;
mod shm_get;
mod shm_put;
mod shm_region;
mod shm_release;
mod shm_values;

use std::time::Instant;

use memkv_proto::Status;

use crate::conn::{Conn, End};
use crate::limits::BudgetShare;
use crate::transport::Transport;

/// Buffer bytes a key of a batch may cost beyond the request body: its decoded table entry
/// (a slice and a length), its status, and its reply table entry.
const PER_KEY: u64 = 64;

impl<'a, T: Transport> Conn<'a, T> {
    /// The budget share for the keys of a body whose key count (u32) sits at `count_at`. A body
    /// too short to hold one gets none: decoding it fails anyway.
    fn key_share(
        &self,
        body: &[u8],
        count_at: usize,
        deadline: Instant,
    ) -> Result<BudgetShare<'a>, End> {
        let count = body
            .get(count_at..count_at + 4)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()))
            .min(memkv_proto::MAX_BATCH as u32 + 1);
        self.take(count as u64 * PER_KEY, deadline)
            .ok_or_else(|| self.busy())
    }

    /// Counts a PUT key the store refused (`Store::reserve_as`'s error).
    fn count_refused(&self, s: Status) {
        let store = &*self.ctx.store;
        match s {
            Status::OverQuota => store.usage.add(self.tenant_id(), 1, |c| &c.over_quota),
            Status::TooLarge => store.metrics.error("too_large"),
            _ => store.metrics.error("no_space"),
        }
    }

    /// Counts `n` values committed for this connection's tenant.
    fn count_puts(&self, n: u64) {
        self.ctx.store.usage.add(self.tenant_id(), n, |c| &c.puts);
    }
}
