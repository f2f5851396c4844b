//! The server's resource bounds outside the store: connection slots (RAII permits, with
//! unauthenticated connections the first to give way), a global byte budget for request and reply
//! buffers, and a rate limit on the warnings a peer can trigger.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// Closes a connection from another thread (its blocked read then ends).
pub type Closer = Box<dyn Fn() + Send>;

struct Pending {
    id: u64,
    /// Sent a well-formed HELLO: a client on its way through the handshake.
    greeted: bool,
    close: Closer,
    evicted: Arc<AtomicBool>,
}

struct Slots {
    open: usize,
    /// Connections evicted but not yet ended: they no longer count against the limit.
    doomed: usize,
    /// Unauthenticated connections, oldest first.
    pending: VecDeque<Pending>,
    next_id: u64,
}

/// Connection slots. Every open connection holds a `Permit`; dropping it frees the slot. When
/// all slots are taken, a new connection takes the slot of the oldest connection that has not
/// authenticated yet (that one is closed), so peers without the key cannot lock out a client
/// that has it. Connections that have not even sent HELLO go first, so a client between its
/// HELLO and its AUTH survives a flood of silent or garbage connections. A new connection is
/// refused only when every slot is authenticated.
pub struct ConnLimits {
    max: usize,
    slots: Mutex<Slots>,
    changed: Condvar,
    metrics: Arc<Metrics>,
}

/// One connection's slot; freed on drop.
pub struct Permit {
    limits: Arc<ConnLimits>,
    id: u64,
    evicted: Arc<AtomicBool>,
}

impl ConnLimits {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Arc<ConnLimits> {
        Arc::new(ConnLimits {
            max: max.max(1),
            slots: Mutex::new(Slots {
                open: 0,
                doomed: 0,
                pending: VecDeque::new(),
                next_id: 0,
            }),
            changed: Condvar::new(),
            metrics,
        })
    }

    /// A slot for a new, unauthenticated connection that `close` can close, or None when every
    /// slot belongs to an authenticated connection.
    pub fn admit(self: &Arc<Self>, close: Closer) -> Option<Permit> {
        let mut s = self.slots.lock().unwrap();
        if s.open - s.doomed >= self.max {
            let at = s.pending.iter().position(|p| !p.greeted).unwrap_or(0);
            let oldest = s.pending.remove(at)?;
            oldest.evicted.store(true, Ordering::Relaxed);
            (oldest.close)();
            s.doomed += 1;
            self.metrics.error("evicted_unauthenticated");
        }
        // An evicted connection keeps its socket and thread until its thread sees the close,
        // normally at once. Waiting for that here (the kernel queues new connections meanwhile)
        // keeps descriptors and threads within the limit under a flood, instead of letting
        // evicted connections pile up faster than their threads end and run the process out of
        // descriptors, which refuses clients with the key.
        let until = Instant::now() + EVICTED_EXIT_WAIT;
        while s.open >= self.max && s.doomed > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
        s.open += 1;
        let id = s.next_id;
        s.next_id += 1;
        let evicted = Arc::new(AtomicBool::new(false));
        s.pending.push_back(Pending {
            id,
            greeted: false,
            close,
            evicted: evicted.clone(),
        });
        self.metrics
            .connections
            .store(s.open as u64, Ordering::Relaxed);
        Some(Permit {
            limits: self.clone(),
            id,
            evicted,
        })
    }

    /// Waits until no connection is open or `timeout` passed; returns how many are still open.
    pub fn wait_all_closed(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut s = self.slots.lock().unwrap();
        while s.open > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
        s.open
    }
}

impl Permit {
    /// The connection sent a well-formed HELLO: it gives way only after silent ones.
    pub fn greeted(&self) {
        let mut s = self.limits.slots.lock().unwrap();
        if let Some(p) = s.pending.iter_mut().find(|p| p.id == self.id) {
            p.greeted = true;
        }
    }

    /// The connection proved it holds the key (or none is needed): it can no longer be evicted.
    pub fn authenticated(&self) {
        let mut s = self.limits.slots.lock().unwrap();
        s.pending.retain(|p| p.id != self.id);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut s = self.limits.slots.lock().unwrap();
        s.open -= 1;
        if self.evicted.load(Ordering::Relaxed) {
            s.doomed -= 1;
        } else {
            s.pending.retain(|p| p.id != self.id);
        }
        self.limits
            .metrics
            .connections
            .store(s.open as u64, Ordering::Relaxed);
        self.limits.changed.notify_all();
    }
}

/// Longest a new connection waits for the connections evicted for it to end.
const EVICTED_EXIT_WAIT: Duration = Duration::from_millis(200);

/// Descriptors a connection holds: its socket, and the duplicate that closes it from another
/// thread (`Transport::closer`).
const FDS_PER_CONNECTION: u64 = 2;

