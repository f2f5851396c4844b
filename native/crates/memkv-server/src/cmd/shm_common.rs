//! What the shared-memory PUT and GET (`shm_put`, `shm_get`) share: their deadline and copy
//! pool, and what a failed copy does to the connection.

use std::time::Instant;

use memkv_proto::{Descriptor, ProtoError};

use crate::conn::{Conn, End};
use crate::shm::ShmShared;
use crate::shm_copy::Copier;
use crate::transport::Transport;

impl<'a, T: Transport> Conn<'a, T> {
    /// The request's deadline (the frame allowance plus its bytes at the minimum rate, as over
    /// TCP) and the copy pool its copies go through. A transfer on a connection without regions
    /// is a protocol error.
    pub(super) fn shm_start(
        &self,
        items: &[(&[u8], Descriptor)],
        deadline: Instant,
    ) -> Result<(Instant, &'a Copier), End> {
        let shared = self.ctx.shm.as_deref();
        let Some(copier) = shared
            .filter(|_| !self.shm.is_empty())
            .map(ShmShared::copier)
        else {
            return Err(ProtoError::Malformed("a shared-memory transfer before SHM_REGION").into());
        };
        let total = items
            .iter()
            .try_fold(0u64, |a, (_, d)| a.checked_add(d.len))
            .ok_or(ProtoError::Malformed("descriptor lengths overflow"))?;
        Ok((deadline.max(self.io.timing.deadline(total)), copier))
    }

    /// A copy hit a page its file no longer has (the client shrank it): the region is dead.
    pub(super) fn shm_fault(&mut self, region: u32) {
        self.shm.kill(region);
        self.ctx.store.metrics.error("shm_fault");
        if let Some(dropped) = self.ctx.warn.allow() {
            tracing::warn!(peer = %self.io.transport().peer(), region, dropped_warnings = dropped,
                "a client's shared-memory region shrank under a copy; its transfers fail");
        }
    }

    /// After the reply: a key that failed REMOTE_ACCESS closes the connection, as on the RDMA
    /// path (the client's view of its regions and ours differ).
    pub(super) fn shm_after(&mut self, failed: bool) -> Result<(), End> {
        if failed {
            self.ctx.store.metrics.error("shm_remote");
            return Err(End::Closed);
        }
        Ok(())
    }
}
