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
        let m = &store.metrics;
        let lease = Duration::from_millis(lease_ms as u64);
        let st: Vec<(Status, u64)> = keys.iter().map(|k| store.exists(k, lease)).collect();
        for (s, _) in &st {
            let (hit, lease_ctr) = match s {
                Status::Ok => (&m.exists_hits, Some(&m.leases_granted)),
                Status::OkNoLease => (&m.exists_hits, Some(&m.leases_denied)),
                _ => (&m.exists_misses, None),
            };
            hit.fetch_add(1, Ordering::Relaxed);
            if let (Some(c), true) = (lease_ctr, lease_ms > 0) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.reply(h, &proto::encode_status_lens(&st))
    }
}
