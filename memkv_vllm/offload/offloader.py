"""`KVOffloader`: moves KV blocks between paged KV tensors and a memkv cluster, one value per block.

A store job gathers each entry's blocks into a scratch slot (movers.py), and once the copy's fence
has passed hands the slots to the `Offloader` (memkv_vllm.core.store.BlockStore) as one value each.
A
load job reads values into scratch slots, then scatters the ones that arrived to their blocks. The
KV tensors are never written by the network: a value that fails (evicted, server gone, timeout,
wrong length) leaves its blocks untouched and is reported in `JobResult.failed_block_ids`, for the
caller to recompute. Nothing here raises once a job is accepted.

Jobs are cut into batches of `batch_values` values, so that the network sends the first batch while
the copy engines gather the next. Scratch is a fixed pool of slots; entries wait for free slots
(loads before stores) instead of allocating.

Threads: the pipeline advances on two progress threads of its own, not when the caller polls, so a
vLLM worker that calls `poll` once per step still gets a gather's values onto the network as soon
as the copy ends and a load's scatter started as soon as its values arrived:

* the copy thread waits for the oldest copy's CUDA event (a blocking-sync event: the thread sleeps
  in the driver, it does not spin on a core the engine needs), then hands the batch on;
* the I/O thread sleeps in `BlockStore.wait_any` while values are on the network, then takes the
  finished I/O and starts the scatters and the next batches.

Every piece of state, the `BlockStore` and the mover included, is touched only under one lock (the
rule is spelled out on `KVOffloader`), held for a few bookkeeping steps and copy launches and never
while waiting, so the store still sees one caller at a time (its contract) and `submit_*` / `poll`
never wait for the network. `submit_*` gathers the first batches on the caller's thread (no thread
hop before the first copy); `wait`, `drain` and `close` block. No vLLM imports; torch is imported
by the movers.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from memkv_vllm.core.interface import Completion, DirectOffloader
from memkv_vllm.offload.movers import Fence, make_mover
from memkv_vllm.offload.paged import Entry, PagedKV

logger = logging.getLogger(__name__)

_SLOT_ALIGN = 4096  # slots start on page boundaries: friendlier to DMA and to future RDMA
# How long the I/O thread sleeps in one BlockStore.wait_any: a completion wakes it at once, this
# only bounds how late it notices close().
_IO_WAIT_S = 0.2


@attrs.frozen
class MappedBatches:
    """How loads in place are cut: at most `values` values and `nbytes` bytes per batch (one
    GET_MAPPED each, at least one value), and `in_flight` batches at once. No scratch bounds
    them, so these do: what the server holds pinned for this offloader (`nbytes * in_flight`,
    1 GiB at most by default, well inside its lanes' bound on pinned bytes), and the
    scatters queued on the GPU."""

    values: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    nbytes: int = attrs.field(default=64 << 20, validator=attrs.validators.ge(1))
    # 16, not 8: on the H200 host, 8 streamed loads of 256 2-MiB values reached 59-74% of the
    # pinned copy with 8 batches in flight and 71-81% with 16 (benchmarks/offload_gpu.py
    # --mapped): a batch waits on the server's verification before its place frees up.
    in_flight: int = attrs.field(default=16, validator=attrs.validators.ge(1))


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
    # A load in place (`mapped`): no slots; its values are scattered straight out of the
    # server's memory, then its pins are released (`releasing`) before it settles.
    mapped: bool = False
    tickets: tuple[int, ...] = ()
    releasing: bool = False


@attrs.define(eq=False)
class _Arrived:
    """A load batch whose values arrived: `entries` to scatter from `sources` (scratch slots, or
    for a load in place the values' addresses in the server's memory)."""

    batch: _Batch
    entries: list[Entry]
    sources: list[int]


class KVOffloader:
    """Block-granular KV offloading over an `Offloader`; owns `store` (closes it, and is the only
    caller of it from now on).

    The lock rule: every read or write of the shared state (the job table, the queues, the free
    slots, the batches copying or on the network, the finished results, the closed flags) and
    every call into the store or the mover happens while holding `self._changed`, and every
    change a waiter may be waiting for ends with `notify_all` under it. The public methods take
    it; the private helpers whose docstring starts with "Under the lock" require the caller to
    hold it. Outside it are only:

    * what `__init__` fixes before the progress threads start and nothing changes later
      (geometry, slot size, `mover.io`'s base address, the thread list);
    * waiting that changes nothing the lock guards: a copy's fence (taken from the batch under the
      lock) and `BlockStore.wait_any`, which reads only what the store guards itself;
    * `close`'s release of the mover and the store once `_stopping` is set: from then on the
      progress threads return before touching either, and new jobs fail unstarted, so `close` is
      their only caller and may block in them without blocking the lock.
    """

    def __init__(self, kv: PagedKV, store: DirectOffloader, medium: str = "auto",
                 scratch_bytes: int = 256 << 20, batch_values: int = 4,
                 clock: Callable[[], float] = time.monotonic, copy_method: str = "auto",
                 copy_programs: int = 32, device_io: bool = False,
                 mapped_reads: bool = True, mapped_batches: MappedBatches | None = None) -> None:
        """`medium` as `make_mover` (`auto` = host); `device_io`: the store's transport reads
        and writes GPU memory (RDMA with FI_HMEM), so `gpu` scratch slots go to the network
        themselves instead of through pinned host slots. `mapped_reads`: load in place, out of
        same-host servers' memory, where every server shares it (`DirectOffloader.mapped_reads`;
        host scratch only), cut as `mapped_batches` says (default `MappedBatches()`)."""
        self.kv, self._store, self._clock = kv, store, clock
        self.slot_bytes = -(-kv.max_value_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        n_slots = scratch_bytes // self.slot_bytes
        if n_slots < 1:
            raise ValueError(f"scratch of {scratch_bytes} bytes cannot hold one "
                             f"{kv.max_value_bytes}-byte value")
        self.mover = make_mover(kv, n_slots, self.slot_bytes, medium, copy_method,
                                copy_programs, device_io)
        self.medium = self.mover.medium
        self.n_slots = n_slots
        self.batch_values = max(1, batch_values)
        io = self.mover.io  # the slots the network reads and writes: host, or GPU with device_io
        self._io_base = int(io.data_ptr())
        self.device_io = bool(getattr(io, "is_cuda", False))
        store.register_buffer(self._io_base, n_slots * self.slot_bytes, owner=io)
        self.mapped, self.mapped_reason = False, "off"
        if mapped_reads and self.medium == "host":
            why = store.mapped_reads(self.mover.register_host, self.mover.unregister_host)
            self.mapped = why is None
            self.mapped_reason = "on" if why is None else f"off ({why})"
        self._cut = mapped_batches or MappedBatches()
        self._mapped_open = 0  # mapped batches not settled
        self._free = list(range(n_slots - 1, -1, -1))
        self._queues: dict[bool, collections.deque[_Job]] = {
            True: collections.deque(), False: collections.deque()}
        self._jobs: dict[int, _Job] = {}
        self._copying: collections.deque[_Batch] = collections.deque()  # in stream order
        self._io: dict[int, _Batch] = {}
        self._io_ids = 0
        self._finished: list[JobResult] = []
        self._closed = False  # new jobs fail unstarted
        self._stopping = False  # the progress threads return; the store and mover are close's
        # One lock for all state (the class's lock rule); `_changed` also wakes the progress
        # threads and the blocking calls.
        self._changed = threading.Condition(threading.Lock())
        self._threads = [threading.Thread(target=fn, name=f"memkv-offload-{name}", daemon=True)
                         for name, fn in (("copies", self._copy_loop), ("io", self._io_loop))]
        for t in self._threads:
            t.start()

    def describe(self) -> str:
        """One line for a startup log."""
        io = ("the network reads and writes them" if self.device_io else
              "staged through pinned host slots" if self.medium == "gpu" else "")
        return (f"value {self.kv.max_value_bytes} B, {self.n_slots} scratch slots of "
                f"{self.slot_bytes} B ({self.n_slots * self.slot_bytes >> 20} MiB), "
                f"medium {self.medium}{f' ({io})' if io else ''}, {self.mover.scratch_reason}, "
                f"copies by {self.mover.method}, {self.batch_values} values per batch, "
                f"loads in place {self.mapped_reason}")

    # ----------------------------------------------------------------------------- submit
    def submit_store(self, job_id: int, entries: Sequence[Entry]) -> None:
        """Start copying `entries`' blocks out and storing them. Non-blocking."""
        self._submit(False, job_id, entries)

    def submit_load(self, job_id: int, entries: Sequence[Entry]) -> None:
        """Start reading `entries` and writing them into their blocks. Non-blocking."""
        self._submit(True, job_id, entries)

    def _submit(self, is_load: bool, job_id: int, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.kv.check(e)
        with self._changed:
            if job_id in self._jobs:
                raise ValueError(f"job {job_id} is already running")
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
            self._advance()

    def _fail_unstarted(self, job: _Job) -> None:
        """Under the lock: finish a job none of whose entries started, every block failed."""
        job.failed = [b for e in job.pending for b in e.block_ids]
        job.pending.clear()
        job.open = job.uncopied = 0
        self._finish(job)

    # ----------------------------------------------------------------------------- progress
    def poll(self) -> list[JobResult]:
        """Finished jobs, each exactly once. Never blocks on the pipeline: it advances by itself."""
        with self._changed:
            done, self._finished = self._finished, []
        return done

    def _advance(self) -> None:
        """Under the lock: take finished I/O and copies, start what slots allow, one batch at a
        time (a batch whose copy ended while the next one was launched goes to the network
        before the launch after). Wakes waiters."""
        while True:
            progressed = False
            arrived: list[_Arrived] = []
            for c in self._store.poll():  # also the jobs a submit finished at once (shed, ...)
                batch = self._io.pop(c.job_id, None)
                if batch is not None:
                    self._io_done(batch, c, arrived)
                    progressed = True
            self._scatter(arrived)
            while self._copying and self._copying[0].fence.done():  # type: ignore[union-attr]  # set before queued
                self._copied(self._copying.popleft())
                progressed = True
            progressed = self._start_next() or progressed
            if not progressed:
                break
        self._changed.notify_all()

    def _copy_loop(self) -> None:
        """Progress thread: sleep on the oldest copy's event, then advance."""
        while True:
            with self._changed:
                while not self._copying and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                batch = self._copying[0]
                fence = batch.fence
            try:
                fence.wait()  # type: ignore[union-attr]  # set before queued; outside the lock, no GIL
            except Exception as e:  # a failed copy fails its batch, never this thread
                with self._changed:
                    if self._stopping:  # close fails the batch and owns the mover now
                        return
                    if self._copying and self._copying[0] is batch:
                        self._copying.popleft()
                        self._copy_failed(batch, e)
                    self._advance_logged()
                continue
            with self._changed:
                if self._stopping:
                    return
                self._advance_logged()

    def _io_loop(self) -> None:
        """Progress thread: sleep in the store until some I/O finished, then advance."""
        while True:
            with self._changed:
                while not self._io and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
            if self._store.wait_any(_IO_WAIT_S):  # outside the lock: it only waits
                with self._changed:
                    if self._stopping:  # close owns the store now
                        return
                    self._advance_logged()

    def _advance_logged(self) -> None:
        """Under the lock: `_advance` on a progress thread. An unexpected error is logged and the
        thread lives on (the work it hit stays queued for the next wake-up; the caller's timeouts
        still apply)."""
        try:
            self._advance()
        except Exception:
            logger.exception("memkv offload: progress step failed")

    def _start_next(self) -> bool:
        """Under the lock: start the next batch if a slot is free; False if none started."""
        for is_load in (True, False):  # loads first: a request waits for them
            q = self._queues[is_load]
            if q and is_load and self.mapped:
                if self._mapped_open >= self._cut.in_flight:
                    continue
                job = q[0]
                entries: list[Entry] = []
                nbytes = 0
                while job.pending and len(entries) < self._cut.values and (
                        not entries
                        or nbytes + self.kv.value_bytes[job.pending[0].group] <= self._cut.nbytes):
                    e = job.pending.popleft()
                    entries.append(e)
                    nbytes += self.kv.value_bytes[e.group]
                if not job.pending:
                    q.popleft()
                self._mapped_open += 1
                self._start(_Batch(job, entries, [], mapped=True))
                return True
            if q and self._free:
                job = q[0]
                n = min(self.batch_values, len(self._free), len(job.pending))
                entries = [job.pending.popleft() for _ in range(n)]
                slots = [self._free.pop() for _ in range(n)]
                if not job.pending:
                    q.popleft()
                self._start(_Batch(job, entries, slots))
                return True
        return False

    def _ptrs(self, b: _Batch) -> list[int]:
        """The batch's slots as addresses the store reads and writes."""
        return [self._io_base + s * self.slot_bytes for s in b.slots]

    def _sizes(self, b: _Batch) -> list[int]:
        """The value size of each of the batch's entries."""
        return [self.kv.value_bytes[e.group] for e in b.entries]

    def _start(self, b: _Batch) -> None:
        """Under the lock: a load's batch goes to the network, a store's to the gather."""
        if b.job.is_load:
            self._submit_io(b)
            return
        try:
            b.fence = self.mover.gather(b.entries, b.slots, b.job.ready)
        except Exception as e:
            self._copy_failed(b, e)
            return
        self._copying.append(b)

    def _copy_failed(self, b: _Batch, e: Exception) -> None:
        """Under the lock: a gather or scatter that could not run fails its batch."""
        logger.warning("memkv offload: %s for job %d failed: %s",
                       "scatter" if b.job.is_load else "gather", b.job.job_id, e)
        if b.mapped:
            b.ok = [False] * len(b.entries)
            self._release(b)
            return
        if not b.job.is_load:
            b.job.uncopied -= len(b.entries)
        self._settle(b, [False] * len(b.entries))

    def _submit_io(self, b: _Batch) -> None:
        """Under the lock: hand the batch's slots to the store."""
        self._io_ids += 1
        self._io[self._io_ids] = b
        keys = [e.key for e in b.entries]
        if b.releasing:
            self._store.submit_release(self._io_ids, b.tickets)
        elif b.mapped:
            self._store.submit_load_mapped(self._io_ids, keys, self._sizes(b))
        elif b.job.is_load:
            self._store.submit_load(self._io_ids, keys, self._ptrs(b), self._sizes(b))
        else:
            self._store.submit_store(self._io_ids, keys, self._ptrs(b), self._sizes(b))

    def _release(self, b: _Batch) -> None:
        """Under the lock: a load in place is done reading the server's memory; its pins go,
        and it settles once the servers said they held them (else its blocks hold unknown
        bytes: failed)."""
        b.releasing = True
        if b.tickets:
            self._submit_io(b)
            return
        self._settle_mapped(b, b.ok)

    def _settle_mapped(self, b: _Batch, ok: Sequence[bool]) -> None:
        """Under the lock: a load in place is over; its place among those in flight is free."""
        self._mapped_open -= 1
        self._settle(b, ok)

    def _copied(self, b: _Batch) -> None:
        """Under the lock: the batch's gather or scatter has passed its fence."""
        if b.mapped:  # scattered out of the server's memory: let its pins go
            self._release(b)
        elif b.job.is_load:  # scattered: the blocks hold the values
            self._settle(b, b.ok)
        else:  # gathered: the blocks are free again, the values go out
            b.job.uncopied -= len(b.entries)
            self._submit_io(b)

    def _io_done(self, b: _Batch, c: Completion, arrived: list[_Arrived]) -> None:
        """Under the lock: the store finished the batch's values; a load's that arrived (none
        once its job is abandoned) join `arrived`, the batches `_scatter` writes into their
        blocks; a store settles."""
        if b.mapped:
            self._mapped_done(b, c, arrived)
            return
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
        arrived.append(_Arrived(b, [b.entries[i] for i in good], [b.slots[i] for i in good]))

    def _scatter(self, arrived: list[_Arrived]) -> None:
        """Under the lock: one scatter per job for its batches whose values arrived in the
        same poll, ordered after the caller's stream by the job's own ready marker. A
        launch costs the host 0.1-0.3 ms (more while other threads want the GIL), as much as
        the copy of a 4-value batch itself, and a job's operations complete close together
        (they share the connections): one launch instead of one per batch brings the last
        values into their blocks sooner. The batches of a launch share its fence."""
        launches: dict[_Job, list[_Arrived]] = {}
        for a in arrived:
            launches.setdefault(a.batch.job, []).append(a)
        for job, group in launches.items():
            entries = [e for a in group for e in a.entries]
            sources = [x for a in group for x in a.sources]
            try:  # a job's loads are all in place or all through slots (`self.mapped`)
                fence = (self.mover.scatter_from(entries, sources, job.ready)
                         if group[0].batch.mapped
                         else self.mover.scatter(entries, sources, job.ready))
            except Exception as e:
                for a in group:
                    self._copy_failed(a.batch, e)
                continue
            for a in group:
                a.batch.fence = fence
                self._copying.append(a.batch)

    def _mapped_done(self, b: _Batch, c: Completion, arrived: list[_Arrived]) -> None:
        """Under the lock: a load in place got its addresses (it joins `arrived`, to scatter out
        of them, then release), or its release's answer (settle)."""
        if b.releasing:
            self._settle_mapped(b, b.ok if c.ok else [False] * len(b.entries))
            return
        at = dict(zip(c.ok_keys, c.addresses, strict=True))
        b.tickets = c.tickets
        b.ok = [e.key in at and not b.job.abandoned for e in b.entries]
        good = [e for e, k in zip(b.entries, b.ok, strict=True) if k]
        if not good:
            self._release(b)
            return
        arrived.append(_Arrived(b, good, [at[e.key] for e in good]))

    def _settle(self, b: _Batch, ok: Sequence[bool]) -> None:
        """Under the lock: account the batch's entries, free its slots, finish a job left with
        no open entry."""
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
        """Under the lock: the job's one result goes to `poll`; wakes the waiters."""
        self._jobs.pop(job.job_id, None)
        self._finished.append(JobResult(
            job.job_id, job.is_load, not job.failed, tuple(job.ok_keys), tuple(job.failed),
            job.nbytes, max(0.0, self._clock() - job.t0)))
        self._changed.notify_all()

    # ----------------------------------------------------------------------------- blocking
    def _settled(self, job_ids: Iterable[int]) -> bool:
        """Under the lock: True when none of `job_ids` touches its KV blocks any more: loads
        finished, stores copied out (their values may still be on the way to the cluster)."""
        for j in job_ids:
            job = self._jobs.get(j)
            if job is not None and (job.open if job.is_load else job.uncopied):
                return False
        return True

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """BLOCKING: until the listed jobs no longer touch their KV blocks (see `_settled`);
        unknown or finished ids are ignored. False if that took longer than `timeout`."""
        ids = list(job_ids)
        with self._changed:
            return self._changed.wait_for(lambda: self._settled(ids), timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """BLOCKING: until every submitted job has finished (its result waits in `poll`). False
        if that took longer than `timeout`."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs, timeout)

    def prioritize(self, job_ids: Iterable[int]) -> None:
        """Move the listed jobs' unstarted entries ahead of every other job's (someone waits for
        them). Unknown ids are ignored. Starts nothing: a free slot would have been taken."""
        ids = set(job_ids)
        with self._changed:
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
        `poll`, with the given-up blocks failed: at once when nothing of them was in flight.
        Unknown or finished ids are ignored."""
        with self._changed:
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
            self._changed.notify_all()  # a store no longer reading its blocks is settled

    def has_pending_jobs(self) -> bool:
        with self._changed:
            return bool(self._jobs or self._finished)

    def close(self, timeout: float = 10.0) -> None:
        """BLOCKING: finish what is running (up to `timeout`), then release the scratch and close
        the block store. Idempotent; later jobs complete failed."""
        with self._changed:
            if self._closed:
                return
        self.drain(timeout)
        with self._changed:
            if self._closed:  # a concurrent close got here first and releases everything
                return
            self._closed = self._stopping = True
            self._changed.notify_all()
        for t in self._threads:
            t.join(timeout=2 * _IO_WAIT_S + 1.0)
        with self._changed:
            # Jobs still open (a server that did not answer within `timeout`) complete failed.
            for job in list(self._jobs.values()):
                for b in [*self._io.values(), *self._copying]:
                    if b.job is job:
                        job.failed.extend(blk for e in b.entries for blk in e.block_ids)
                job.failed.extend(blk for e in job.pending for blk in e.block_ids)
                self._finish(job)
            self._io.clear()
            self._copying.clear()
        # The store first: once it is closed no transfer of its own reads or writes the scratch,
        # which the mover then unpins and unmaps.
        self._store.close(timeout)
        self.mover.close()
