//! The same-host path's copies (`crate::cmd::shm_get`, `crate::cmd::shm_put`), spread over a
//! pool of threads.
//!
//! One thread's memcpy into or out of a client's mapping moves 5-6 GB/s on a server CPU, a tenth
//! of what a PCIe 5 GPU takes from pinned memory, so with one thread per request a large value
//! moved at that rate however idle the host was. A request's copies are therefore cut into 1 MiB
//! pieces that the pool's threads take in turn, and a PUT's checksums and a GET's checks are
//! computed the same way (on the H200 host one client's 32 MiB values went from one thread's
//! rate to 23-24 GB/s, the host's copy bandwidth from DRAM). The pool is shared by every
//! connection, so it also bounds the CPUs the path takes however many clients copy at once (a
//! request waits for its pieces, it spawns nothing). Small requests are copied on the
//! connection's own thread: a hand-off costs more than their bytes.
//!
//! Every piece goes through `crate::fault_guard::copy`, whose guard is per thread, so a client
//! that shrinks its file under a piece fails that piece's job whichever thread copied it; the
//! request's deadline is checked before each piece, as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use memkv_proto::CHECKSUM_CHUNK;
use rayon::prelude::*;

use crate::lane::Value;

/// Bytes copied between two looks at the deadline, and the unit the pool hands out.
pub(crate) const COPY_PIECE: usize = 1 << 20;

/// Requests with fewer bytes are copied on the connection's thread.
const SPREAD_FROM: usize = 4 * COPY_PIECE;

/// One contiguous copy between store memory and a client mapping.
pub(crate) struct CopyJob {
    pub dst: *mut u8,
    pub src: *const u8,
    pub len: usize,
    /// The client mapping (start, length) that `dst` or `src` lies in.
    pub mapping: (usize, usize),
}

// SAFETY: a job only names memory its request keeps alive (pinned store memory, a reservation,
// a live client mapping) until `Copier::copy` returns; the pieces of one request never overlap.
unsafe impl Send for CopyJob {}
unsafe impl Sync for CopyJob {}

/// The bytes a check of `values`' chunks reads: what decides whether it goes to the pool.
fn checked_bytes<'v>(values: impl Iterator<Item = &'v Value>) -> usize {
    values.map(|v| v.chunks() * CHECKSUM_CHUNK).sum()
}

/// Whether each value's chunks after the first (which the lookup checked) match their
/// checksums; `parallel`: over the rayon pool the caller runs in.
fn intact(values: &[&Value], parallel: bool) -> Vec<bool> {
    let corrupt: Vec<AtomicBool> = values.iter().map(|_| AtomicBool::new(false)).collect();
    let chunks: Vec<(usize, usize)> = values
        .iter()
        .enumerate()
        .flat_map(|(i, v)| (1..v.chunks()).map(move |c| (i, c)))
        .collect();
    let check = |&(i, c): &(usize, usize)| {
        if !corrupt[i].load(Ordering::Relaxed) && !values[i].chunk_ok(c) {
            corrupt[i].store(true, Ordering::Relaxed);
        }
    };
    if parallel {
        chunks.par_iter().for_each(check);
    } else {
        chunks.iter().for_each(check);
    }
    corrupt.iter().map(|c| !c.load(Ordering::Relaxed)).collect()
}

/// Whether each value of a `verify_later` matched its checksums, once known.
#[derive(Default)]
pub(crate) struct Verdict {
    intact: Mutex<Option<Vec<bool>>>,
    known: Condvar,
}

impl Verdict {
    fn set(&self, intact: Vec<bool>) {
        *self.intact.lock().unwrap_or_else(|e| e.into_inner()) = Some(intact);
        self.known.notify_all();
    }

    /// The verdict, waiting for it until `deadline`; None if it is not known by then.
    pub fn wait(&self, deadline: Instant) -> Option<Vec<bool>> {
        let mut g = self.intact.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            let left = deadline.checked_duration_since(Instant::now())?;
            g = self
                .known
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        g.clone()
    }
}

/// A request ran out of time before all its pieces were copied.
#[derive(Debug)]
pub(crate) struct Late;

/// The copy pool: started with the first request big enough to use it.
pub(crate) struct Copier {
    threads: usize,
    pool: OnceLock<Option<rayon::ThreadPool>>,
}

impl Copier {
    /// A pool of `threads` (1: every copy on the connection's thread).
    pub fn new(threads: usize) -> Copier {
        Copier {
            threads: threads.max(1),
            pool: OnceLock::new(),
        }
    }

