//! PUT and GET over RDMA (frames flagged `FLAG_RDMA`), and the RDMA_HELLO that sets a
//! connection's endpoint up. The key tables, statuses, checksums, pins, leases and limits are
//! those of the TCP commands; only the values move differently: the server reads a PUT's
//! values out of the client's memory into fresh reservations, and writes a GET's values from
//! the store into the client's memory, before it replies.
//!
//! Ordering rules that make the path safe:
//! - A PUT value is checksummed and committed only after all its reads completed; one whose
//!   read failed is dropped (REMOTE_ACCESS) and nothing of it is visible.
//! - Every chunk of a GET value is verified before any byte of it is written (a mismatch
//!   answers CORRUPT and writes nothing), and the reply is sent only after every write
//!   completed in the client's memory (writes are delivery-complete). After the reply the
//!   server never touches the client's memory for that request.
//! - A deadline miss or a broken endpoint closes the endpoint before the reservations and pins
//!   the operations named are released, and ends the connection without a reply.
//! - A failed remote operation may have torn down the provider's path to the client (the tcp
//!   provider does), so the connection closes after a reply that carries REMOTE_ACCESS; the
//!   client opens a new one for its next request.

use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use memkv_fabric::{Endpoint, Rma};
use memkv_proto::{self as proto, Header, Opcode, ProtoError, Status, CHECKSUM_CHUNK};

