//! GET over RDMA: the server writes each value from the store into the client's memory, every
//! chunk verified before any byte of it is written (a mismatch answers CORRUPT and writes
//! nothing), and replies only after every write completed in the client's memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::lane::Value;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    /// Returns whether a remote write failed.
    pub(super) fn get_rdma(
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

#[cfg(test)]
mod tests {
    use memkv_proto::{self as proto, Status};

    use super::super::rdma_test_client::{connect, get, put, server, Peer};

    #[test]
    fn a_corrupt_value_answers_corrupt_and_writes_no_byte() {
        let srv = server();
        let mut peer = Peer::new(2 << 20);
        let len = 3 * proto::CHECKSUM_CHUNK + 5;
        for (i, b) in peer.mem[..len].iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(put(&mut s, b"v", peer.desc(0, len)), Some(Status::Ok));
        let v = srv.store.fetch_verified(b"v").ok().unwrap();
        v.span.corrupt_for_test(2 * proto::CHECKSUM_CHUNK + 7);
        drop(v);
        let off = 1 << 20;
        peer.mem[off..off + len].fill(0xEE);
        assert_eq!(
            get(&mut s, b"v", peer.desc(off, len)),
            Some(Status::Corrupt)
        );
        assert!(
            peer.mem[off..off + len].iter().all(|&b| b == 0xEE),
            "no byte written"
        );
        assert!(srv.store.fetch_verified(b"v").is_err(), "dropped");
        assert_eq!(srv.store.metrics.errors("corrupt"), 1);
        srv.shutdown();
        srv.wait();
    }
}
