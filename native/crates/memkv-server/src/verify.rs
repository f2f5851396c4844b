//! Checksum verification off the connection thread, one chunk ahead of the send.
//!
//! A GET reply's sender is the busier side of a TCP connection (on loopback it also runs the
//! receiver's protocol work), so hashing each chunk on the connection thread adds straight to the
//! transfer time (about a tenth at loopback speeds). Here a pool thread checks chunk i+1 while
//! the connection thread sends chunk i; the rule stays the same: no chunk is sent before its
//! check passed.

use std::sync::Arc;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::lane::Value;

struct Job {
    value: Arc<Value>,
    chunk: usize,
    done: Sender<bool>,
}

pub struct Verifier {
    jobs: Sender<Job>,
}

/// The answer to one `Verifier::check`, waited for right before the chunk is sent.
pub struct Pending {
    value: Arc<Value>,
    chunk: usize,
    done: Receiver<bool>,
}

impl Pending {
    /// Whether the chunk matches its checksum. If the pool lost the job, the check runs here.
    pub fn ok(self) -> bool {
        self.done
            .recv()
            .unwrap_or_else(|_| self.value.chunk_ok(self.chunk))
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
                        let _ = j.done.send(j.value.chunk_ok(j.chunk));
                    }
                })?;
        }
        Ok(Verifier { jobs })
    }

    /// Starts checking chunk `chunk` of `value` on a pool thread.
    pub fn check(&self, value: &Arc<Value>, chunk: usize) -> Pending {
        let (done, rx) = bounded(1);
        // If the pool is gone the job comes back dropped and `Pending::ok` checks inline.
        let _ = self.jobs.send(Job {
            value: value.clone(),
            chunk,
            done,
        });
        Pending {
            value: value.clone(),
            chunk,
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

    #[test]
    fn pool_checks_later_chunks_and_catches_corruption() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 3 * memkv_proto::CHECKSUM_CHUNK);
        let pool = Verifier::new(2).unwrap();
        assert!(pool.check(&v, 1).ok() && pool.check(&v, 2).ok());
        v.span.corrupt_for_test(2 * memkv_proto::CHECKSUM_CHUNK + 1);
        assert!(pool.check(&v, 1).ok());
        assert!(!pool.check(&v, 2).ok());
    }

    #[test]
    fn without_a_pool_the_check_runs_inline() {
        let s = Store::new(8 << 20, 1, 0.5).unwrap();
        let v = stored(&s, 2 * memkv_proto::CHECKSUM_CHUNK);
        let (jobs, rx) = unbounded();
        drop(rx);
        let gone = Verifier { jobs };
        assert!(gone.check(&v, 1).ok());
        v.span.corrupt_for_test(memkv_proto::CHECKSUM_CHUNK + 3);
        assert!(!gone.check(&v, 1).ok());
    }
}
