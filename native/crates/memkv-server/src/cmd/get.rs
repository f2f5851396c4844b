//! GET: no chunk of a value is sent before it matched its checksum, so no byte other than those
//! stored ever leaves. The first chunk (all of a value up to 256 KiB) is checked before the reply
//! starts and a mismatch there answers `Corrupt`; later chunks are checked by the verifier pool
//! ahead of the send (or here, when the pool has not started one yet), and a mismatch drops the
//! value and aborts the connection, which the client sees as a miss.
//!
//! Values stay pinned (not freed by eviction, counted against the lane's pinned-bytes bound)
//! until the reply ends, and the reply must be taken by its deadline (the frame timeout plus its
//! bytes at the minimum rate). A key named twice in one request is served once, at its first
//! place; its repeats answer NOT_FOUND, so a small request cannot ask for a reply larger than
//! the store. A key outside the tenant's prefix answers FORBIDDEN, unlooked-up.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{write_end, Conn, End};
use crate::lane::{Pinned, Value};
use crate::transport::Transport;
use std::sync::Arc;

/// GET replies are written in batches of verified chunks of about this size.
const SEND_BATCH: usize = 1 << 20;

/// Buffer bytes a value's chunk costs while its reply is sent: its place in the send order and
/// in the verifier's list, and its check's state.
pub(super) const PER_CHUNK: u64 = 48;

/// A pinned GET hit: its index in the request, its key and its value.
pub(crate) type Hit<'k, 'a> = (usize, &'k [u8], Pinned<'a>);

impl<'a, T: Transport> Conn<'a, T> {
    /// Looks each (key, expected length) up and pins the hits that have that length. Returns
    /// each key's (status, length) for the reply table, and the pinned hits with their index.
    /// A key named again answers NOT_FOUND; a hit the lane cannot pin now answers NOT_FOUND.
    pub(crate) fn lookup<'k>(
        &self,
        items: impl Iterator<Item = (&'k [u8], u64)>,
    ) -> (Vec<(Status, u64)>, Vec<Hit<'k, 'a>>) {
        let store = &*self.ctx.store;
        let m = &store.metrics;
        let mut st = Vec::with_capacity(items.size_hint().0);
        let mut vals = Vec::with_capacity(items.size_hint().0);
        let mut seen: HashSet<&[u8]> = HashSet::with_capacity(items.size_hint().0);
        let (mut hits, mut misses) = (0u64, 0u64);
        for (i, (key, want)) in items.enumerate() {
            if !self.may_name(key) {
                st.push((Status::Forbidden, 0));
                continue;
            }
            let found = if seen.insert(key) {
                store.fetch_verified(key)
            } else {
                Err(Status::NotFound)
            };
            let s = match found {
                Ok(v) if v.span.len() == want => {
                    vals.push((i, key, v));
                    Status::Ok
                }
                Ok(v) => {
                    st.push((Status::LengthMismatch, v.span.len()));
                    m.misses.fetch_add(1, Ordering::Relaxed);
                    misses += 1;
                    continue;
                }
                Err(Status::NoSpace) => {
                    m.error("pin_denied");
                    Status::NotFound
                }
                Err(s) => s,
            };
            let len = if s == Status::Ok { want } else { 0 };
            (if s == Status::Ok { &m.hits } else { &m.misses }).fetch_add(1, Ordering::Relaxed);
            *(if s == Status::Ok {
                &mut hits
            } else {
                &mut misses
            }) += 1;
            st.push((s, len));
        }
        let usage = &store.usage;
        usage.add(self.tenant_id(), hits, |c| &c.hits);
        usage.add(self.tenant_id(), misses, |c| &c.misses);
        (st, vals)
    }

    pub(crate) fn get(&mut self, h: &Header, body: &[u8], deadline: Instant) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_key_lens(body)?;
        let ctx = self.ctx;
        let store = &*ctx.store;
        let m = &store.metrics;
        let (st, found) = self.lookup(items.iter().map(|(k, n)| (*k, *n)));
        let vals: Vec<(&[u8], Pinned<'_>)> = found.into_iter().map(|(_, k, v)| (k, v)).collect();
        let total: u64 = vals.iter().map(|(_, v)| v.span.len()).sum();
        let chunks: usize = vals.iter().map(|(_, v)| v.chunks()).sum();
        let Some(_chunk_share) = self.take(chunks as u64 * PER_CHUNK, deadline) else {
            return Err(self.busy());
        };
        let table = proto::encode_status_lens(&st);
        let hdr = Header::new(h.opcode.reply(), h.request_id, table.len(), total).encode();
        // Send order: every chunk of every value. Chunk 0 of each was verified above; the later
        // ones are checked by the verifier pool, ahead of the send.
        let order: Vec<(usize, usize)> = vals
            .iter()
            .enumerate()
            .flat_map(|(k, (_, v))| (0..v.chunks()).map(move |i| (k, i)))
            .collect();
        let later: Vec<(Arc<Value>, usize)> = order
            .iter()
            .filter(|(_, i)| *i > 0)
            .map(|&(k, i)| (vals[k].1.value.clone(), i))
            .collect();
        let mut checks = ctx.verifier.check(later);
        // The reply's deadline covers all of it: a reader slower than the minimum rate is cut
        // off, which releases its pins.
        let reply_deadline = self.io.timing.deadline(total + table.len() as u64);
        let mut w = self.io.writer(reply_deadline);
        // The header and table go out with the first chunk, which was verified before the reply
        // started: the client starts receiving while the pool checks the next chunks, instead of
        // the pipe idling for a whole batch's checks (and the pool threads' wake-up).
        let mut batch: Vec<&[u8]> = vec![&hdr, &table];
        let mut batched = 0;
        for (n, &(k, i)) in order.iter().enumerate() {
            let (key, v) = &vals[k];
            if i > 0 && !checks.next_ok() {
                store.drop_corrupt(key, v);
                return Err(End::Io(std::io::Error::other(
                    "checksum mismatch mid-value; reply aborted",
                )));
            }
            let c = v.chunk(i);
            batch.push(c);
            batched += c.len();
            if batched >= SEND_BATCH || n == 0 {
                proto::io::write_all_vectored(&mut w, &batch).map_err(write_end)?;
                batch.clear();
                batched = 0;
            }
        }
        proto::io::write_all_vectored(&mut w, &batch).map_err(write_end)?;
        m.bytes_out.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }
}
