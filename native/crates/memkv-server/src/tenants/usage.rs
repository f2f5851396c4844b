//! Each tenant's memory against its quota, and its counters. Memory is charged as the lanes
//! charge it (a value's arena footprint plus its index charge) from the moment it is reserved
//! until it leaves the index (overwritten, deleted, evicted); the lanes do the charging
//! (`Lane::reserve_as`, `Inner::remove`), under their locks, so that a tenant's values in every
//! lane together never pass its quota, however many of its PUTs run at once.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::TenantId;

/// One tenant's quota and counters.
#[derive(Default)]
pub struct Slot {
    pub quota: u64,
    /// Bytes charged now (values being received included).
    pub used: AtomicU64,
    pub items: AtomicU64,
    /// Its values evicted, for any reason.
    pub evictions: AtomicU64,
    /// Its values evicted to make room under its own quota.
    pub quota_evictions: AtomicU64,
    pub puts: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub exists_hits: AtomicU64,
    pub exists_misses: AtomicU64,
    /// Keys answered FORBIDDEN (outside its prefix, or a write by a read-only tenant).
    pub forbidden: AtomicU64,
    /// PUT keys answered OVER_QUOTA.
    pub over_quota: AtomicU64,
}

/// The slots of every tenant, by id.
pub struct Usage {
    slots: Vec<Slot>,
    /// The quotas of all tenants that have one, added up.
    quotas: u64,
}

impl Usage {
    /// One slot per quota, in tenant order.
    pub fn new(quotas: impl IntoIterator<Item = u64>) -> Usage {
        let slots: Vec<Slot> = quotas
            .into_iter()
            .map(|quota| Slot {
                quota,
                ..Slot::default()
            })
            .collect();
        let quotas = slots
            .iter()
            .filter(|s| s.quota != u64::MAX)
            .fold(0u64, |n, s| n.saturating_add(s.quota));
        Usage { slots, quotas }
    }

    /// The implicit tenant alone, without a quota.
    pub fn unbounded() -> Usage {
        Usage::new([u64::MAX])
    }

    /// Whether `t` has a quota (the implicit tenant has none).
    pub fn bounded(&self, t: TenantId) -> bool {
        self.slot(t).quota != u64::MAX
    }

    /// `t`'s part of any memory the tenants share: its quota over all the quotas (0 without a
    /// quota). When the quotas add up to more than the memory, a full lane gives each tenant
    /// this share of it before its writes take only its own values (`Lane::reserve_as`).
    pub fn share(&self, t: TenantId) -> f64 {
        if !self.bounded(t) || self.quotas == 0 {
            return 0.0;
        }
        self.slot(t).quota as f64 / self.quotas as f64
    }

    pub fn slot(&self, t: TenantId) -> &Slot {
        &self.slots[t as usize]
    }

    /// Charges `bytes` to `t` if they fit its quota; false (nothing charged) if not.
    pub fn try_charge(&self, t: TenantId, bytes: u64) -> bool {
        let s = self.slot(t);
        s.used
            .fetch_update(Relaxed, Relaxed, |u| {
                u.checked_add(bytes).filter(|&n| n <= s.quota)
            })
            .is_ok()
    }

    /// Gives back bytes `try_charge` took.
    pub fn release(&self, t: TenantId, bytes: u64) {
        self.slot(t).used.fetch_sub(bytes, Relaxed);
    }

    /// Adds `n` to one of `t`'s counters (`pick` names it).
    pub fn add(&self, t: TenantId, n: u64, pick: impl Fn(&Slot) -> &AtomicU64) {
        if n > 0 {
            pick(self.slot(t)).fetch_add(n, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_fits_the_quota_or_takes_nothing() {
        let u = Usage::new([100, 10]);
        assert!(u.try_charge(0, 60));
        assert!(!u.try_charge(0, 41), "60 + 41 > 100");
        assert!(u.try_charge(0, 40));
        assert_eq!(u.slot(0).used.load(Relaxed), 100);
        assert!(!u.try_charge(0, 1));
        assert!(u.try_charge(1, 10), "one tenant's use is not another's");
        u.release(0, 60);
        assert!(u.try_charge(0, 50));
        assert_eq!(u.slot(0).used.load(Relaxed), 90);
        assert!(Usage::unbounded().try_charge(0, u64::MAX));
    }

    #[test]
    fn a_share_is_the_quota_over_all_quotas() {
        let u = Usage::new([30, 10]);
        assert_eq!((u.share(0), u.share(1)), (0.75, 0.25));
        assert_eq!(Usage::unbounded().share(0), 0.0);
    }

    #[test]
    fn concurrent_charges_never_pass_the_quota() {
        let u = Usage::new([1000]);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if u.try_charge(0, 7) {
                            assert!(u.slot(0).used.load(Relaxed) <= 1000);
                            u.release(0, 7);
                        }
                    }
                });
            }
        });
        assert_eq!(u.slot(0).used.load(Relaxed), 0);
    }
}
