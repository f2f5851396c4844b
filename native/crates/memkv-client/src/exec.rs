//! Completion handles and the I/O threads that run submitted operations, so callers (the Python
//! scheduler and workers) submit a batch, keep going, and poll or wait for it later without a
//! thread of their own per operation.
//!
//! A caller with many operations in flight (the block store) does not poll each: it submits
//! them with a `CompletionQueue` and a tag, waits on the queue, and collects the `Op`s whose
//! tags came back without blocking.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{select_biased, unbounded, Sender};

use crate::Status;

#[derive(Debug, Clone)]
pub enum OpResult {
    Statuses(Vec<Status>),
    StatusLens(Vec<(Status, u64)>),
    /// A mapped read (`Client::get_mapped_by`): each key's status and address, and the ticket.
    Mapped(Vec<(Status, usize)>, u64),
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

#[derive(Default)]
struct QueueState {
    /// Tags of completed operations not handed out yet, in completion order.
    tags: Vec<u64>,
    /// `wake` was called since the last `wait` returned.
    woken: bool,
}

/// Where operations submitted with it announce their completion: each pushes its tag exactly
/// once, after its `Op` holds the result (so `Op::wait(Some(0))` then returns it at once),
/// also when it panicked. Cheap to clone; all clones are one queue.
#[derive(Clone, Default)]
pub struct CompletionQueue(Arc<(Mutex<QueueState>, Condvar)>);

impl CompletionQueue {
    pub fn new() -> CompletionQueue {
        CompletionQueue::default()
    }

    fn push(&self, tag: u64) {
        let (st, cv) = &*self.0;
        st.lock().unwrap().tags.push(tag);
        cv.notify_all();
    }

    /// Takes every tag pushed since the last call. Waits up to `timeout` (forever if None) for
    /// the first one; returns what is there (maybe nothing) when the timeout passes or `wake`
    /// is called.
    pub fn wait(&self, timeout: Option<Duration>) -> Vec<u64> {
        let (st, cv) = &*self.0;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = st.lock().unwrap();
        while g.tags.is_empty() && !g.woken {
            match deadline {
                None => g = cv.wait(g).unwrap(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    g = cv.wait_timeout(g, d - now).unwrap().0;
                }
            }
        }
        g.woken = false;
        std::mem::take(&mut g.tags)
    }

