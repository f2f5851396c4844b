//! `Endpoint`: a reliable-datagram endpoint that runs batches of RDMA reads and writes (`Rma`)
//! against a peer, and drives the provider's progress for a passive side.

use std::ffi::{c_int, c_void};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::completion::WriteCompletion;
use crate::error::{FabricError, Result};
use crate::fabric::Fabric;
use crate::fence::FenceTarget;
use crate::sys::{self, Fid};

/// Longest endpoint address `Endpoint::name` reads (and a string address may be).
pub(crate) const MAX_NAME: usize = 256;

/// One remote operation of a batch: moves `len` bytes between local memory at `local`
/// (registered, `desc` from its `Mr`) and the peer's memory at `remote_addr` under `rkey`.
/// `group` names the caller's unit (a key): a failure is reported per group.
#[derive(Debug, Clone, Copy)]
pub struct Rma {
    /// true: write local to remote (GET); false: read remote into local (PUT).
    pub write: bool,
    pub local: usize,
    pub desc: usize,
    pub len: usize,
    pub remote_addr: u64,
    pub rkey: u64,
    pub group: usize,
}

/// A reliable-datagram endpoint with its completion queue and address vector.
pub struct Endpoint {
    fab: Arc<Fabric>,
    ep: Fid,
    cq: Fid,
    av: Fid,
    wait_fd: RawFd,
    /// One `fi_context2` per operation in flight: providers may use it until the completion.
    contexts: Box<[u64]>,
    ctx_words: usize,
    closed: bool,
    /// Where the fencing reads land, under `WriteCompletion::ReadFence`.
    fence: Option<FenceTarget>,
}

/// Completions one fi_cq_read takes at most.
const CQ_BATCH: usize = 16;

/// What an fi_cq_read answered: `n` completions (> 0), none (0), an error completion
/// (`-FI_EAVAIL`: the operation's context `ectx`, libfabric's error `err` and the provider's
/// `perr`), or the queue's failure (another negative code).
struct CqRead {
    n: isize,
    ectx: *mut c_void,
    err: c_int,
    perr: c_int,
}

// SAFETY: an endpoint is used by one thread at a time (`&mut self`); the domain is thread-safe.
unsafe impl Send for Endpoint {}

