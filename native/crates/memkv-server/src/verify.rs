//! Checksum verification off the connection thread, running ahead of the send.
//!
//! A GET reply's sender is the busier side of a TCP connection (on loopback it also runs the
//! receiver's protocol work), so hashing each chunk on the connection thread adds straight to the
//! transfer time (about a tenth at loopback speeds). Here pool threads check a reply's chunks in
//! send order while the connection thread sends the ones already checked; the rule stays the
//! same: no chunk is sent before its check passed. Chunks are handed over in windows of a few,
//! at most two windows ahead of the send: few hand-offs, and a checked chunk is still in cache
//! when it is sent. A pool thread never waits on a connection, so a slow client stalls no one.

use std::collections::VecDeque;
use std::sync::Arc;

use crossbeam_channel::{unbounded, Receiver, Sender};

use crate::lane::Value;

/// Chunks per hand-off to the pool (1 MiB): with at most two windows ahead, 4 concurrent replies
/// keep 8 MiB of checked chunks in L3 (in alternating runs, 4 MiB windows gave GETs at 2-4 threads
/// about 4 points less of the TCP ceiling).
const WINDOW: usize = 4;

/// The chunks to check, in the order they will be sent.
type Items = Arc<Vec<(Arc<Value>, usize)>>;

struct Job {
    items: Items,
    range: std::ops::Range<usize>,
    done: Sender<bool>,
}

pub struct Verifier {
    jobs: Sender<Job>,
}

/// The answers for one reply, taken in order right before each chunk is sent.
pub struct Checks {
    items: Items,
    jobs: Sender<Job>,
    next: usize,
    submitted: usize,
    /// One receiver per window handed over and not yet used up, oldest first.
    windows: VecDeque<Receiver<bool>>,
}

impl Checks {
    /// Whether the next chunk in send order matches its checksum. Where the pool gives no
    /// answer (it lost the job), the check runs here.
    pub fn next_ok(&mut self) -> bool {
        let i = self.next;
        if i >= self.items.len() {
            return false;
        }
        self.next += 1;
        if i > 0 && i.is_multiple_of(WINDOW) {
            self.windows.pop_front();
        }
        // Keep the window holding `i` and the one after it with the pool.
        while self.submitted < self.items.len().min((i / WINDOW + 2) * WINDOW) {
            self.submit();
        }
        match self.windows.front().map(|w| w.recv()) {
            Some(Ok(ok)) => ok,
            _ => {
                let (v, c) = &self.items[i];
                v.chunk_ok(*c)
            }
        }
    }

    fn submit(&mut self) {
        let end = self.items.len().min(self.submitted + WINDOW);
        let (done, rx) = unbounded();
        // If the pool is gone the job comes back dropped and `next_ok` checks inline.
        let _ = self.jobs.send(Job {
            items: self.items.clone(),
            range: self.submitted..end,
            done,
        });
        self.windows.push_back(rx);
        self.submitted = end;
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
                        for (v, c) in &j.items[j.range] {
                            let ok = v.chunk_ok(*c);
                            // Stop at a mismatch (the reply is aborted) or once nobody listens.
                            if j.done.send(ok).is_err() || !ok {
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
        Checks {
            items: Arc::new(items),
            jobs: self.jobs.clone(),
            next: 0,
            submitted: 0,
            windows: VecDeque::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    fn stored(s: &Store, len: usize) -> Arc<Value> {
        let mut r = s.reserve(b"k", len as u64).unwrap();
        r.span.as_mut_slice().fill(9);
        let sums = memkv_proto::chunk_checksums(r.span.as_slice());
        s.commit(b"k", r, sums);
        s.fetch_verified(b"k").ok().unwrap()
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
