//! PUT over RDMA: the server reads each value out of the client's memory into a fresh
//! reservation, and checksums and commits it only after all its reads completed; one whose read
//! failed is dropped (REMOTE_ACCESS) and nothing of it is visible.

use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::lane::Reservation;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    /// Returns whether a remote read failed.
    pub(super) fn put_rdma(
        &mut self,
        h: &Header,
        items: &[(&[u8], proto::Descriptor)],
        deadline: Instant,
    ) -> Result<bool, End> {
        let store = &*self.ctx.store;
        let mut st = vec![Status::Ok; items.len()];
        let mut res: Vec<Option<Reservation<'_>>> = Vec::with_capacity(items.len());
        let mut ops = Vec::new();
        for (i, (key, d)) in items.iter().enumerate() {
            let reserved = if self.may_write(key) {
                store.reserve_as(self.tenant_id(), key, d.len)
            } else {
                Err(Status::Forbidden)
            };
            match reserved {
                Ok(mut r) => {
                    let local = r.bytes_mut().as_mut_ptr() as usize;
                    self.pieces(false, local, d, i, &mut ops)?;
                    res.push(Some(r));
                }
                Err(s) => {
                    if s != Status::Forbidden {
                        self.count_refused(s);
                    }
                    st[i] = s;
                    res.push(None);
                }
            }
        }
        // On an error here the endpoint is closed before `res` drops the reservations.
        let ok = self.run_rma(&ops, items.len(), deadline)?;
        let mut failed = false;
        let mut committed = 0;
        for (i, ((key, d), r)) in items.iter().zip(res).enumerate() {
            let Some(mut r) = r else { continue };
            if !ok[i] {
                st[i] = Status::RemoteAccess;
                failed = true;
                continue;
            }
            let sums = proto::chunk_checksums(r.bytes_mut());
            store.commit(key, r, sums);
            store.metrics.puts.fetch_add(1, Ordering::Relaxed);
            store.metrics.bytes_in.fetch_add(d.len, Ordering::Relaxed);
            committed += 1;
        }
        self.count_puts(committed);
        self.reply(h, &proto::encode_statuses(&st))?;
        Ok(failed)
    }
}