impl Endpoint {
    pub fn open(fab: &Arc<Fabric>) -> Result<Endpoint> {
        let (mut ep, mut cq, mut av, mut fd) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            -1,
        );
        // SAFETY: the domain and info are open for as long as `fab` lives.
        let r =
            unsafe { sys::mk_open_ep(fab.domain, fab.info, &mut ep, &mut cq, &mut av, &mut fd) };
        if r != 0 {
            return Err(FabricError::new("fi_endpoint", r));
        }
        // SAFETY: a constant.
        let ctx_words = unsafe { sys::mk_context_size() }.div_ceil(8);
        let mut e = Endpoint {
            fab: fab.clone(),
            ep,
            cq,
            av,
            wait_fd: fd,
            contexts: vec![0u64; ctx_words * fab.depth].into_boxed_slice(),
            ctx_words,
            closed: false,
            fence: None,
        };
        if fab.write_completion == WriteCompletion::ReadFence {
            e.fence = Some(FenceTarget::new(fab)?);
        }
        Ok(e)
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fab
    }

    /// This endpoint's address, for a peer's address vector.
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; MAX_NAME];
        let mut len = buf.len();
        // SAFETY: `buf` holds `len` bytes.
        let r = unsafe { sys::mk_getname(self.ep, buf.as_mut_ptr().cast(), &mut len) };
        if r != 0 {
            return Err(FabricError::new("fi_getname", r));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// Adds a peer's address; the result names it in `run`.
    pub fn insert_peer(&mut self, addr: &[u8]) -> Result<u64> {
        let mut a = 0u64;
        // SAFETY: the provider reads one address of its own format from `addr`; a short or
        // malformed one is the provider's to refuse. Our caller bounds its length.
        let r = unsafe { sys::mk_av_insert(self.av, addr.as_ptr().cast(), &mut a) };
        if r != 0 {
            return Err(FabricError::new("fi_av_insert", r));
        }
        Ok(a)
    }

    /// The fd that becomes readable when the provider has work (None: poll `progress`).
    pub fn wait_fd(&self) -> Option<RawFd> {
        (self.wait_fd >= 0).then_some(self.wait_fd)
    }

    /// Whether blocking on `wait_fd` now cannot miss work (else call `progress` first).
    pub fn may_block(&self) -> bool {
        // SAFETY: fabric and CQ are open.
        self.wait_fd >= 0 && unsafe { sys::mk_trywait(self.fab.fabric, self.cq) } == 0
    }

    /// Drives the provider's progress: a passive side (whose memory a peer reads or writes)
    /// must call this while it waits, since software providers move the bytes in these calls.
    pub fn progress(&mut self) -> Result<()> {
        let mut ctx = [std::ptr::null_mut(); CQ_BATCH];
        loop {
            let n = self.cq_read(&mut ctx).n;
            // A passive endpoint posts nothing, so any completion is not ours to act on.
            match n {
                0 => return Ok(()),
                n if n > 0 => continue,
                n if n == -(unsafe { sys::mk_eavail() } as isize) => continue,
                n => return Err(FabricError::new("fi_cq_read", n as i32)),
            }
        }
    }

    /// Runs `ops` against `peer`, at most `depth` in flight, until all completed or `deadline`.
    /// Returns, per group (index = `group`, `groups` entries), None or the group's first error;
    /// an operation of a failed group that is not yet posted is skipped. A group's writes have
    /// their bytes in the peer's memory when it reports no error (`WriteCompletion`). A deadline
    /// miss or a broken completion queue closes the endpoint first (no operation of it can
    /// touch memory afterwards), so the caller may then release the memory the operations named.
    pub fn run(
        &mut self,
        peer: u64,
        ops: &[Rma],
        groups: usize,
        deadline: Instant,
    ) -> Result<Vec<Option<FabricError>>> {
        let mut errors: Vec<Option<FabricError>> = vec![None; groups];
        self.run_batch(peer, ops, &mut errors, deadline)?;
        // Posted only now that the writes completed, so each read follows its group's writes.
        let fences = self
            .fence
            .as_ref()
            .map(|f| f.reads(ops, &errors))
            .unwrap_or_default();
        if !fences.is_empty() {
            self.run_batch(peer, &fences, &mut errors, deadline)?;
        }
        Ok(errors)
    }

    /// `run`'s loop: posts `ops`, records each group's first error in `errors`.
    fn run_batch(
        &mut self,
        peer: u64,
        ops: &[Rma],
        errors: &mut [Option<FabricError>],
        deadline: Instant,
    ) -> Result<()> {
        if self.closed {
            return Err(FabricError::other("fi_read/fi_write", "endpoint closed"));
        }
        let depth = self.fab.depth;
        let mut slot_group = vec![usize::MAX; depth];
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let (mut next, mut inflight) = (0, 0usize);
        // SAFETY: constants.
        let (eagain, eavail) = unsafe { (sys::mk_eagain() as isize, sys::mk_eavail() as isize) };
        let base = self.contexts.as_ptr() as usize;
        let ctx_bytes = self.ctx_words * 8;
        loop {
            while next < ops.len() && !free.is_empty() {
                let op = ops[next];
                if errors[op.group].is_some() {
                    next += 1;
                    continue;
                }
                let s = free.pop().expect("checked");
                let ctx = (base + s * ctx_bytes) as *mut c_void;
                // SAFETY: the local memory is registered (`desc`) and stays valid until this
                // returns (the caller's contract, and on early return the endpoint is closed
                // first); `ctx` is a slot of `contexts`, unused until its completion.
                let r = unsafe {
                    sys::mk_rma(
                        self.ep,
                        c_int::from(op.write),
                        op.local as *mut c_void,
                        op.len,
                        op.desc as *mut c_void,
                        peer,
                        op.remote_addr,
                        op.rkey,
                        ctx,
                    )
                };
                if r == -eagain {
                    free.push(s);
                    break;
                }
                if r < 0 {
                    free.push(s);
                    errors[op.group] = Some(FabricError::new(
                        if op.write { "fi_write" } else { "fi_read" },
                        r as i32,
                    ));
                } else {
                    slot_group[s] = op.group;
                    inflight += 1;
                }
                next += 1;
            }
            if next == ops.len() && inflight == 0 {
                return Ok(());
            }
            let mut done = [std::ptr::null_mut(); CQ_BATCH];
            let CqRead { n, ectx, err, perr } = self.cq_read(&mut done);
            let slot_of = |p: *mut c_void| -> Option<usize> {
                let off = (p as usize).checked_sub(base)?;
                (off % ctx_bytes == 0 && off / ctx_bytes < depth).then_some(off / ctx_bytes)
            };
            if n > 0 {
                for &p in &done[..n as usize] {
                    let s = slot_of(p).ok_or_else(|| self.fail("a completion of no operation"))?;
                    free.push(s);
                    inflight -= 1;
                }
            } else if n == -eavail {
                let s = slot_of(ectx).ok_or_else(|| self.fail("an error of no operation"))?;
                free.push(s);
                inflight -= 1;
                let g = slot_group[s];
                let mut e = FabricError::new("remote operation", err);
                if perr != 0 {
                    e.msg = format!("{} (provider error {perr})", e.msg);
                }
                errors[g].get_or_insert(e);
            } else if n < 0 {
                self.close();
                return Err(FabricError::new("fi_cq_read", n as i32));
            } else {
                let now = Instant::now();
                if now >= deadline {
                    self.close();
                    return Err(FabricError::new("fi_read/fi_write", libc::ETIMEDOUT));
                }
                self.wait((deadline - now).min(Duration::from_millis(10)));
            }
        }
    }

    /// One fi_cq_read of up to `CQ_BATCH` completions, their contexts into `done`.
    fn cq_read(&self, done: &mut [*mut c_void; CQ_BATCH]) -> CqRead {
        let mut r = CqRead {
            n: 0,
            ectx: std::ptr::null_mut(),
            err: 0,
            perr: 0,
        };
        // SAFETY: `done` holds CQ_BATCH entries; the CQ is open while `self` lives.
        r.n = unsafe {
            sys::mk_cq_read(
                self.cq,
                done.as_mut_ptr(),
                CQ_BATCH,
                &mut r.ectx,
                &mut r.err,
                &mut r.perr,
            )
        };
        r
    }

    /// Waits up to `max` for the provider to have work, or yields when it offers no fd.
    pub fn wait(&self, max: Duration) {
        if self.may_block() {
            let mut pfd = libc::pollfd {
                fd: self.wait_fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd for the CQ's wait fd, open while `self` lives.
            unsafe { libc::poll(&mut pfd, 1, max.as_millis().max(1) as c_int) };
        } else {
            std::thread::yield_now();
        }
    }

    fn fail(&mut self, what: &str) -> FabricError {
        self.close();
        FabricError::other("fi_cq_read", format!("provider reported {what}"))
    }

    /// Closes the endpoint now: operations in flight are cancelled and none touches memory
    /// after this returns. Later `run` calls fail.
    pub fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            // SAFETY: closing in reverse order of binding; nothing uses them afterwards.
            unsafe {
                sys::mk_close(self.ep);
                sys::mk_close(self.av);
                sys::mk_close(self.cq);
            }
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close();
    }
}
