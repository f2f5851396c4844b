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
        let job: Job = Box::new(move || done.complete(f()));
        if let Err(e) = self.tx.send(job) {
            // Only possible if the threads are gone; run inline rather than never completing.
            (e.into_inner())();
        }
        op
    }
}
