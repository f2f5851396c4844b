//! The RMA batch of an RDMA PUT or GET: its values split into operations the provider takes,
//! run on the connection's endpoint.

use std::time::Instant;

use memkv_fabric::Rma;
use memkv_proto as proto;

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    /// Runs `ops` on this connection's endpoint; a deadline miss or endpoint failure ends the
    /// connection (the endpoint is closed by then).
    pub(super) fn run_rma(
        &mut self,
        ops: &[Rma],
        groups: usize,
        deadline: Instant,
    ) -> Result<Vec<bool>, End> {
        let rd = self.rdma.as_mut().expect("checked by rdma_transfer");
        match rd.ep.run(rd.peer, ops, groups, deadline) {
            Ok(errs) => Ok(errs.into_iter().map(|e| e.is_none()).collect()),
            Err(e) if e.timed_out() => Err(End::Stalled {
                reply_started: false,
            }),
            Err(e) => Err(End::Io(std::io::Error::other(e.to_string()))),
        }
    }

    /// The operations moving `len` bytes between store memory at `local` and the client's
    /// `remote_addr`, split into pieces the provider takes.
    pub(super) fn pieces(
        &self,
        write: bool,
        local: usize,
        d: &proto::Descriptor,
        group: usize,
        ops: &mut Vec<Rma>,
    ) -> Result<(), End> {
        let sf = self
            .ctx
            .rdma
            .as_ref()
            .expect("an endpoint implies a fabric");
        let len = d.len as usize;
        let desc = sf
            .desc(local, len)
            .ok_or_else(|| End::Io(std::io::Error::other("value outside registered memory")))?;
        let piece = sf.fab.max_msg;
        let mut off = 0;
        while off < len {
            let n = piece.min(len - off);
            ops.push(Rma {
                write,
                local: local + off,
                desc,
                len: n,
                remote_addr: d.addr.wrapping_add(off as u64),
                rkey: d.rkey,
                group,
            });
            off += n;
        }
        Ok(())
    }
}
