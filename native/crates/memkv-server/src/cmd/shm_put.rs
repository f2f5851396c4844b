//! PUT over shared memory (`FLAG_SHM`): the server copies each value out of the client's region
//! into a fresh reservation, checksums the copy and only then commits it, so what is stored is
//! exactly the bytes the checksum covers, whatever the client does with its memory meanwhile.
//! A descriptor outside the connection's live regions, or a region whose file shrank under the
//! copy, fails its key as REMOTE_ACCESS and stores nothing; the connection then closes after
//! its reply, as on the RDMA path. A request past its deadline when its copies end commits
//! nothing and gets no reply.

use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status, CHECKSUM_CHUNK};

use crate::conn::{Conn, End};
use crate::lane::Reservation;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_put(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_descriptors(body)?;
        let deadline = self.shm_deadline(&items, deadline)?;
        let store = &*self.ctx.store;
        let mut st = vec![Status::Ok; items.len()];
        let mut done: Vec<(usize, Reservation<'_>)> = Vec::with_capacity(items.len());
        let mut failed = false;
        for (i, (key, d)) in items.iter().enumerate() {
            // Checked before the descriptor: a key the tenant may not write costs no copy.
            if !self.may_write(key) {
                st[i] = Status::Forbidden;
                continue;
            }
            let place = if d.len == 0 { None } else { self.shm.place(d) };
            if d.len != 0 && place.is_none() {
                st[i] = Status::RemoteAccess;
                failed = true;
                continue;
            }
            let mut r = match store.reserve_as(self.tenant_id(), key, d.len) {
                Ok(r) => r,
                Err(s) => {
                    self.count_refused(s);
                    st[i] = s;
                    continue;
                }
            };
            if let Some(p) = place {
                let dst = r.bytes_mut();
                // SAFETY: `p` lies inside a live mapping of this connection (checked by
                // `place`), the reservation is `d.len` bytes of store memory, and they are
                // different mappings.
                let ok = unsafe {
                    crate::fault_guard::copy(
                        dst.as_mut_ptr(),
                        p.addr as *const u8,
                        dst.len(),
                        p.mapping,
                    )
                };
                if !ok {
                    self.shm_fault(p.region);
                    st[i] = Status::RemoteAccess;
                    failed = true;
                    continue;
                }
            }
            done.push((i, r));
        }
        if Instant::now() > deadline {
            // Copies this slow (a stopped server) may hold bytes the caller changed after it
            // gave up: none of them is committed.
            return Err(End::Stalled {
                reply_started: false,
            });
        }
        let mut bytes = 0;
        self.count_puts(done.len() as u64);
        for (i, mut r) in done {
            let (key, d) = &items[i];
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
            bytes += d.len;
        }
        store.metrics.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        self.reply(h, &proto::encode_statuses(&st))?;
        self.shm_after(failed)
    }
}
