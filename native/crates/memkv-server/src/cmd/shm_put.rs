//! PUT over shared memory (`FLAG_SHM`): the server copies each value out of the client's region
//! into a fresh reservation (its pieces spread over the copy pool, `crate::shm_copy`), checksums
//! the copy and only then commits it, so what is stored is exactly the bytes the checksum
//! covers, whatever the client does with its memory meanwhile.
//! A descriptor outside the connection's live regions, or a region whose file shrank under the
//! copy, fails its key as REMOTE_ACCESS and stores nothing; the connection then closes after
//! its reply, as on the RDMA path. A request past its deadline when its copies end commits
//! nothing and gets no reply.

use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::lane::Reservation;
use crate::shm_copy::CopyJob;
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
        let (deadline, copier) = self.shm_start(&items, deadline)?;
        let store = &*self.ctx.store;
        let mut st = vec![Status::Ok; items.len()];
        let mut done: Vec<(usize, Reservation<'_>, Option<u32>)> = Vec::with_capacity(items.len());
        let mut jobs = Vec::with_capacity(items.len());
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
            if let Some(p) = &place {
                let dst = r.bytes_mut();
                jobs.push(CopyJob {
                    dst: dst.as_mut_ptr(),
                    src: p.addr as *const u8,
                    len: dst.len(),
                    mapping: p.mapping,
                });
            }
            done.push((i, r, place.map(|p| p.region)));
        }
        // SAFETY: each source lies inside a live mapping of this connection (checked by
        // `place`), which `self.shm` keeps mapped until the call returns; each destination is
        // its own reservation of `d.len` bytes of store memory, held in `done`.
        let whole = unsafe { copier.copy(&jobs, deadline) };
        // Copies this slow (a stopped server) may hold bytes the caller changed after it gave
        // up: none of them is committed.
        let whole = match whole {
            Ok(w) if Instant::now() <= deadline => w,
            _ => {
                return Err(End::Stalled {
                    reply_started: false,
                })
            }
        };
        let mut whole = whole.into_iter();
        let mut intact = Vec::with_capacity(done.len());
        for (i, r, region) in done {
            if let Some(region) = region {
                if !whole.next().unwrap_or(false) {
                    self.shm_fault(region);
                    st[i] = Status::RemoteAccess;
                    failed = true;
                    continue; // the reservation goes back unused
                }
            }
            intact.push((i, r));
        }
        let mut bytes = 0;
        self.count_puts(intact.len() as u64);
        for (i, mut r) in intact {
            let (key, d) = &items[i];
            let sums = copier.checksums(r.bytes_mut());
            store.commit(key, r, sums);
            store.metrics.puts.fetch_add(1, Ordering::Relaxed);
            bytes += d.len;
        }
        store.metrics.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        self.reply(h, &proto::encode_statuses(&st))?;
        self.shm_after(failed)
    }
}