    /// Makes the current `wait`, or else the next one, return even without a tag (a caller
    /// stopping its waiting thread).
    pub fn wake(&self) {
        let (st, cv) = &*self.0;
        st.lock().unwrap().woken = true;
        cv.notify_all();
    }
}

/// Completes an `Op` (and announces it) exactly once: with the job's result, or, if the job is
/// dropped without having run, as panicked, so that nobody waits for it forever.
struct Completion {
    op: Op,
    notify: Option<(CompletionQueue, u64)>,
    result: Option<OpResult>,
}

impl Completion {
    /// Completes with `r` (by dropping: one path for both endings).
    fn finish(mut self, r: OpResult) {
        self.result = Some(r);
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let r = self
            .result
            .take()
            .unwrap_or_else(|| OpResult::Panicked("the operation was dropped unrun".into()));
        self.op.complete(r);
        if let Some((q, tag)) = self.notify.take() {
            q.push(tag);
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Which queue a submitted operation waits in for an I/O thread: a free thread takes the oldest
/// `Urgent` operation (lookups, loads: a request waits for them) before any `Bulk` one (stores,
/// deletes), so a backlog of stores delays a load by at most the operations already running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lane {
    #[default]
    Urgent,
    Bulk,
}

pub struct Executor {
    urgent: Sender<Job>,
    bulk: Sender<Job>,
}

impl Executor {
    pub fn new(threads: usize) -> Executor {
        let (urgent, urgent_rx) = unbounded::<Job>();
        let (bulk, bulk_rx) = unbounded::<Job>();
        for i in 0..threads {
            let (u, b) = (urgent_rx.clone(), bulk_rx.clone());
            std::thread::Builder::new()
                .name(format!("memkv-io-{i}"))
                .spawn(move || loop {
                    // Both lanes close together (the Executor dropped): what one still holds
                    // runs before the thread ends.
                    let job = select_biased! {
                        recv(u) -> j => j.or_else(|_| b.recv()),
                        recv(b) -> j => j.or_else(|_| u.recv()),
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .expect("spawn memkv I/O thread");
        }
        Executor { urgent, bulk }
    }

    pub fn submit(&self, f: impl FnOnce() -> OpResult + Send + 'static) -> Op {
        self.submit_to(f, Lane::Urgent, None)
    }

    /// As `submit`, in `lane`; once the returned `Op` is complete, `notify`'s tag is pushed onto
    /// its queue.
    pub fn submit_to(
        &self,
        f: impl FnOnce() -> OpResult + Send + 'static,
        lane: Lane,
        notify: Option<(CompletionQueue, u64)>,
    ) -> Op {
        let op = Op(Arc::default());
        let done = Completion {
            op: op.clone(),
            notify,
            result: None,
        };
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|p| OpResult::Panicked(panic_message(&*p)));
            done.finish(r);
        });
        let tx = match lane {
            Lane::Urgent => &self.urgent,
            Lane::Bulk => &self.bulk,
        };
        if let Err(e) = tx.send(job) {
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

    /// Waits on `q` until `n` tags came back (each wait at most 10 s), or panics.
    fn tags(q: &CompletionQueue, n: usize) -> Vec<u64> {
        let mut got = Vec::new();
        while got.len() < n {
            let t = q.wait(Some(Duration::from_secs(10)));
            assert!(!t.is_empty(), "no tag within 10 s; have {got:?}");
            got.extend(t);
        }
        got
    }

    #[test]
    fn every_tag_is_delivered_once_after_its_op_completed() {
        let ex = Executor::new(4);
        let q = CompletionQueue::new();
        let ops: Vec<(u64, Op)> = (0..200u64)
            .map(|t| {
                let op = ex.submit_to(
                    move || OpResult::Statuses(vec![Status::Ok; t as usize % 3]),
                    Lane::Urgent,
                    Some((q.clone(), t)),
                );
                (t, op)
            })
            .collect();
        let mut got = tags(&q, ops.len());
        got.sort_unstable();
        assert_eq!(got, (0..200).collect::<Vec<_>>());
        for (t, op) in &ops {
            // Done by the time its tag arrived: a zero wait collects it.
            match op.wait(Some(Duration::ZERO)) {
                Some(OpResult::Statuses(v)) => assert_eq!(v.len(), *t as usize % 3),
                other => panic!("{other:?}"),
            }
        }
        assert!(
            q.wait(Some(Duration::from_millis(50))).is_empty(),
            "a tag came twice"
        );
    }

    #[test]
    fn a_panicking_op_delivers_its_tag() {
        let ex = Executor::new(1);
        let q = CompletionQueue::new();
        let op = ex.submit_to(|| panic!("bad {}", 1), Lane::Bulk, Some((q.clone(), 7)));
        assert_eq!(tags(&q, 1), [7]);
        assert!(
            matches!(op.wait(Some(Duration::ZERO)), Some(OpResult::Panicked(m)) if m == "bad 1")
        );
    }

    #[test]
    fn a_job_dropped_unrun_completes_as_panicked() {
        let q = CompletionQueue::new();
        let op = Op(Arc::default());
        drop(Completion {
            op: op.clone(),
            notify: Some((q.clone(), 3)),
            result: None,
        });
        assert_eq!(tags(&q, 1), [3]);
        assert!(matches!(
            op.wait(Some(Duration::ZERO)),
            Some(OpResult::Panicked(_))
        ));
    }

    #[test]
    fn wait_times_out_empty_and_wake_ends_a_wait() {
        let q = CompletionQueue::new();
        let t0 = Instant::now();
        assert!(q.wait(Some(Duration::from_millis(100))).is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(100));
        // A wake before the wait is not lost; it ends one wait only.
        q.wake();
        assert!(q.wait(None).is_empty());
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.wait(None));
        q.wake();
        assert!(waiter.join().unwrap().is_empty());
        assert!(q.wait(Some(Duration::ZERO)).is_empty());
    }

    #[test]
    fn wait_returns_the_tags_of_ops_still_running_later() {
        let ex = Executor::new(2);
        let q = CompletionQueue::new();
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let slow = ex.submit_to(
            move || {
                rx.recv().unwrap();
                OpResult::Statuses(vec![])
            },
            Lane::Urgent,
            Some((q.clone(), 1)),
        );
        ex.submit_to(
            || OpResult::Statuses(vec![]),
            Lane::Bulk,
            Some((q.clone(), 2)),
        );
        assert_eq!(tags(&q, 1), [2]);
        assert!(!slow.done());
        tx.send(()).unwrap();
        assert_eq!(tags(&q, 1), [1]);
    }

    #[test]
    fn urgent_operations_start_before_waiting_bulk_ones() {
        let ex = Executor::new(1);
        let q = CompletionQueue::new();
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let (started_tx, started) = crossbeam_channel::bounded::<()>(1);
        // The one thread is busy; then bulk 1..=3 and urgent 10, 11 wait.
        ex.submit_to(
            move || {
                started_tx.send(()).unwrap();
                rx.recv().unwrap();
                OpResult::Statuses(vec![])
            },
            Lane::Bulk,
            Some((q.clone(), 0)),
        );
        started.recv().unwrap();
        for (tag, lane) in [(1, Lane::Bulk), (2, Lane::Bulk), (10, Lane::Urgent)] {
            ex.submit_to(|| OpResult::Statuses(vec![]), lane, Some((q.clone(), tag)));
        }
        ex.submit_to(
            || OpResult::Statuses(vec![]),
            Lane::Bulk,
            Some((q.clone(), 3)),
        );
        ex.submit_to(
            || OpResult::Statuses(vec![]),
            Lane::Urgent,
            Some((q.clone(), 11)),
        );
        tx.send(()).unwrap();
        assert_eq!(tags(&q, 6), [0, 10, 11, 1, 2, 3]);
    }
}
