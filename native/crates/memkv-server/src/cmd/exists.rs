//! EXISTS: per-key status and length; with `lease_ms` > 0 each hit is leased (see `lane`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn exists(&mut self, h: &Header, body: &[u8], deadline: Instant) -> Result<(), End> {
        let _share = self.key_share(body, 4, deadline)?;
        let (lease_ms, keys) = proto::decode_exists(body)?;
        let store = &*self.ctx.store;
        let st = store.exists(&keys, Duration::from_millis(lease_ms as u64));
        // Counted here and added once: an atomic add per key on counters every connection
        // shares cost more than the lookup.
        let (mut granted, mut denied) = (0u64, 0u64);
        for (s, _) in &st {
            match s {
                Status::Ok => granted += 1,
                Status::OkNoLease => denied += 1,
                _ => {}
            }
        }
        let m = &store.metrics;
        m.exists_hits.fetch_add(granted + denied, Ordering::Relaxed);
        m.exists_misses
            .fetch_add(st.len() as u64 - granted - denied, Ordering::Relaxed);
        if lease_ms > 0 {
            m.leases_granted.fetch_add(granted, Ordering::Relaxed);
            m.leases_denied.fetch_add(denied, Ordering::Relaxed);
        }
        self.reply(h, &proto::encode_status_lens(&st))
    }
}
