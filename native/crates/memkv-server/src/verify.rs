//! Checksum verification off the connection thread, running ahead of the send.
//!
//! A GET reply's sender is the busier side of a TCP connection (on loopback it also runs the
//! receiver's protocol work), so hashing each chunk on the connection thread adds straight to the
//! transfer time (about a tenth at loopback speeds). Here one pool thread checks a reply's chunks
//! in send order while the connection thread sends the ones already checked; the rule stays the
//! same: no chunk is sent before its check passed. One job per reply keeps the hand-offs (and
//! their wake-ups) to one per GET, not one per chunk.

use std::sync::Arc;

use crossbeam_channel::{unbounded, Receiver, Sender};

use crate::lane::Value;

/// The chunks to check, in the order they will be sent.
type Items = Arc<Vec<(Arc<Value>, usize)>>;

struct Job {
    items: Items,
    done: Sender<bool>,
}

pub struct Verifier {
    jobs: Sender<Job>,
}

/// The answers to one `Verifier::check`, taken in order right before each chunk is sent.
pub struct Checks {
    items: Items,
    next: usize,
    done: Receiver<bool>,
}

impl Checks {
    /// Whether the next chunk in send order matches its checksum. Once the pool stops answering
    /// (it lost the job, or never had one), the checks run here.
    pub fn next_ok(&mut self) -> bool {
        let Some((v, i)) = self.items.get(self.next) else {
            return false;
        };
        self.next += 1;
        self.done.recv().unwrap_or_else(|_| v.chunk_ok(*i))
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
                        for (v, i) in j.items.iter() {
                            let ok = v.chunk_ok(*i);
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

    /// Starts checking `items` (value, chunk index) in order on a pool thread.
    pub fn check(&self, items: Vec<(Arc<Value>, usize)>) -> Checks {
        let items = Arc::new(items);
        let (done, rx) = unbounded();
        // If the pool is gone the job comes back dropped and `Checks::next_ok` checks inline.
        let _ = self.jobs.send(Job {
            items: items.clone(),
            done,
        });
        Checks {
            items,
            next: 0,
            done: rx,
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
