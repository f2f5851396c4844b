//! GET over shared memory (`FLAG_SHM`): the key lookup, pins, leases and checks of every GET,
//! then the server copies each hit from its memory into the client's region before it replies.
//! Every chunk of a value is verified before any byte of it is copied (a mismatch answers
//! CORRUPT, drops the value and copies nothing), and after the reply the server never touches
//! the client's memory for the request. A descriptor outside the connection's live regions, or
//! a region whose file shrank under the copy, fails its key as REMOTE_ACCESS; the connection
//! then closes after its reply. Copies go in pieces over the copy pool (`crate::shm_copy`), the
//! deadline checked before each, so a request that ran out of time stops copying (and gets no
//! reply).

use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::lane::Value;
use crate::shm_copy::CopyJob;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_get(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_descriptors(body)?;
        let (deadline, copier) = self.shm_start(&items, deadline)?;
        let ctx = self.ctx;
        let store = &*ctx.store;
        let (mut st, vals) = self.lookup(items.iter().map(|(k, d)| (*k, d.len)));
        let chunks: u64 = vals.iter().map(|(_, _, v)| v.chunks() as u64).sum();
        let Some(_chunk_share) = self.take(chunks * super::get::PER_CHUNK, deadline) else {
            return Err(self.busy());
        };
        // Every chunk after the first (checked by the lookup) is verified before any copy, then
        // the intact values are copied together (their pieces spread over the copy pool):
        // nothing of a corrupt value reaches the client.
        let values: Vec<&Value> = vals.iter().map(|(_, _, v)| &*v.value).collect();
        let intact = copier.verify(&values);
        let mut failed = false;
        let mut jobs = Vec::with_capacity(vals.len());
        let mut copied = Vec::with_capacity(vals.len()); // (item, region) of each job
        for ((i, key, v), intact) in vals.iter().zip(intact) {
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
            jobs.push(CopyJob {
                dst: p.addr as *mut u8,
                src: src.as_ptr(),
                len: src.len(),
                mapping: p.mapping,
            });
            copied.push((*i, p.region));
        }
        // SAFETY: each destination lies inside a live mapping of this connection with room for
        // its value (checked by `place` against the descriptor, whose length the lookup matched),
        // which `self.shm` keeps mapped until the call returns; each source is pinned store
        // memory (`vals`); they are different mappings, and the regions' bytes are the client's
        // to overlap (a client naming one place twice gets one of the values there).
        let whole = unsafe { copier.copy(&jobs, deadline) }.map_err(|_| End::Stalled {
            reply_started: false,
        })?;
        let mut sent = 0u64;
        for ((i, region), (job, ok)) in copied.into_iter().zip(jobs.iter().zip(whole)) {
            if ok {
                sent += job.len as u64;
            } else {
                self.shm_fault(region);
                st[i] = (Status::RemoteAccess, 0);
                failed = true;
            }
        }
        store.metrics.bytes_out.fetch_add(sent, Ordering::Relaxed);
        self.reply(h, &proto::encode_status_lens(&st))?;
        drop(vals);
        self.shm_after(failed)
    }
}
