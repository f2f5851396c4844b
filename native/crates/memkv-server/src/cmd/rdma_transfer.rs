//! PUT and GET over RDMA (frames flagged `FLAG_RDMA`, on a connection whose endpoint
//! `rdma_hello` set up): `put_rdma` and `get_rdma` run them, `rma_batch` moves their bytes.
//! The key tables, statuses, checksums, pins, leases and limits are those of the TCP commands;
//! only the values move differently: the server reads a PUT's values out of the client's memory
//! into fresh reservations, and writes a GET's values from the store into the client's memory,
//! before it replies.
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

use std::time::Instant;

use memkv_proto::{self as proto, Header, Opcode, ProtoError};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
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
}

#[cfg(test)]
mod tests {
    use memkv_proto::Status;

    use super::super::rdma_test_client::{closed, connect, get, put, server, Peer};

    #[test]
    fn bad_descriptors_fail_their_key_and_touch_nothing_else() {
        let srv = server();
        let mut peer = Peer::new(1 << 20);
        let val: Vec<u8> = (0..300_000u32).map(|i| (i % 249) as u8).collect();
        peer.mem[..val.len()].copy_from_slice(&val);
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(
            put(&mut s, b"good", peer.desc(0, val.len())),
            Some(Status::Ok)
        );
        // A wrong key: REMOTE_ACCESS, nothing stored, connection closed after the reply.
        let mut bad = peer.desc(0, 1000);
        bad.rkey ^= 0x77;
        assert_eq!(put(&mut s, b"bad", bad), Some(Status::RemoteAccess));
        assert!(closed(&mut s));
        assert!(srv.store.fetch_verified(b"bad").is_err(), "nothing stored");
        // An address past the registration: the write fails; the registered bytes are as
        // they were.
        let before = peer.mem.clone();
        let (mut s, _, _) = connect(&srv, &peer.provider, &peer.name);
        let past = peer.desc(peer.mem.len() - 8, val.len());
        assert_eq!(get(&mut s, b"good", past), Some(Status::RemoteAccess));
        assert!(closed(&mut s));
        assert_eq!(peer.mem, before);
        // A length that is not the stored one: LENGTH_MISMATCH, nothing written.
        let (mut s, _, _) = connect(&srv, &peer.provider, &peer.name);
        let off = 1 << 19;
        let wrong = peer.desc(off, val.len() - 1);
        assert_eq!(get(&mut s, b"good", wrong), Some(Status::LengthMismatch));
        assert_eq!(peer.mem, before);
        // The connection and the server still serve: the value comes back whole.
        assert_eq!(
            get(&mut s, b"good", peer.desc(off, val.len())),
            Some(Status::Ok)
        );
        assert_eq!(&peer.mem[off..off + val.len()], &val[..]);
        assert_eq!(srv.store.metrics.errors("rdma_remote"), 2);
        srv.shutdown();
        srv.wait();
    }
}