    /// The pool, when one helps a request of `bytes`; None when it could not be started (the
    /// copies then run on the caller, as they always can).
    fn pool_for(&self, bytes: usize) -> Option<&rayon::ThreadPool> {
        if self.threads < 2 || bytes < SPREAD_FROM {
            return None;
        }
        self.pool
            .get_or_init(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(|i| format!("memkv-shm-copy-{i}"))
                    .build()
                    .map_err(|e| tracing::warn!(error = %e, "no shm copy pool; copies stay serial"))
                    .ok()
            })
            .as_ref()
    }

    /// Copies every job; per job, whether it arrived whole (false: its client mapping faulted
    /// under it). Err when the deadline passed before a piece: the request is to end unanswered.
    ///
    /// # Safety
    /// Every job's ranges must stay mapped until this returns, no two jobs may write the same
    /// bytes of the server's own memory (a client's mapping is written by the client too, so
    /// overlapping places there cost only the client), and `crate::fault_guard::install` must
    /// have run.
    pub unsafe fn copy(&self, jobs: &[CopyJob], deadline: Instant) -> Result<Vec<bool>, Late> {
        let faulted: Vec<AtomicBool> = jobs.iter().map(|_| AtomicBool::new(false)).collect();
        let piece = |&(j, off): &(usize, usize)| -> Result<(), Late> {
            if Instant::now() > deadline {
                return Err(Late);
            }
            if faulted[j].load(Ordering::Relaxed) {
                return Ok(()); // the job failed: the rest of it is not worth copying
            }
            let job = &jobs[j];
            let n = COPY_PIECE.min(job.len - off);
            // SAFETY: the caller's contract; `off + n` lies within the job.
            let ok = unsafe {
                crate::fault_guard::copy(job.dst.add(off), job.src.add(off), n, job.mapping)
            };
            if !ok {
                faulted[j].store(true, Ordering::Relaxed);
            }
            Ok(())
        };
        let pieces: Vec<(usize, usize)> = jobs
            .iter()
            .enumerate()
            .flat_map(|(j, job)| (0..job.len).step_by(COPY_PIECE).map(move |off| (j, off)))
            .collect();
        let bytes = jobs.iter().map(|j| j.len).sum();
        match self.pool_for(bytes) {
            Some(pool) => pool.install(|| pieces.par_iter().try_for_each(piece))?,
            None => pieces.iter().try_for_each(piece)?,
        }
        Ok(faulted.iter().map(|f| !f.load(Ordering::Relaxed)).collect())
    }

    /// Whether each value's chunks after the first (which the lookup checked) match their
    /// checksums. The pool checks a big request's chunks together: one thread hashing them in
    /// turn before the copies started took as long as the copies.
    pub fn verify(&self, values: &[&Value]) -> Vec<bool> {
        match self.pool_for(checked_bytes(values.iter().copied())) {
            Some(pool) => pool.install(|| intact(values, true)),
            None => intact(values, false),
        }
    }

    /// `verify` of `values` while the caller goes on: on the pool for a big request (the verdict
    /// arrives in the returned `Verdict`), else here, before returning.
    pub fn verify_later(&self, values: Vec<Arc<Value>>) -> Arc<Verdict> {
        let verdict = Arc::new(Verdict::default());
        let Some(pool) = self.pool_for(checked_bytes(values.iter().map(|v| &**v))) else {
            let refs: Vec<&Value> = values.iter().map(|v| &**v).collect();
            verdict.set(intact(&refs, false));
            return verdict;
        };
        let (v, out) = (values, verdict.clone());
        pool.spawn(move || {
            let refs: Vec<&Value> = v.iter().map(|v| &**v).collect();
            out.set(intact(&refs, true));
        });
        verdict
    }

    /// `memkv_proto::chunk_checksums(data)`, its chunks hashed over the pool when `data` is big.
    pub fn checksums(&self, data: &[u8]) -> Vec<u64> {
        match self.pool_for(data.len()) {
            Some(pool) => pool.install(|| {
                data.par_chunks(CHECKSUM_CHUNK)
                    .map(memkv_proto::checksum)
                    .collect()
            }),
            None => memkv_proto::chunk_checksums(data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn jobs_for(dst: &mut [Vec<u8>], src: &[Vec<u8>]) -> Vec<CopyJob> {
        dst.iter_mut()
            .zip(src)
            .map(|(d, s)| CopyJob {
                dst: d.as_mut_ptr(),
                src: s.as_ptr(),
                len: s.len(),
                mapping: (d.as_ptr() as usize, d.len()),
            })
            .collect()
    }

    #[test]
    fn pooled_and_serial_copies_move_every_byte() {
        crate::fault_guard::install();
        // Sizes around the piece and spread bounds, and one not a multiple of a piece.
        let src: Vec<Vec<u8>> = [1, COPY_PIECE, 3 * COPY_PIECE + 17, 9 * COPY_PIECE]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 31 + i) as u8).collect())
            .collect();
        for threads in [1, 4] {
            let copier = Copier::new(threads);
            let mut dst: Vec<Vec<u8>> = src.iter().map(|s| vec![0u8; s.len()]).collect();
            let jobs = jobs_for(&mut dst, &src);
            let deadline = Instant::now() + Duration::from_secs(60);
            // SAFETY: the vectors outlive the call and do not overlap.
            let ok = unsafe { copier.copy(&jobs, deadline) }.unwrap();
            assert_eq!(ok, vec![true; src.len()]);
            assert_eq!(dst, src, "threads {threads}");
        }
    }

    #[test]
    fn a_passed_deadline_copies_nothing() {
        crate::fault_guard::install();
        let src = vec![vec![7u8; 8 * COPY_PIECE]];
        let mut dst = vec![vec![0u8; 8 * COPY_PIECE]];
        let jobs = jobs_for(&mut dst, &src);
        let past = Instant::now() - Duration::from_millis(1);
        // SAFETY: as above.
        assert!(unsafe { Copier::new(4).copy(&jobs, past) }.is_err());
        assert!(dst[0].iter().all(|&b| b == 0));
    }

    #[test]
    fn pooled_checksums_equal_serial_ones() {
        let data: Vec<u8> = (0..(5 * COPY_PIECE + 999))
            .map(|b| (b % 251) as u8)
            .collect();
        let want = memkv_proto::chunk_checksums(&data);
        assert_eq!(want.len(), data.len().div_ceil(CHECKSUM_CHUNK));
        assert_eq!(Copier::new(4).checksums(&data), want);
        assert_eq!(Copier::new(1).checksums(&data), want);
        // An empty value has one checksum, as every other path stores it.
        assert_eq!(Copier::new(4).checksums(&[]), [memkv_proto::checksum(&[])]);
    }
}
