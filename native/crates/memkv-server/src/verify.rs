//! Checksum verification off the connection thread, running ahead of the send.
//!
//! A GET reply's sender is the busier side of a TCP connection (on loopback it also runs the
//! receiver's protocol work), so hashing each chunk on the connection thread adds straight to the
//! transfer time (about a tenth at loopback speeds). Here pool threads check a reply's chunks in
//! send order while the connection thread sends the ones already checked; the rule stays the
//! same: no chunk is sent before its check passed. Chunks are handed over in windows of a few,
//! at most two windows ahead of the send: few hand-offs, and a checked chunk is still in cache
//! when it is sent. A pool thread never waits on a connection, so a slow client stalls no one.
//!
//! Each chunk is checked once, by whoever claims it first: when the connection thread needs a
//! chunk the pool has not started (its threads not yet woken, or busy with other replies), it
//! checks that chunk itself instead of idling the connection for a wake-up.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Sender};

use crate::lane::Value;

/// Chunks per hand-off to the pool (1 MiB): with at most two windows ahead, 4 concurrent replies
/// keep 8 MiB of checked chunks in L3 (in alternating runs, 4 MiB windows gave GETs at 2-4 threads
/// about 4 points less of the TCP ceiling).
const WINDOW: usize = 4;

/// A chunk's check, as claimed and answered by the pool or the connection thread.
const UNCLAIMED: u8 = 0;
const CLAIMED: u8 = 1;
const MATCHED: u8 = 2;
const MISMATCHED: u8 = 3;

/// How long the sender spins for a chunk a pool thread is hashing (one chunk takes ~5 us) before
/// it sleeps: spinning longer would hold a core the (possibly preempted) pool thread needs.
const SPIN: Duration = Duration::from_micros(20);

/// One reply's chunks in send order, each with the state of its check.
struct Reply {
    items: Vec<(Arc<Value>, usize)>,
    state: Vec<AtomicU8>,
    /// Set when the reply ends (sent or aborted): the pool skips what is left.
    ended: AtomicBool,
    /// The sender sleeps here for a chunk a pool thread is checking; `sleeping` tells the pool
    /// to wake it (and costs the pool nothing otherwise).
    sleeping: AtomicBool,
    lock: Mutex<()>,
    answered: Condvar,
}