use crate::conn::{Conn, End};
use crate::lane::{Reservation, Value};
use crate::rdma::RdmaPeer;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn rdma_hello(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let (prov, addr) = proto::decode_rdma_hello(body)?;
        let answer = match &self.ctx.rdma {
            None => Err("RDMA is off on this server (start it with --rdma)".to_string()),
            Some(sf) if sf.fab.provider != prov => Err(format!(
                "the server's libfabric provider is {:?}, the client's {prov:?}",
                sf.fab.provider
            )),
            Some(sf) => Endpoint::open(&sf.fab)
                .and_then(|mut ep| ep.insert_peer(addr).map(|peer| RdmaPeer { ep, peer }))
                .map_err(|e| format!("cannot reach the client's endpoint: {e}")),
        };
        let reply = match answer {
            Ok(p) => {
                self.rdma = Some(p);
                proto::encode_rdma_hello_reply(true, "")
            }
            Err(why) => {
                self.ctx.store.metrics.error("rdma_refused");
                proto::encode_rdma_hello_reply(false, &why)
            }
        };
        self.reply(h, &reply)
    }

    pub(crate) fn rdma_transfer(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        if self.rdma.is_none() {
            return Err(ProtoError::Malformed("an RDMA transfer before RDMA_HELLO").into());
        }
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_descriptors(body)?;
        let total = items
            .iter()
            .try_fold(0u64, |a, (_, d)| a.checked_add(d.len))
            .ok_or(ProtoError::Malformed("descriptor lengths overflow"))?;
        // The same deadline rule as TCP: the frame allowance plus the bytes at the minimum rate.
        let deadline = deadline.max(self.io.timing.deadline(total));
        let failed = if h.opcode == Opcode::Put {
            self.put_rdma(h, &items, deadline)?
        } else {
            self.get_rdma(h, &items, deadline)?
        };
        if failed {
            self.ctx.store.metrics.error("rdma_remote");
            if let Some(dropped) = self.ctx.warn.allow() {
                tracing::warn!(peer = %self.io.transport().peer(), dropped_warnings = dropped,
                    "RDMA access to client memory failed (bad descriptor or client gone); \
                     closing the connection after its reply");
            }
            return Err(End::Closed);
        }
        Ok(())
    }

    /// Runs `ops` on this connection's endpoint; a deadline miss or endpoint failure ends the
    /// connection (the endpoint is closed by then).
    fn run_rma(&mut self, ops: &[Rma], groups: usize, deadline: Instant) -> Result<Vec<bool>, End> {
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
    fn pieces(
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

    /// Returns whether a remote read failed.
    fn put_rdma(
        &mut self,
        h: &Header,
        items: &[(&[u8], proto::Descriptor)],
        deadline: Instant,
    ) -> Result<bool, End> {
        let store = &*self.ctx.store;
        let mut st = vec![Status::Ok; items.len()];
        let mut res: Vec<Option<Reservation>> = Vec::with_capacity(items.len());
        let mut ops = Vec::new();
        for (i, (key, d)) in items.iter().enumerate() {
            match store.reserve(key, d.len) {
                Ok(mut r) => {
                    let local = r.bytes_mut().as_mut_ptr() as usize;
                    self.pieces(false, local, d, i, &mut ops)?;
                    res.push(Some(r));
                }
                Err(s) => {
                    store.metrics.error(if s == Status::TooLarge {
                        "too_large"
                    } else {
                        "no_space"
                    });
                    st[i] = s;
                    res.push(None);
                }
            }
        }
        // On an error here the endpoint is closed before `res` drops the reservations.
        let ok = self.run_rma(&ops, items.len(), deadline)?;
        let mut failed = false;
        for (i, ((key, d), r)) in items.iter().zip(res).enumerate() {
            let Some(mut r) = r else { continue };
            if !ok[i] {
                st[i] = Status::RemoteAccess;
                failed = true;
                continue;
            }
            let sums: Vec<u64> = if d.len == 0 {
                vec![proto::checksum(&[])]
            } else {
                r.bytes_mut()
                    .chunks(CHECKSUM_CHUNK)
                    .map(|c| {
                        let mut hs = proto::checksum_hasher();
                        hs.write(c);
                        hs.finish()
                    })
                    .collect()
            };
            store.commit(key, r, sums);
            store.metrics.puts.fetch_add(1, Ordering::Relaxed);
            store.metrics.bytes_in.fetch_add(d.len, Ordering::Relaxed);
        }
        self.reply(h, &proto::encode_statuses(&st))?;
        Ok(failed)
    }

    /// Returns whether a remote write failed.
    fn get_rdma(
        &mut self,
        h: &Header,
        items: &[(&[u8], proto::Descriptor)],
        deadline: Instant,
    ) -> Result<bool, End> {
        let ctx = self.ctx;
        let store = &*ctx.store;
        let (mut st, vals) = self.lookup(items.iter().map(|(k, d)| (*k, d.len)));
        let chunks: u64 = vals.iter().map(|(_, _, v)| v.chunks() as u64).sum();
        let Some(_chunk_share) = self.take(chunks * super::get::PER_CHUNK, deadline) else {
            return Err(self.busy());
        };
        // Every chunk after the first (checked by the lookup) is verified before any write.
        let later: Vec<(Arc<Value>, usize)> = vals
            .iter()
            .flat_map(|(_, _, v)| (1..v.chunks()).map(|c| (v.value.clone(), c)))
            .collect();
        let mut checks = ctx.verifier.check(later);
        let mut ops = Vec::new();
        let mut sent = 0u64;
        for (i, key, v) in &vals {
            let intact = (1..v.chunks()).fold(true, |ok, _| checks.next_ok() && ok);
            if !intact {
                store.drop_corrupt(key, v);
                st[*i] = (Status::Corrupt, 0);
                continue;
            }
            let local = v.span.as_slice().as_ptr() as usize;
            self.pieces(true, local, &items[*i].1, *i, &mut ops)?;
            sent += v.span.len();
        }
        // On an error here the endpoint is closed before `vals` drops the pins.
        let ok = self.run_rma(&ops, items.len(), deadline)?;
        let mut failed = false;
        for (i, _, v) in &vals {
            if st[*i].0 == Status::Ok && !ok[*i] {
                st[*i] = (Status::RemoteAccess, 0);
                sent -= v.span.len();
                failed = true;
            }
        }
        store.metrics.bytes_out.fetch_add(sent, Ordering::Relaxed);
        self.reply(h, &proto::encode_status_lens(&st))?;
        drop(vals);
        Ok(failed)
    }
}