/// Descriptors an RDMA endpoint may hold in its libfabric provider (completion queue, address
/// vector, wait objects, the tcp provider's sockets), counted for each `--max-rdma-connections`.
const FDS_PER_RDMA_ENDPOINT: u64 = 16;

/// Descriptors left for everything but connections: listeners, metrics connections, the arena,
/// logs, the verifier pool, libfabric's own.
const FDS_SPARE: u64 = 64;

/// Descriptors `connections` need when up to `rdma_endpoints` of them hold an RDMA endpoint.
fn fds_needed(connections: u64, rdma_endpoints: u64) -> u64 {
    connections
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(connections.min(rdma_endpoints) * FDS_PER_RDMA_ENDPOINT)
        .saturating_add(FDS_SPARE)
}

/// The most connections (at most `wanted`) whose descriptors fit in `limit` open files.
fn connections_fitting(wanted: u64, rdma_endpoints: u64, limit: u64) -> u64 {
    let room = limit.saturating_sub(FDS_SPARE);
    let with_rdma = FDS_PER_CONNECTION + FDS_PER_RDMA_ENDPOINT;
    let fit = if room >= rdma_endpoints.saturating_mul(with_rdma) {
        rdma_endpoints + (room - rdma_endpoints * with_rdma) / FDS_PER_CONNECTION
    } else {
        // Fewer connections than RDMA endpoints fit: any of them may hold one.
        room / with_rdma
    };
    fit.clamp(1, wanted.max(1))
}

/// The connections of `wanted` whose descriptors fit under the process's limit on open files
/// next to up to `rdma_endpoints` RDMA endpoints (each one a connection's) and `FDS_SPARE`.
/// The soft limit is raised toward the hard one first when it is too low: a server that runs
/// out of descriptors cannot accept the connection that would close the oldest
/// unauthenticated one, so silent peers would lock out clients with the key. Where even the
/// hard limit is too low the server serves fewer connections and says so, naming the flag and
/// the limit.
pub fn fit_fd_limit(wanted: usize, rdma_endpoints: u64) -> usize {
    let need = fds_needed(wanted as u64, rdma_endpoints);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return wanted;
    }
    if lim.rlim_cur < need && lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: need.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    if lim.rlim_cur >= need {
        return wanted;
    }
    let fit = connections_fitting(wanted as u64, rdma_endpoints, lim.rlim_cur) as usize;
    tracing::warn!(
        max_connections = wanted,
        open_files_limit = lim.rlim_cur,
        descriptors_needed = need,
        serving_connections = fit,
        "--max-connections does not fit the open files limit (RLIMIT_NOFILE); raise it \
         (ulimit -n, systemd LimitNOFILE=) to serve more connections"
    );
    fit
}

/// A global bound on the bytes of request bodies and reply tables held at once, over all
/// connections: a connection waits for its share before it allocates a buffer.
pub struct ByteBudget {
    total: u64,
    free: Mutex<u64>,
    returned: Condvar,
}

/// Bytes taken from a `ByteBudget`; given back on drop.
pub struct BudgetShare<'a> {
    budget: &'a ByteBudget,
    bytes: u64,
}

impl ByteBudget {
    pub fn new(total: u64) -> ByteBudget {
        ByteBudget {
            total,
            free: Mutex::new(total),
            returned: Condvar::new(),
        }
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Takes `bytes`, waiting for other connections to give some back until `deadline`. None
    /// when the deadline passed first or `bytes` exceeds the whole budget.
    pub fn take(&self, bytes: u64, deadline: Instant) -> Option<BudgetShare<'_>> {
        if bytes > self.total {
            return None;
        }
        let mut free = self.free.lock().unwrap();
        while *free < bytes {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            free = self.returned.wait_timeout(free, left).unwrap().0;
        }
        *free -= bytes;
        Some(BudgetShare {
            budget: self,
            bytes,
        })
    }

    pub fn in_use(&self) -> u64 {
        self.total - *self.free.lock().unwrap()
    }
}

impl Drop for BudgetShare<'_> {
    fn drop(&mut self) {
        *self.budget.free.lock().unwrap() += self.bytes;
        self.budget.returned.notify_all();
    }
}

