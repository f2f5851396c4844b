"""`KVOffloader`: moves KV blocks between paged KV tensors and a memkv cluster, one value per block.

A store job gathers each entry's blocks into a scratch slot (movers.py), and once the copy's fence
has passed hands the slots to the `Offloader` (memkv_vllm.store.BlockStore) as one value each. A
load job reads values into scratch slots, then scatters the ones that arrived to their blocks. The
KV tensors are never written by the network: a value that fails (evicted, server gone, timeout,
wrong length) leaves its blocks untouched and is reported in `JobResult.failed_block_ids`, for the
caller to recompute. Nothing here raises once a job is accepted.

Jobs are cut into batches of `batch_values` values, so that the network sends the first batch while
the copy engines gather the next. Scratch is a fixed pool of slots; entries wait for free slots
(loads before stores) instead of allocating.

Threads: like the `Offloader` below it, an offloader belongs to one owner thread; `submit_*` and
`poll` never block, `wait` and `close` do. No vLLM imports; torch is imported by the movers.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from memkv_vllm.interface import Completion
from memkv_vllm.offload.movers import Fence, make_mover
from memkv_vllm.offload.paged import Entry, PagedKV
from memkv_vllm.store import BlockStore

logger = logging.getLogger(__name__)

_SLOT_ALIGN = 4096  # slots start on page boundaries: friendlier to DMA and to future RDMA


@attrs.frozen
class JobResult:
    """One finished job, returned exactly once by `KVOffloader.poll`."""

    job_id: int
    is_load: bool
    ok: bool  # every value transferred
    ok_keys: tuple[bytes, ...]
    # Loads: blocks NOT written (recompute them). Stores: blocks whose value is not in the cluster.
    failed_block_ids: tuple[int, ...]
    nbytes: int  # value bytes that transferred
    seconds: float  # submit -> done, on the offloader's clock


@attrs.define(eq=False)
class _Job:
    job_id: int
    is_load: bool
    pending: collections.deque[Entry]
    ready: Any  # the mover's marker on the caller's stream at submit
    t0: float
    open: int  # entries not finished
    uncopied: int  # stores: entries whose blocks may still be read
    ok_keys: list[bytes] = attrs.Factory(list)
    failed: list[int] = attrs.Factory(list)
    nbytes: int = 0
    abandoned: bool = False  # loads: write no more blocks (see `abandon`)


@attrs.define(eq=False)
class _Batch:
    job: _Job
    entries: list[Entry]
    slots: list[int]
    fence: Fence | None = None
    ok: list[bool] = attrs.Factory(list)


class KVOffloader:
    """Block-granular KV offloading over an `Offloader`; owns `store` (closes it)."""

    def __init__(self, kv: PagedKV, store: BlockStore, medium: str = "auto",
                 scratch_bytes: int = 256 << 20, batch_values: int = 4,
                 clock: Callable[[], float] = time.monotonic, copy_method: str = "auto",
                 copy_programs: int = 32) -> None:
        self.kv, self._store, self._clock = kv, store, clock
        self.slot_bytes = -(-kv.max_value_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        n_slots = scratch_bytes // self.slot_bytes
        if n_slots < 1:
            raise ValueError(f"scratch of {scratch_bytes} bytes cannot hold one "
                             f"{kv.max_value_bytes}-byte value")
        self.mover = make_mover(kv, n_slots, self.slot_bytes, medium, copy_method,
                                copy_programs)
        self.medium = self.mover.medium
        self.n_slots = n_slots
        self.batch_values = max(1, batch_values)
        host = self.mover.host
        self._host_base = int(host.data_ptr())
        store.register_buffer(self._host_base, n_slots * self.slot_bytes, owner=host)
        self._free = list(range(n_slots - 1, -1, -1))
        self._queues: dict[bool, collections.deque[_Job]] = {
            True: collections.deque(), False: collections.deque()}
        self._jobs: dict[int, _Job] = {}
        self._copying: list[_Batch] = []
        self._io: dict[int, _Batch] = {}
        self._io_ids = 0
        self._finished: list[JobResult] = []
        self._closed = False

    def describe(self) -> str:
        """One line for a startup log."""
        return (f"value {self.kv.max_value_bytes} B, {self.n_slots} scratch slots of "
                f"{self.slot_bytes} B ({self.n_slots * self.slot_bytes >> 20} MiB), "
                f"medium {self.medium}, {self.batch_values} values per batch")

    # ----------------------------------------------------------------------------- submit
    def submit_store(self, job_id: int, entries: Sequence[Entry]) -> None:
        """Start copying `entries`' blocks out and storing them. Non-blocking."""
        self._submit(False, job_id, entries)

    def submit_load(self, job_id: int, entries: Sequence[Entry]) -> None:
        """Start reading `entries` and writing them into their blocks. Non-blocking."""
        self._submit(True, job_id, entries)

    def _submit(self, is_load: bool, job_id: int, entries: Sequence[Entry]) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already running")
        for e in entries:
            self.kv.check(e)
        job = _Job(job_id, is_load, collections.deque(entries), None, self._clock(),
                   len(entries), 0 if is_load else len(entries))
        if self._closed:
            self._fail_unstarted(job)
            return
        try:
            job.ready = self.mover.ready_marker()
        except Exception as e:  # a broken device must not reach the caller's hot path
            logger.warning("memkv offload: cannot order job %d after the compute stream: %s",
                           job_id, e)
            self._fail_unstarted(job)
            return
        self._jobs[job_id] = job
        if not entries:
            self._finish(job)
            return
        self._queues[is_load].append(job)
        self._pump()

    def _fail_unstarted(self, job: _Job) -> None:
        """Finish a job none of whose entries started: every block failed."""
        job.failed = [b for e in job.pending for b in e.block_ids]
        job.pending.clear()
        job.open = job.uncopied = 0
        self._finish(job)

    # ----------------------------------------------------------------------------- progress
    def poll(self) -> list[JobResult]:
        """Advance every stage without blocking; finished jobs, each exactly once."""
        self._pump()
        done, self._finished = self._finished, []
        return done

    def _pump(self) -> None:
        for c in self._store.poll():
            batch = self._io.pop(c.job_id, None)
            if batch is not None:
                self._io_done(batch, c)
        still = []
        for b in self._copying:
            if b.fence is not None and b.fence.done():
                self._copied(b)
            else:
                still.append(b)
        self._copying = still
        self._assign()

    def _assign(self) -> None:
        for is_load in (True, False):  # loads first: a request waits for them
            q = self._queues[is_load]
            while q and self._free:
                job = q[0]
                n = min(self.batch_values, len(self._free), len(job.pending))
                entries = [job.pending.popleft() for _ in range(n)]
                slots = [self._free.pop() for _ in range(n)]
                if not job.pending:
                    q.popleft()
                self._start(_Batch(job, entries, slots))

    def _ptrs(self, b: _Batch) -> list[int]:
        return [self._host_base + s * self.slot_bytes for s in b.slots]

    def _sizes(self, b: _Batch) -> list[int]:
        return [self.kv.value_bytes[e.group] for e in b.entries]

    def _start(self, b: _Batch) -> None:
        if b.job.is_load:
            self._submit_io(b)
            return
        try:
            b.fence = self.mover.gather(b.entries, b.slots, b.job.ready)
        except Exception as e:
            logger.warning("memkv offload: gather for job %d failed: %s", b.job.job_id, e)
            b.job.uncopied -= len(b.entries)
            self._settle(b, [False] * len(b.entries))
            return
        self._copying.append(b)

    def _submit_io(self, b: _Batch) -> None:
        self._io_ids += 1
        self._io[self._io_ids] = b
        keys = [e.key for e in b.entries]
        if b.job.is_load:
            self._store.submit_load(self._io_ids, keys, self._ptrs(b), self._sizes(b))
        else:
            self._store.submit_store(self._io_ids, keys, self._ptrs(b), self._sizes(b))

    def _copied(self, b: _Batch) -> None:
        if b.job.is_load:  # scattered: the blocks hold the values
            self._settle(b, b.ok)
        else:  # gathered: the blocks are free again, the values go out
            b.job.uncopied -= len(b.entries)
            self._submit_io(b)

    def _io_done(self, b: _Batch, c: Completion) -> None:
        got = set(c.ok_keys)
        lost = b.job.is_load and b.job.abandoned  # its blocks belong to someone else now
        ok = [e.key in got and not lost for e in b.entries]
        if not b.job.is_load:
            self._settle(b, ok)
            return
        b.ok = ok
        good = [i for i, k in enumerate(ok) if k]
        if not good:
            self._settle(b, ok)
            return
        try:
            b.fence = self.mover.scatter([b.entries[i] for i in good],
                                         [b.slots[i] for i in good], b.job.ready)
        except Exception as e:
            logger.warning("memkv offload: scatter for job %d failed: %s", b.job.job_id, e)
            self._settle(b, [False] * len(b.entries))
            return
        self._copying.append(b)

    def _settle(self, b: _Batch, ok: Sequence[bool]) -> None:
        job = b.job
        for e, good in zip(b.entries, ok, strict=True):
            if good:
                job.ok_keys.append(e.key)
                job.nbytes += self.kv.value_bytes[e.group]
            else:
                job.failed.extend(e.block_ids)
        self._free.extend(b.slots)
        job.open -= len(b.entries)
        if job.open == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._jobs.pop(job.job_id, None)
        self._finished.append(JobResult(
            job.job_id, job.is_load, not job.failed, tuple(job.ok_keys), tuple(job.failed),
            job.nbytes, max(0.0, self._clock() - job.t0)))

    # ----------------------------------------------------------------------------- blocking
    def _settled(self, job_ids: Iterable[int]) -> bool:
        """True when none of `job_ids` touches its KV blocks any more: loads finished, stores
        copied out (their values may still be on the way to the cluster)."""
        for j in job_ids:
            job = self._jobs.get(j)
            if job is not None and (job.open if job.is_load else job.uncopied):
                return False
        return True

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """BLOCKING: until the listed jobs no longer touch their KV blocks (see `_settled`);
        unknown or finished ids are ignored. False if that took longer than `timeout`."""
        ids = list(job_ids)
        return self._wait_until(lambda: self._settled(ids), timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """BLOCKING: until every submitted job has finished (its result waits in `poll`). False
        if that took longer than `timeout`."""
        return self._wait_until(lambda: not self._jobs, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            if done():
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._block(left)

    def _block(self, left: float | None) -> None:
        """Wait for the next thing that can make progress: the oldest copy, or any I/O."""
        if self._copying:
            self._copying[0].fence.wait()  # type: ignore[union-attr]
        else:
            self._store.wait_any(0.05 if left is None else min(0.05, left))

    def prioritize(self, job_ids: Iterable[int]) -> None:
        """Move the listed jobs' unstarted entries ahead of every other job's (someone waits for
        them). Unknown ids are ignored."""
        ids = set(job_ids)
        for q in self._queues.values():
            first = [j for j in q if j.job_id in ids]
            if first:
                rest = [j for j in q if j.job_id not in ids]
                q.clear()
                q.extend(first + rest)

    def abandon(self, job_ids: Iterable[int]) -> None:
        """Give up on the listed jobs' remaining work, after a `wait` that timed out: entries not
        started fail, and a load writes none of its blocks once its values arrive (its caller
        reuses them). Copies already issued to a device still run. The jobs still finish through
        `poll`, with the given-up blocks failed."""
        for j in job_ids:
            job = self._jobs.get(j)
            if job is None:
                continue
            job.abandoned = True
            if not job.pending:
                continue
            q = self._queues[job.is_load]
            if job in q:
                q.remove(job)
            n = len(job.pending)
            job.failed.extend(b for e in job.pending for b in e.block_ids)
            job.pending.clear()
            job.open -= n
            if not job.is_load:
                job.uncopied -= n
            if job.open == 0:
                self._finish(job)

    def has_pending_jobs(self) -> bool:
        return bool(self._jobs or self._finished)

    def close(self, timeout: float = 10.0) -> None:
        """BLOCKING: finish what is running (up to `timeout`), then release the scratch and close
        the block store. Idempotent; later jobs complete failed."""
        if self._closed:
            return
        self.drain(timeout)
        self._closed = True
        # Jobs still open (a server that did not answer within `timeout`) complete failed.
        for job in list(self._jobs.values()):
            for b in [*self._io.values(), *self._copying]:
                if b.job is job:
                    job.failed.extend(blk for e in b.entries for blk in e.block_ids)
            job.failed.extend(blk for e in job.pending for blk in e.block_ids)
            self._finish(job)
        self._io.clear()
        self._copying.clear()
        self.mover.close()
        self._store.close(timeout)
