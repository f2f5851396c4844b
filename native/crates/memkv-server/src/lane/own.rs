//! Each quota-bound tenant's values in a lane, in the order they were stored: where the tenant
//! finds a victim of its own when its quota is full (`Lane::evict_own`) without scanning every
//! other tenant's values in S3-FIFO's queues. A queue item goes stale when its key is
//! overwritten, deleted or evicted (its generation no longer matches); stale items are dropped
//! when met, and all of a tenant's once they outnumber its live values twice over.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::index::{Entry, Key};
use crate::tenants::TenantId;

#[derive(Default)]
struct Fifo {
    items: VecDeque<(Key, u64)>,
    /// The tenant's values in the lane's index.
    live: usize,
    /// What they are charged (arena footprint and index charge).
    bytes: u64,
}

#[derive(Default)]
pub(super) struct OwnQueues {
    by_tenant: HashMap<TenantId, Fifo>,
}

impl OwnQueues {
    /// Queues `tenant`'s new value under `key` (generation `gen`, charged `bytes`), now in
    /// `index`.
    pub(super) fn admit(
        &mut self,
        tenant: TenantId,
        key: &Key,
        gen: u64,
        bytes: u64,
        index: &HashMap<Key, Entry>,
    ) {
        let f = self.by_tenant.entry(tenant).or_default();
        f.items.push_back((key.clone(), gen));
        f.live += 1;
        f.bytes += bytes;
        if f.items.len() > 2 * f.live + 16 {
            f.items
                .retain(|(k, g)| index.get(k).is_some_and(|e| e.gen == *g));
        }
    }

    /// Accounts for one of `tenant`'s values, charged `bytes`, having left the index.
    pub(super) fn forget(&mut self, tenant: TenantId, bytes: u64) {
        if let Some(f) = self.by_tenant.get_mut(&tenant) {
            f.live -= 1;
            f.bytes -= bytes;
        }
    }

    /// Bytes `tenant`'s values here are charged.
    pub(super) fn bytes(&self, tenant: TenantId) -> u64 {
        self.by_tenant.get(&tenant).map_or(0, |f| f.bytes)
    }

    /// The tenant whose values here pass its `share` (in bytes) by the most; None when no
    /// tenant's do.
    pub(super) fn most_over(&self, share: impl Fn(TenantId) -> u64) -> Option<TenantId> {
        self.by_tenant
            .iter()
            .filter_map(|(&t, f)| {
                f.bytes
                    .checked_sub(share(t))
                    .filter(|&o| o > 0)
                    .map(|o| (o, t))
            })
            .max()
            .map(|(_, t)| t)
    }

    /// The key of `tenant`'s value to evict, which the caller removes: its oldest that is not
    /// pinned (leased, or being sent) and was not read since it was stored, else its oldest
    /// unpinned one. None when every value of it here is pinned. Values passed over go to the
    /// back of the queue, so each call looks at each item at most once.
    pub(super) fn victim(&mut self, tenant: TenantId, index: &HashMap<Key, Entry>) -> Option<Key> {
        let f = self.by_tenant.get_mut(&tenant)?;
        let mut read_since = None;
        for _ in 0..f.items.len() {
            let (key, gen) = f.items.pop_front()?;
            let Some(e) = index.get(&key).filter(|e| e.gen == gen) else {
                continue;
            };
            let pinned = e.lease_until.is_some() || Arc::strong_count(&e.value) > 1;
            if !pinned && e.freq == 0 {
                return Some(key);
            }
            if !pinned && read_since.is_none() {
                read_since = Some(key.clone());
            }
            f.items.push_back((key, gen));
        }
        read_since
    }
}