/// Lets through at most `per_window` warnings per window; the rest are counted and reported with
/// the next warning let through, so a peer sending bad frames cannot flood the log.
pub struct WarnLimiter {
    window: Duration,
    per_window: u64,
    start: Mutex<Instant>,
    in_window: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnLimiter {
    pub fn new(per_window: u64, window: Duration) -> WarnLimiter {
        WarnLimiter {
            window,
            per_window,
            start: Mutex::new(Instant::now()),
            in_window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Some(number of warnings suppressed since the last one let through) when this one may be
    /// logged, None when it must be dropped.
    pub fn allow(&self) -> Option<u64> {
        {
            let mut start = self.start.lock().unwrap();
            if start.elapsed() >= self.window {
                *start = Instant::now();
                self.in_window.store(0, Ordering::Relaxed);
            }
        }
        if self.in_window.fetch_add(1, Ordering::Relaxed) < self.per_window {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closer(flag: &Arc<AtomicBool>) -> Closer {
        let f = flag.clone();
        Box::new(move || f.store(true, Ordering::Relaxed))
    }

    #[test]
    fn unauthenticated_connections_give_way_and_authenticated_ones_never_do() {
        let lim = ConnLimits::new(2, Arc::new(Metrics::default()));
        let closed: Vec<Arc<AtomicBool>> = (0..4).map(|_| Arc::default()).collect();
        let a = lim.admit(closer(&closed[0])).unwrap();
        a.authenticated();
        let b = lim.admit(closer(&closed[1])).unwrap();
        // Full: the third takes the slot of the unauthenticated second.
        let c = lim.admit(closer(&closed[2])).unwrap();
        assert!(closed[1].load(Ordering::Relaxed) && !closed[0].load(Ordering::Relaxed));
        c.authenticated();
        // Every counted slot is authenticated now: refused, and nobody is closed.
        assert!(lim.admit(closer(&closed[3])).is_none());
        assert!(!closed[0].load(Ordering::Relaxed) && !closed[2].load(Ordering::Relaxed));
        drop(b);
        assert_eq!(lim.wait_all_closed(Duration::ZERO), 2);
        drop(a);
        let d = lim.admit(closer(&closed[3])).unwrap();
        drop((c, d));
        assert_eq!(lim.wait_all_closed(Duration::from_secs(1)), 0);
    }

    #[test]
    fn connections_that_sent_hello_outlast_silent_ones() {
        let lim = ConnLimits::new(2, Arc::new(Metrics::default()));
        let closed: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::default()).collect();
        let client = lim.admit(closer(&closed[0])).unwrap();
        client.greeted();
        let silent = lim.admit(closer(&closed[1])).unwrap();
        let next = lim.admit(closer(&closed[2])).unwrap();
        assert!(closed[1].load(Ordering::Relaxed), "the silent one gave way");
        assert!(
            !closed[0].load(Ordering::Relaxed),
            "the older client mid-handshake stays"
        );
        drop((client, silent, next));
    }

    #[test]
    fn budget_waits_for_shares_to_come_back_and_gives_up_at_the_deadline() {
        let b = ByteBudget::new(100);
        let s = b.take(80, Instant::now()).unwrap();
        assert!(b
            .take(30, Instant::now() + Duration::from_millis(20))
            .is_none());
        assert!(b
            .take(101, Instant::now() + Duration::from_secs(9))
            .is_none());
        std::thread::scope(|sc| {
            let waiter = sc.spawn(|| {
                b.take(30, Instant::now() + Duration::from_secs(30))
                    .is_some()
            });
            std::thread::sleep(Duration::from_millis(20));
            drop(s);
            assert!(waiter.join().unwrap());
        });
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn warnings_are_limited_per_window_and_the_dropped_ones_counted() {
        let w = WarnLimiter::new(2, Duration::from_millis(50));
        assert_eq!(w.allow(), Some(0));
        assert_eq!(w.allow(), Some(0));
        assert_eq!(w.allow(), None);
        assert_eq!(w.allow(), None);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(w.allow(), Some(2));
    }

    #[test]
    fn rdma_endpoints_count_only_against_connections_that_can_hold_them() {
        // 1,024 connections, 256 of them RDMA: 2 * 1024 + 16 * 256 + 64.
        assert_eq!(fds_needed(1024, 256), 6208);
        // Fewer connections than endpoints: each may hold one.
        assert_eq!(fds_needed(8, 256), 8 * 18 + 64);
        // A 4,096 hard limit still serves hundreds of connections, each of which may be RDMA
        // (subtracting all 256 endpoints' descriptors first left one connection).
        assert_eq!(connections_fitting(1024, 256, 4096), (4096 - 64) / 18);
        // Room for every endpoint: the rest of the limit goes to plain connections.
        assert_eq!(
            connections_fitting(1024, 16, 2048),
            16 + (2048 - 64 - 16 * 18) / 2
        );
        assert_eq!(connections_fitting(1024, 0, 1024), (1024 - 64) / 2);
        assert_eq!(connections_fitting(10, 0, 1 << 20), 10);
        assert_eq!(connections_fitting(1024, 0, 10), 1);
        for (wanted, endpoints, limit) in [(1024, 256, 4096), (1024, 16, 2048), (500, 0, 700)] {
            let n = connections_fitting(wanted, endpoints, limit);
            assert!(
                fds_needed(n, endpoints) <= limit,
                "{wanted} {endpoints} {limit}"
            );
        }
    }
}
