//! GET_MAPPED (`--shm-share-values`): the key lookup, pins and leases of every GET, then, instead
//! of the bytes, where each hit lies in its lane's memory, which the client maps read-only
//! (SHM_VALUES) and copies from itself (a GPU: one host-to-device copy out of the server's
//! pages). The first chunk of each hit is checked by the lookup (a mismatch answers CORRUPT);
//! the others are verified on the copy pool while the client copies, and the client's
//! SHM_RELEASE answers the verdict: a value that failed is dropped and the client's copy of it
//! does not count (what a GET does by checking before it sends, without the GPU waiting for the
//! CPU). The hits stay pinned until that release or the connection's end (`crate::mapped`); a
//! connection already holding `MAX_PIN_SETS` answers NOT_FOUND for everything, unlooked-up.

use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, MappedValue, ProtoError, Status};

use crate::conn::{Conn, End};
use crate::mapped::PinSet;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn get_mapped(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_key_lens(body)?;
        let ctx = self.ctx;
        let Some(shared) = ctx.shm.as_deref().filter(|s| s.shares_values()) else {
            return Err(
                ProtoError::Malformed("GET_MAPPED on a server without --shm-share-values").into(),
            );
        };
        let store = &*ctx.store;
        let miss = MappedValue {
            status: Status::NotFound,
            len: 0,
            lane: 0,
            offset: 0,
        };
        if !self.pins.has_room() {
            store.metrics.error("pin_sets_full");
            return self.reply(
                h,
                &proto::encode_get_mapped_reply(0, &vec![miss; items.len()]),
            );
        }
        let (st, vals) = self.lookup(items.iter().map(|(k, n)| (*k, *n)));
        let mut out: Vec<MappedValue> = st
            .iter()
            .map(|&(status, len)| MappedValue {
                status,
                len,
                ..miss
            })
            .collect();
        let mut held = Vec::with_capacity(vals.len());
        let mut keys = Vec::with_capacity(vals.len());
        let mut sent = 0u64;
        for (i, key, v) in vals {
            let Some((lane, offset)) = store.lane_at(v.span.as_slice().as_ptr() as usize) else {
                // Not in a lane's memory (nothing puts it elsewhere today): not mappable.
                out[i] = miss;
                continue;
            };
            out[i].lane = lane;
            out[i].offset = offset;
            sent += v.span.len();
            keys.push(key.to_vec());
            held.push(v);
        }
        store.metrics.bytes_out.fetch_add(sent, Ordering::Relaxed);
        let verdict = shared
            .copier()
            .verify_later(held.iter().map(|v| v.value.clone()).collect());
        let pin = self.pins.hold(PinSet {
            keys,
            values: held,
            verdict,
        });
        self.reply(h, &proto::encode_get_mapped_reply(pin, &out))
    }
}
