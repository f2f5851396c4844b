//! Completion handles and the I/O threads that run submitted operations, so callers (the Python
//! scheduler and workers) submit a batch, keep going, and poll or wait for it later without a
//! thread of their own per operation.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Sender};

use crate::Status;

#[derive(Debug, Clone)]
pub enum OpResult {
    Statuses(Vec<Status>),
    StatusLens(Vec<(Status, u64)>),
    /// The operation panicked (a bug); the message says where. Waiters get this instead of
    /// waiting forever for a result that will never come.
    Panicked(String),
}

#[derive(Default)]
struct OpState {
    result: Mutex<Option<OpResult>>,
    cv: Condvar,
}

/// A submitted operation. Cheap to clone; all clones see the same completion.
#[derive(Clone)]
pub struct Op(Arc<OpState>);

impl Op {
    pub fn done(&self) -> bool {
        self.0.result.lock().unwrap().is_some()
    }

    /// Waits up to `timeout` (forever if None); None if still running then.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<OpResult> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = self.0.result.lock().unwrap();
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            match deadline {
                None => g = self.0.cv.wait(g).unwrap(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self.0.cv.wait_timeout(g, d - now).unwrap().0;
                }
            }
        }
    }

    fn complete(&self, r: OpResult) {
        *self.0.result.lock().unwrap() = Some(r);
        self.0.cv.notify_all();
    }
}

type Job = Box<dyn FnOnce() + Send>;

pub struct Executor {
    tx: Sender<Job>,
}

impl Executor {
    pub fn new(threads: usize) -> Executor {
        let (tx, rx) = unbounded::<Job>();
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("memkv-io-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .expect("spawn memkv I/O thread");
        }
        Executor { tx }
    }

    pub fn submit(&self, f: impl FnOnce() -> OpResult + Send + 'static) -> Op {
        let op = Op(Arc::default());
        let done = op.clone();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|p| OpResult::Panicked(panic_message(&*p)));
            done.complete(r)
        });
        if let Err(e) = self.tx.send(job) {
            // Only possible if the threads are gone; run inline rather than never completing.
            (e.into_inner())();
        }
        op
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_job_completes_its_op() {
        let ex = Executor::new(1);
        let op = ex.submit(|| panic!("boom {}", 7));
        match op.wait(Some(Duration::from_secs(10))) {
            Some(OpResult::Panicked(m)) => assert_eq!(m, "boom 7"),
            other => panic!("{other:?}"),
        }
        let ok = ex.submit(|| OpResult::Statuses(vec![Status::Ok]));
        assert!(matches!(
            ok.wait(Some(Duration::from_secs(10))),
            Some(OpResult::Statuses(_))
        ));
    }
}