impl Reply {
    /// Checks chunk `i` if nobody has claimed it; Some(matched) when this call checked it.
    fn try_check(&self, i: usize) -> Option<bool> {
        self.state[i]
            .compare_exchange(UNCLAIMED, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let (v, c) = &self.items[i];
        let ok = v.chunk_ok(*c);
        // SeqCst pairs this store and the load of `sleeping` with the sender's store of
        // `sleeping` and load of the state: at least one side sees the other's write.
        self.state[i].store(if ok { MATCHED } else { MISMATCHED }, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            let _g = self.lock.lock().unwrap();
            self.answered.notify_all();
        }
        Some(ok)
    }

    /// The answer for chunk `i` if it has one.
    fn answer(&self, i: usize) -> Option<bool> {
        match self.state[i].load(Ordering::SeqCst) {
            MATCHED => Some(true),
            MISMATCHED => Some(false),
            _ => None,
        }
    }

    /// Waits for the answer for chunk `i`, which a pool thread is checking.
    fn wait(&self, i: usize) -> bool {
        let spin_until = Instant::now() + SPIN;
        while Instant::now() < spin_until {
            if let Some(ok) = self.answer(i) {
                return ok;
            }
            std::hint::spin_loop();
        }
        let mut g = self.lock.lock().unwrap();
        self.sleeping.store(true, Ordering::SeqCst);
        loop {
            if let Some(ok) = self.answer(i) {
                self.sleeping.store(false, Ordering::Relaxed);
                return ok;
            }
            g = self.answered.wait(g).unwrap();
        }
    }
}

struct Job {
    reply: Arc<Reply>,
    range: std::ops::Range<usize>,
}

pub struct Verifier {
    jobs: Sender<Job>,
}

/// The answers for one reply, taken in order right before each chunk is sent.
pub struct Checks {
    reply: Arc<Reply>,
    jobs: Sender<Job>,
    next: usize,
    submitted: usize,
}

impl Drop for Checks {
    fn drop(&mut self) {
        self.reply.ended.store(true, Ordering::Relaxed);
    }
}

impl Checks {
    /// Whether the next chunk in send order matches its checksum: the pool's answer, or this
    /// thread's own check when the pool has not started the chunk (or lost the job).
    pub fn next_ok(&mut self) -> bool {
        let i = self.next;
        let r = &*self.reply;
        if i >= r.items.len() {
            return false;
        }
        self.next += 1;
        // Keep the window holding `i` and the one after it with the pool.
        while self.submitted < r.items.len().min((i / WINDOW + 2) * WINDOW) {
            let end = r.items.len().min(self.submitted + WINDOW);
            // If the pool is gone the job comes back dropped and the chunks are checked here.
            let _ = self.jobs.send(Job {
                reply: self.reply.clone(),
                range: self.submitted..end,
            });
            self.submitted = end;
        }
        r.answer(i)
            .or_else(|| r.try_check(i))
            .unwrap_or_else(|| r.wait(i))
    }
}

impl Verifier {
    pub fn new(threads: usize) -> std::io::Result<Verifier> {
        let (jobs, rx) = unbounded::<Job>();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("memkv-verify-{i}"))
                .spawn(move || {
                    while let Ok(j) = rx.recv() {
                        for i in j.range {
                            // Stop at a mismatch (the reply is aborted) or once the reply ended.
                            if j.reply.ended.load(Ordering::Relaxed)
                                || j.reply.try_check(i) == Some(false)
                            {
                                break;
                            }
                        }
                    }
                })?;
        }
        Ok(Verifier { jobs })
    }

    /// Starts checking `items` (value, chunk index) in send order.
    pub fn check(&self, items: Vec<(Arc<Value>, usize)>) -> Checks {
        let state = items.iter().map(|_| AtomicU8::new(UNCLAIMED)).collect();
        Checks {
            reply: Arc::new(Reply {
                items,
                state,
                ended: AtomicBool::new(false),
                sleeping: AtomicBool::new(false),
                lock: Mutex::new(()),
                answered: Condvar::new(),
            }),
            jobs: self.jobs.clone(),
            next: 0,
            submitted: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    fn stored(s: &Store, len: usize) -> Arc<Value> {
        let mut r = s.reserve(b"k", len as u64).ok().unwrap();
        r.bytes_mut().fill(9);
        let sums = memkv_proto::chunk_checksums(r.bytes_mut());
        s.commit(b"k", r, sums);
        s.fetch_verified(b"k").ok().unwrap().value.clone()
    }

    const C: usize = memkv_proto::CHECKSUM_CHUNK;

    #[test]
    fn pool_checks_chunks_in_order_and_catches_corruption() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 3 * C);
        let pool = Verifier::new(2).unwrap();
        let mut c = pool.check(vec![(v.clone(), 1), (v.clone(), 2)]);
        assert!(c.next_ok() && c.next_ok());
        assert!(!c.next_ok(), "nothing was asked past the last item");
        v.span.corrupt_for_test(2 * C + 1);
        let mut c = pool.check(vec![(v.clone(), 1), (v.clone(), 2)]);
        assert!(c.next_ok());
        assert!(!c.next_ok());
    }

    #[test]
    fn answers_stay_in_order_across_windows() {
        let s = Store::new(64 << 20, 1, 0.5).unwrap();
        let n = 3 * WINDOW + 2;
        let v = stored(&s, (n + 1) * C);
        v.span.corrupt_for_test((2 * WINDOW + 1) * C + 5);
        let pool = Verifier::new(3).unwrap();
        let mut c = pool.check((1..=n).map(|i| (v.clone(), i)).collect());
        let got: Vec<bool> = (1..=n).map(|_| c.next_ok()).collect();
        let want: Vec<bool> = (1..=n).map(|i| i != 2 * WINDOW + 1).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn chunks_the_pool_has_not_started_are_checked_by_the_sender() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 3 * C);
        v.span.corrupt_for_test(2 * C + 7);
        // A pool whose threads never take a job: every chunk stays unclaimed.
        let (jobs, stalled) = unbounded();
        let idle = Verifier { jobs };
        let mut c = idle.check(vec![(v.clone(), 1), (v.clone(), 2)]);
        assert!(c.next_ok());
        assert!(!c.next_ok(), "the corrupt chunk is caught without the pool");
        let job = stalled
            .try_recv()
            .expect("the chunks were still handed to the pool");
        assert!(
            job.range.clone().all(|i| job.reply.try_check(i).is_none()),
            "a chunk checked by the sender is not checked again"
        );
    }

    #[test]
    fn the_sender_sleeps_until_the_pool_thread_checking_its_chunk_answers() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 2 * C);
        let (jobs, _stalled) = unbounded();
        let mut c = Verifier { jobs }.check(vec![(v.clone(), 1)]);
        let r = c.reply.clone();
        // Stand in for a pool thread that claimed the chunk and was preempted for 50 ms.
        r.state[0].store(CLAIMED, Ordering::SeqCst);
        let pool = {
            let r = r.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                r.state[0].store(UNCLAIMED, Ordering::SeqCst);
                r.try_check(0)
            })
        };
        let t = Instant::now();
        assert!(c.next_ok());
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "answered before the check ran"
        );
        assert_eq!(
            pool.join().unwrap(),
            Some(true),
            "the chunk was checked once, by the pool"
        );
    }

    #[test]
    fn without_a_pool_the_checks_run_inline() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 2 * C);
        let (jobs, rx) = unbounded();
        drop(rx);
        let gone = Verifier { jobs };
        assert!(gone.check(vec![(v.clone(), 1)]).next_ok());
        v.span.corrupt_for_test(C + 3);
        assert!(!gone.check(vec![(v.clone(), 1)]).next_ok());
    }
}
