//! EXISTS: per-key status and length; with `lease_ms` > 0 each hit is leased (see `lane`). A
//! key outside the tenant's prefix answers FORBIDDEN without a lookup, so neither the answer nor
//! its timing says whether another tenant stored it, and it is never leased.

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
        let lease = Duration::from_millis(lease_ms as u64);
        let named: Vec<bool> = keys.iter().map(|k| self.may_name(k)).collect();
        let forbidden = named.iter().filter(|n| !**n).count() as u64;
        let st = if forbidden == 0 {
            store.exists(&keys, lease)
        } else {
            let asked: Vec<&[u8]> = (keys.iter().zip(&named))
                .filter_map(|(k, n)| n.then_some(*k))
                .collect();
            let mut found = store.exists(&asked, lease).into_iter();
            (named.iter())
                .map(|n| match n {
                    true => found.next().expect("one answer per key asked"),
                    false => (Status::Forbidden, 0),
                })
                .collect()
        };
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
        let misses = st.len() as u64 - granted - denied - forbidden;
        m.exists_hits.fetch_add(granted + denied, Ordering::Relaxed);
        m.exists_misses.fetch_add(misses, Ordering::Relaxed);
        let usage = &store.usage;
        usage.add(self.tenant_id(), granted + denied, |c| &c.exists_hits);
        usage.add(self.tenant_id(), misses, |c| &c.exists_misses);
        if lease_ms > 0 {
            m.leases_granted.fetch_add(granted, Ordering::Relaxed);
            m.leases_denied.fetch_add(denied, Ordering::Relaxed);
        }
        self.reply(h, &proto::encode_status_lens(&st))
    }
}
