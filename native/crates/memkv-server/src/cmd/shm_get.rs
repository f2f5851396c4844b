//! GET over shared memory (`FLAG_SHM`): the key lookup, pins, leases and checks of every GET,
//! then the server copies each hit from its memory into the client's region before it replies.
//! Every chunk of a value is verified before any byte of it is copied (a mismatch answers
//! CORRUPT, drops the value and copies nothing), and after the reply the server never touches
//! the client's memory for the request. A descriptor outside the connection's live regions, or
//! a region whose file shrank under the copy, fails its key as REMOTE_ACCESS; the connection
//! then closes after its reply. Copies go in pieces, the deadline checked before each, so a
//! request that ran out of time stops copying (and gets no reply).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::lane::Value;
use crate::transport::Transport;

/// Bytes copied between two looks at the deadline.
const COPY_PIECE: usize = 1 << 20;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_get(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_descriptors(body)?;
        let deadline = self.shm_deadline(&items, deadline)?;
        let ctx = self.ctx;
        let store = &*ctx.store;
        let (mut st, vals) = self.lookup(items.iter().map(|(k, d)| (*k, d.len)));
        let chunks: u64 = vals.iter().map(|(_, _, v)| v.chunks() as u64).sum();
        let Some(_chunk_share) = self.take(chunks * super::get::PER_CHUNK, deadline) else {
            return Err(self.busy());
        };
        // Every chunk after the first (checked by the lookup) is verified before any copy.
        let later: Vec<(Arc<Value>, usize)> = vals
            .iter()
            .flat_map(|(_, _, v)| (1..v.chunks()).map(|c| (v.value.clone(), c)))
            .collect();
        let mut checks = ctx.verifier.check(later);
        let mut failed = false;
        let mut sent = 0u64;
        for (i, key, v) in &vals {
            let intact = (1..v.chunks()).fold(true, |ok, _| checks.next_ok() && ok);
            if !intact {
                store.drop_corrupt(key, v);
                st[*i] = (Status::Corrupt, 0);
                continue;
            }
            let src = v.span.as_slice();
            if src.is_empty() {
                continue;
            }
            let Some(p) = self.shm.place(&items[*i].1) else {
                st[*i] = (Status::RemoteAccess, 0);
                failed = true;
                continue;
            };
            for off in (0..src.len()).step_by(COPY_PIECE) {
                if Instant::now() > deadline {
                    return Err(End::Stalled {
                        reply_started: false,
                    });
                }
                let n = COPY_PIECE.min(src.len() - off);
                // SAFETY: `p` lies inside a live mapping of this connection with room for the
                // value (checked by `place` against the descriptor, whose length the lookup
                // matched), the value is pinned store memory, and they are different mappings.
                let ok = unsafe {
                    crate::fault_guard::copy(
                        (p.addr + off) as *mut u8,
                        src[off..].as_ptr(),
                        n,
                        p.mapping,
                    )
                };
                if !ok {
                    self.shm_fault(p.region);
                    st[*i] = (Status::RemoteAccess, 0);
                    failed = true;
                    break;
                }
            }
            if st[*i].0 == Status::Ok {
                sent += src.len() as u64;
            }
        }
        store.metrics.bytes_out.fetch_add(sent, Ordering::Relaxed);
        self.reply(h, &proto::encode_status_lens(&st))?;
        drop(vals);
        self.shm_after(failed)
    }
}
