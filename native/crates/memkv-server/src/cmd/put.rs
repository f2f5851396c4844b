//! PUT: each value is read into a fresh reservation and becomes visible only once all of its
//! bytes arrived and were checksummed. A value the store refuses is read and discarded so the
//! stream stays in sync; a connection lost or cut off mid-value drops the reservation, leaving
//! nothing. The whole request, values included, must arrive by its frame deadline.

use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, ProtoError, Status, CHECKSUM_CHUNK};

use crate::conn::{Conn, End};
use crate::transport::Transport;

/// Refused values are read off the socket through a buffer of this size.
const DISCARD_PIECE: usize = 64 << 10;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn put(&mut self, h: &Header, body: &[u8], deadline: Instant) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_key_lens(body)?;
        let total = items.iter().try_fold(0u64, |a, (_, n)| a.checked_add(*n));
        if total != Some(h.payload_len) {
            return Err(
                ProtoError::Malformed("PUT payload length differs from its key table").into(),
            );
        }
        let store = &*self.ctx.store;
        let mut st = Vec::with_capacity(items.len());
        let mut committed = 0;
        for (key, len) in items {
            // Outside the tenant's prefix (or read-only): the value is read off and dropped,
            // the store never asked.
            let reserved = if self.may_write(key) {
                store.reserve_as(self.tenant_id(), key, len)
            } else {
                Err(Status::Forbidden)
            };
            match reserved {
                Ok(mut res) => {
                    // Each chunk is hashed piece by piece as its bytes land (still in cache), so
                    // the reply waits only for the hash of the last piece, not of a whole chunk.
                    let mut sums = Vec::with_capacity(1 + len as usize / CHECKSUM_CHUNK);
                    for chunk in res.bytes_mut().chunks_mut(CHECKSUM_CHUNK) {
                        let mut hasher = proto::checksum_hasher();
                        self.io
                            .read_exact(chunk, deadline, |piece| hasher.write(piece))?;
                        sums.push(hasher.finish());
                    }
                    if sums.is_empty() {
                        sums.push(proto::checksum(&[]));
                    }
                    store.commit(key, res, sums);
                    store.metrics.puts.fetch_add(1, Ordering::Relaxed);
                    store.metrics.bytes_in.fetch_add(len, Ordering::Relaxed);
                    committed += 1;
                    st.push(Status::Ok);
                }
                Err(s) => {
                    if s != Status::Forbidden {
                        self.count_refused(s);
                    }
                    self.discard(len, deadline)?;
                    st.push(s);
                }
            }
        }
        self.count_puts(committed);
        self.reply(h, &proto::encode_statuses(&st))
    }

    fn discard(&mut self, mut n: u64, deadline: Instant) -> Result<(), End> {
        let mut scratch = vec![0u8; DISCARD_PIECE.min(n as usize)];
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            self.io.read_exact(&mut scratch[..k], deadline, |_| {})?;
            n -= k as u64;
        }
        Ok(())
    }
}
