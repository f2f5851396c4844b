"""`BlockStore`: the memkv implementation of `memkv_vllm.core.interface.Offloader` (and of
`DirectOffloader`, what direct mode adds to it).

The contract (callers, threads, post-conditions, failures) is written down in interface.py; this
module only adds how memkv meets it:

* Lookups answer from a bounded verdict cache (`max_verdicts`, oldest entries go first); unknown
  keys are queued and `flush_lookups()` sends them as one `submit_exists` per server (ONE where
  the client does not say where keys live) with a server lease, so a hit survives until its
  load, and a silent server's deadline costs only its own keys. Verdicts expire (`hit_ttl_s`,
  `miss_ttl_s`). `renew_leases` sends the same probe again for keys about to load; its answers
  are read at the next flush.
* Jobs are cut into operations of `blocks_per_op` keys, each submitted to the client's
  asynchronous batched calls (`AsyncBlockClient`: the native client's I/O threads) with a tag
  announcing its completion on one completion queue. At most `n_read_threads` load and
  `n_write_threads` store operations are in flight (the rest wait, per direction, in submit
  order), so a store backlog never takes a load's place. Data goes straight between registered
  caller memory and the cluster (no Python copies).
* One harvester thread waits on the queue (GIL released), collects each finished operation
  without blocking, submits the next waiting ones and hands finished jobs back through a queue,
  read by `poll()`; no Python thread per operation. A client with blocking transfers only (a
  plain `BlockClient`) is run on a pool of `n_read_threads + n_write_threads + 1` threads
  (`PooledBlockClient`), as the store's own I/O threads did before.
* State (verdicts, backlog, stats, buffers) is only mutated on the owner thread.
* All timing uses the injected `clock` (tests drive it by hand); no vLLM imports.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from memkv_vllm.core.completions import PooledBlockClient
from memkv_vllm.core.interface import (
    AsyncBlockClient,
    BlockClient,
    Completion,
    Lookup,
    MappedReadClient,
    RegisteringClient,
    ShardedClient,
    Status,
)

__all__ = ["BlockStore", "Completion", "Lookup", "StoreOptions"]

logger = logging.getLogger(__name__)

@attrs.define
class StoreOptions:
    # Load / store operations (of `blocks_per_op` keys) in flight at once, per direction (the
    # names are those of the tier keys; the store no longer runs a thread per operation).
    n_read_threads: int = 8
    n_write_threads: int = 8
    blocks_per_op: int = 8
    lookup_timeout_s: float = 5.0
    max_store_backlog_bytes: int = 2048 << 20
    # Verdict lifetimes. A HIT may be evicted remotely later (the load then fails and the key turns
    # MISS); a MISS is re-probed soon because another engine may store the block meanwhile.
    hit_ttl_s: float = 30.0
    miss_ttl_s: float = 1.0
    failed_load_miss_ttl_s: float = 30.0  # long enough to stop re-promoting a key that fails
    lookup_lease_ms: int = 5000  # server pins probed hits this long: covers lookup -> load
    max_verdicts: int = 1 << 18


@attrs.define(eq=False)
class _Buffer:
    ptr: int
    nbytes: int
    owner: object
    jobs: int = 0  # submitted jobs addressing it whose completion poll() has not returned yet


@attrs.define(eq=False)
class _TransferJob:
    job_id: int
    is_load: bool
    keys: list[bytes]
    ptrs: list[int]
    sizes: list[int]
    buffers: list[_Buffer]
    t0: float
    skipped: tuple[bytes, ...] = ()  # keys of a store already known to be remote
    statuses: list[int] = attrs.Factory(list)
    remaining: int = 0
    t_done: float = 0.0
    # "transfer"; "mapped": a load in place (addresses and tickets come back); "release": the
    # end of mapped reads' pins, one entry (and one operation) per ticket of `tickets`.
    kind: str = "transfer"
    addresses: list[int] = attrs.Factory(list)
    tickets: list[int] = attrs.Factory(list)


@attrs.define(eq=False)
class _Range:
    """One submitted operation: keys [lo, hi) of `job`, or (job None) a delete of `keys`."""

    job: _TransferJob | None
    lo: int = 0
    hi: int = 0
    keys: list[bytes] = attrs.Factory(list)
    op: Any = None


@attrs.define(eq=False)
class _Probe:
    op: Any
    keys: list[bytes]
    deadline: float


class BlockStore:
    """Batched, asynchronous, never-raising block I/O against a memkv cluster.

    Implements `memkv_vllm.core.interface.Offloader`; read the contract there. `client` may be None
    (no cluster could be configured): every lookup then misses and every job fails at once.
    """

    def __init__(
        self,
        client: BlockClient | None,
        options: StoreOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        # Asked once: a runtime Protocol check costs microseconds, the flush runs every step.
        self._sharded = isinstance(client, ShardedClient)
        self.options = opts = options or StoreOptions()
        self._clock = clock
        # key -> (verdict, expiry); insertion-ordered so the oldest entries go first when full.
        self._verdicts: collections.OrderedDict[bytes, tuple[Lookup, float]] = (
            collections.OrderedDict()
        )
        self._queued: dict[bytes, None] = {}  # keys to probe at the next flush (ordered set)
        self._probing: dict[bytes, _Probe] = {}
        self._probes: list[_Probe] = []
        self._renewals: list[tuple[Any, list[bytes]]] = []  # (lease-renewing probe, its keys)
        self._buffers: dict[int, _Buffer] = {}
        self._done: queue.SimpleQueue[_TransferJob] = queue.SimpleQueue()
        self._ready: list[tuple[Completion, list[_Buffer]]] = []  # finished without I/O
        self._store_backlog = 0
        self._store_bytes_by_job: dict[int, int] = {}
        self._inflight = 0
        self._cv = threading.Condition()
        self._stats: collections.Counter[str] = collections.Counter()
        self._closed = False
        # Operations: the ones waiting for a slot per direction (True: loads), the number in
        # flight per direction, and every submitted one by tag (deletes too). Guarded by _cv.
        self._waiting: dict[bool, collections.deque[_Range]] = {
            True: collections.deque(), False: collections.deque()}
        self._running = {True: 0, False: 0}
        self._limit = {True: max(1, opts.n_read_threads), False: max(1, opts.n_write_threads)}
        self._ops: dict[int, _Range] = {}
        self._tags = 0
        self._pooled: PooledBlockClient | None = None
        self._io: AsyncBlockClient | None = None
        self._harvester: threading.Thread | None = None
        self._queue: Any = None  # the completion queue of self._io's operations
        if client is not None:
            if isinstance(client, AsyncBlockClient):
                self._io = client
            else:
                self._pooled = PooledBlockClient(client, self._limit[True] + self._limit[False] + 1)
                self._io = self._pooled
            self._queue = self._io.completion_queue()
            self._harvester = threading.Thread(target=self._harvest_loop, name="memkv-harvest",
                                               daemon=True)
            self._harvester.start()

    # ----------------------------------------------------------------------------- buffers
    def register_buffer(self, ptr: int, nbytes: int, owner: object = None) -> None:
        ptr, nbytes = int(ptr), int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"buffer of {nbytes} bytes")
        for b in self._buffers.values():
            if ptr < b.ptr + b.nbytes and b.ptr < ptr + nbytes:
                raise ValueError(f"buffer {ptr:#x}+{nbytes} overlaps the one at {b.ptr:#x}")
        if isinstance(self._client, RegisteringClient):
            self._client.register_buffer(ptr, nbytes)
        self._buffers[ptr] = _Buffer(ptr, nbytes, owner)

    def unregister_buffer(self, ptr: int) -> None:
        b = self._buffers.get(int(ptr))
        if b is None:
            raise ValueError(f"no buffer registered at {int(ptr):#x}")
        if b.jobs:
            raise ValueError(f"buffer at {b.ptr:#x} still has {b.jobs} uncompleted job(s)")
        del self._buffers[b.ptr]
        if isinstance(self._client, RegisteringClient):
            self._client.unregister_buffer(b.ptr)

    def _checked(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> tuple[list[int], list[int], list[_Buffer | None]]:
        """`ptrs` and `sizes` as ints, and the registered buffer each range falls in (None for
        all once closed: the job then completes failed without I/O). ValueError for lists of
        different lengths or a range outside every registered buffer."""
        if not len(keys) == len(ptrs) == len(sizes):
            raise ValueError(f"{len(keys)} keys, {len(ptrs)} pointers, {len(sizes)} sizes")
        ptrs, sizes = [int(p) for p in ptrs], [int(s) for s in sizes]
        if self._closed:
            return ptrs, sizes, [None] * len(ptrs)
        return ptrs, sizes, [self._buffer_of(p, n) for p, n in zip(ptrs, sizes, strict=True)]

    def _buffer_of(self, p: int, n: int) -> _Buffer:
        for b in self._buffers.values():
            if b.ptr <= p and p + n <= b.ptr + b.nbytes and n >= 0:
                return b
        raise ValueError(f"memory {p:#x}+{n} is not inside a registered buffer")

    # ----------------------------------------------------------------------------- lookups
    def lookup(self, key: bytes) -> Lookup:
        now = self._clock()
        v = self._verdicts.get(key)
        if v is not None:
            if v[1] > now:
                self._stats["lookup_" + v[0].value] += 1
                return v[0]
            del self._verdicts[key]
        if key in self._probing:
            self._harvest(now)
            v = self._verdicts.get(key)
            if v is not None:
                self._stats["lookup_" + v[0].value] += 1
                return v[0]
        else:
            self._queued[key] = None
        self._stats["lookup_pending"] += 1
        return Lookup.PENDING

    def cancel_lookups(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            if self._queued.pop(k, 0) is None:
                self._stats["lookups_cancelled"] += 1

    def flush_lookups(self) -> None:
        now = self._clock()
        self._harvest(now)
        self._harvest_renewals()
        if not self._queued:
            return
        keys = list(self._queued)
        self._queued.clear()
        self._stats["probes"] += 1
        self._stats["probe_keys"] += len(keys)
        for group in self._probe_groups(keys):
            self._probe(group, now)

    def _probe_groups(self, keys: list[bytes]) -> list[list[bytes]]:
        """One group per server where the client says where keys live (`ShardedClient`): each
        group's probe meets the lookup deadline on its own, so a partitioned server turns only its
        own keys into misses and the other servers' hits arrive when they answer."""
        if self._sharded:
            try:
                return self._client.by_server(keys)  # type: ignore[union-attr]  # ShardedClient
            except Exception as e:  # placement is pure; still, one probe beats no probe
                logger.warning("memkv: grouping %d keys by server failed (%s)", len(keys), e)
        return [keys]

    def _probe(self, keys: list[bytes], now: float) -> None:
        op = None
        if self._client is not None:
            try:
                op = self._client.submit_exists(keys, lease_ms=self.options.lookup_lease_ms)
            except Exception as e:  # a broken client is a miss, never an engine failure
                logger.warning("memkv exists probe failed to start (%s); treating as misses", e)
        if op is None:
            self._stats["lookup_errors"] += len(keys)
            for k in keys:
                self._set(k, Lookup.MISS, now + self.options.miss_ttl_s)
            return
        probe = _Probe(op, keys, now + self.options.lookup_timeout_s)
        self._probes.append(probe)
        for k in keys:
            self._probing[k] = probe

    def mark_missing(self, keys: Sequence[bytes]) -> None:
        """MISS for `failed_load_miss_ttl_s` (see `DirectOffloader.mark_missing`)."""
        self._mark_missing(keys)

    def renew_leases(self, keys: Sequence[bytes]) -> None:
        """One probe with the lookup lease (see `DirectOffloader.renew_leases`)."""
        if self._client is None or self.options.lookup_lease_ms <= 0 or not keys:
            return
        keys = list(keys)
        try:
            op = self._client.submit_exists(keys, lease_ms=self.options.lookup_lease_ms)
        except Exception as e:  # the load may still succeed: the lookup's lease may hold
            logger.warning("memkv: renewing the leases of %d values failed: %s", len(keys), e)
            return
        self._stats["lease_renewals"] += len(keys)
        self._renewals.append((op, keys))

    def _harvest_renewals(self) -> None:
        """A renewal that did not find a value means its load will fail: later lookups of that
        key should miss instead of leading to the same failed load."""
        still_open = []
        for op, keys in self._renewals:
            try:
                if not op.done():
                    still_open.append((op, keys))
                    continue
                codes = op.wait(0)
            except Exception as e:
                logger.warning("memkv: lease renewal failed: %s", e)
                codes = None
            if codes is None or len(codes) != len(keys):
                lost = keys
            else:
                lost = [k for k, c in zip(keys, codes, strict=True) if not Status.is_ok(c)]
            self._stats["lease_renewals_lost"] += len(lost)
            self._mark_missing(lost)
        self._renewals = still_open

    def _mark_missing(self, keys: Sequence[bytes]) -> None:
        exp = self._clock() + self.options.failed_load_miss_ttl_s
        for k in keys:
            self._set(k, Lookup.MISS, exp)

    def _set(self, key: bytes, verdict: Lookup, expiry: float) -> None:
        self._verdicts[key] = (verdict, expiry)
        self._verdicts.move_to_end(key)
        if len(self._verdicts) > self.options.max_verdicts:
            self._verdicts.popitem(last=False)

    def _harvest(self, now: float) -> None:
        if not self._probes:
            return
        keep: list[_Probe] = []
        for p in self._probes:
            statuses = None
            try:
                if p.op.done():
                    statuses = p.op.wait(0)
            except Exception as e:
                logger.warning("memkv exists probe failed (%s); treating as misses", e)
                statuses = [Status.UNAVAILABLE] * len(p.keys)
            if statuses is None and now < p.deadline:
                keep.append(p)
                continue
            if statuses is None:  # past lookup_timeout_s: a slow cluster is a miss
                self._stats["lookup_timeouts"] += len(p.keys)
                statuses = [Status.TIMEOUT] * len(p.keys)
            elif len(statuses) != len(p.keys):
                logger.warning("memkv exists probe answered %d statuses for %d keys; treating "
                               "as misses", len(statuses), len(p.keys))
                statuses = [Status.PROTOCOL_ERROR] * len(p.keys)
            for k, s in zip(p.keys, statuses, strict=True):
                if self._probing.get(k) is p:
                    del self._probing[k]
                if Status.is_ok(s):
                    self._set(k, Lookup.HIT, now + self.options.hit_ttl_s)
                else:
                    if s not in (Status.NOT_FOUND, Status.TIMEOUT):
                        self._stats["lookup_errors"] += 1
                    self._set(k, Lookup.MISS, now + self.options.miss_ttl_s)
        self._probes = keep

    def has_pending_lookups(self) -> bool:
        return bool(self._queued or self._probes or self._renewals)

    # ----------------------------------------------------------------------------- transfers
    def submit_load(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                    sizes: Sequence[int]) -> None:
        self._submit(True, job_id, list(keys), *self._checked(keys, ptrs, sizes))

    def submit_store(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                     sizes: Sequence[int]) -> None:
        ptrs, sizes, bufs = self._checked(keys, ptrs, sizes)  # before any accounting
        now = self._clock()
        present = [self._known_hit(k, now) for k in keys]
        todo = [i for i, p in enumerate(present) if not p]
        skipped = tuple(k for k, p in zip(keys, present, strict=True) if p)
        self._stats["store_blocks_skipped"] += len(skipped)
        nbytes = sum(sizes[i] for i in todo)
        if todo and self._store_backlog + nbytes > self.options.max_store_backlog_bytes:
            # Shedding drops the newest work: the blocks stay computable, the engine never waits.
            self._stats["store_jobs_shed"] += 1
            self._stats["store_blocks_shed"] += len(todo)
            self._ready.append((Completion(job_id, False, False, skipped, 0, 0.0, shed=True), []))
            return
        self._store_backlog += nbytes
        self._store_bytes_by_job[job_id] = nbytes
        self._submit(False, job_id, [keys[i] for i in todo], [ptrs[i] for i in todo],
                     [sizes[i] for i in todo], [bufs[i] for i in todo], skipped)

    def mapped_reads(self, register: Callable[[int, int], None],
                     unregister: Callable[[int, int], None]) -> str | None:
        """See `DirectOffloader.mapped_reads`."""
        if not isinstance(self._io, MappedReadClient):
            return "the client cannot read in place"
        try:
            why = [w for w in self._io.enable_mapped_reads(register, unregister) if w]
        except Exception as e:  # never fail the engine over an optimisation
            return f"mapping the servers' memory failed: {e}"
        return "; ".join(sorted(set(why))) or None

    def submit_load_mapped(self, job_id: int, keys: Sequence[bytes],
                           sizes: Sequence[int]) -> None:
        n = len(keys)
        sizes = [int(x) for x in sizes]
        if len(sizes) != n:
            raise ValueError(f"{n} keys, {len(sizes)} sizes")
        self._submit(True, job_id, list(keys), [0] * n, sizes, [None] * n, kind="mapped")

    def submit_release(self, job_id: int, tickets: Sequence[int]) -> None:
        t = [int(x) for x in tickets]
        n = len(t)
        self._submit(True, job_id, [b""] * n, [0] * n, [0] * n, [None] * n, kind="release",
                     tickets=t)

    def known_hit(self, key: bytes) -> bool:
        """An unexpired HIT verdict (see `DirectOffloader.known_hit`)."""
        return self._known_hit(key, self._clock())

    def _known_hit(self, key: bytes, now: float) -> bool:
        v = self._verdicts.get(key)
        return v is not None and v[0] is Lookup.HIT and v[1] > now

    def _submit(self, is_load: bool, job_id: int, keys: list[bytes], ptrs: list[int],
                sizes: list[int], per_range: list[_Buffer | None],
                skipped: tuple[bytes, ...] = (), kind: str = "transfer",
                tickets: list[int] | None = None) -> None:
        """Start a job over ranges `_checked` accepted (`per_range`: its buffer per range)."""
        # Each buffer once, in order of first use (dict keys are ordered).
        buffers = list({id(b): b for b in per_range if b is not None}.values())
        for b in buffers:
            b.jobs += 1
        job = _TransferJob(job_id, is_load, keys, ptrs, sizes, buffers, self._clock(), skipped,
                           kind=kind, tickets=tickets or [])
        job.statuses = [Status.UNAVAILABLE] * len(job.keys)
        job.addresses = [0] * len(job.keys) if kind == "mapped" else []
        if kind != "release":
            self._stats["load_jobs" if is_load else "store_jobs"] += 1
        n = len(job.keys)
        if n == 0 or self._client is None or self._closed:
            job.t_done = self._clock()
            self._done.put(job)
            return
        # A load in place is one operation: its caller sized the batch (the server verifies
        # and pins it in one request, and each operation costs a round trip on the connection
        # that holds the pins).
        step = {"release": 1, "mapped": max(1, n)}.get(kind, max(1, self.options.blocks_per_op))
        with self._cv:
            self._inflight += 1
            job.remaining = (n + step - 1) // step
            self._waiting[is_load].extend(_Range(job, i, min(n, i + step))
                                          for i in range(0, n, step))
            self._start(is_load)

    def _start(self, is_load: bool) -> None:
        """Submit waiting operations of one direction while it has free slots (_cv held: the
        harvester must not see a tag before its range knows its op)."""
        waiting = self._waiting[is_load]
        while waiting and self._running[is_load] < self._limit[is_load]:
            r = waiting.popleft()
            job = r.job
            assert job is not None and self._io is not None
            self._tags += 1
            tag = self._tags
            self._ops[tag] = r
            self._running[is_load] += 1
            submit = self._io.submit_get_into_ptrs if is_load else self._io.submit_put_ptrs
            try:
                if job.kind == "mapped":
                    assert isinstance(self._io, MappedReadClient)
                    r.op = self._io.submit_get_mapped(job.keys[r.lo:r.hi],
                                                      job.sizes[r.lo:r.hi], self._queue, tag)
                elif job.kind == "release":
                    assert isinstance(self._io, MappedReadClient)
                    r.op = self._io.submit_release_mapped(job.tickets[r.lo], self._queue, tag)
                else:
                    # `job` holds its registered buffers, and they their owners, until it
                    # completes.
                    r.op = submit(job.keys[r.lo:r.hi], job.ptrs[r.lo:r.hi],
                                  job.sizes[r.lo:r.hi], self._queue, tag)
            except Exception as e:  # a client that cannot start fails these keys, no more
                logger.warning("memkv %s failed to start: %s", "load" if is_load else "store", e)
                del self._ops[tag]
                self._running[is_load] -= 1
                self._finish(r, [Status.UNAVAILABLE] * (r.hi - r.lo))

    def _harvest_loop(self) -> None:
        """The harvester thread: completed operations' tags in, finished jobs out."""
        while True:
            try:
                tags = self._queue.wait(None)
                for tag in tags:
                    self._collect(tag)
            except Exception as e:  # never let the thread die: jobs would hang
                logger.warning("memkv block store: collecting completions failed: %s", e)
            with self._cv:
                if self._closed and not self._ops and not any(self._waiting.values()):
                    return

    def _collect(self, tag: int) -> None:
        with self._cv:
            r = self._ops.pop(tag, None)
        if r is None:
            return
        what = "delete" if r.job is None else "load" if r.job.is_load else "store"
        st: list[int] | None
        try:
            if r.job is not None and r.job.kind == "mapped":
                mres = r.op.wait_mapped(0)
                if mres is None:
                    raise RuntimeError("an operation announced itself before it completed")
                res, addrs, ticket = mres
                if ticket:
                    r.job.tickets.append(int(ticket))
                r.job.addresses[r.lo:r.hi] = [int(a) for a in addrs]
            else:
                res = r.op.wait(0)
            if res is None:
                raise RuntimeError("an operation announced itself before it completed")
            st = [int(c) for c in res]
            want = len(r.keys) if r.job is None else r.hi - r.lo
            if len(st) != want:
                raise RuntimeError(f"client returned {len(st)} statuses for {want} keys")
        except Exception as e:  # a failed (or panicked) operation fails its keys, never hangs
            logger.warning("memkv %s failed: %s", what, e)
            st = None
        if r.job is None:
            if st is not None:
                logger.warning("memkv: deleted %d value(s) of the wrong length (statuses %s)",
                               len(r.keys), sorted(set(st)))
            return
        with self._cv:
            self._running[r.job.is_load] -= 1
            self._finish(r, st if st is not None else [Status.UNAVAILABLE] * (r.hi - r.lo))
            self._start(r.job.is_load)

    def _finish(self, r: _Range, st: list[int]) -> None:
        """Record one operation's statuses (_cv held)."""
        job = r.job
        assert job is not None
        # The client wrote nothing for these keys and will not any more once the operation
        # completed (AsyncBlockClient's memory guarantee), TIMEOUT included: the job can
        # complete now.
        job.statuses[r.lo:r.hi] = st
        job.remaining -= 1
        if job.remaining == 0:
            job.t_done = self._clock()
            self._done.put(job)
            self._inflight -= 1
            self._cv.notify_all()

    def _delete(self, keys: list[bytes]) -> None:
        """Remove values no reader can use (submitted; the harvester logs the outcome). Best
        effort: a failure leaves them to the cluster's eviction."""
        assert self._io is not None
        with self._cv:
            self._tags += 1
            tag = self._tags
            r = self._ops[tag] = _Range(None, keys=keys)
            try:
                r.op = self._io.submit_delete(keys, self._queue, tag)
            except Exception as e:
                del self._ops[tag]
                logger.warning("memkv: deleting %d value(s) of the wrong length failed: %s",
                               len(keys), e)

    def poll(self) -> list[Completion]:
        now = self._clock()
        finished, self._ready = self._ready, []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            finished.append(self._complete(job, now))
        for _, bufs in finished:
            for b in bufs:
                b.jobs -= 1
        return [c for c, _ in finished]

    def _complete(self, job: _TransferJob, now: float) -> tuple[Completion, list[_Buffer]]:
        secs = max(0.0, job.t_done - job.t0)
        if job.kind == "release":
            held = all(s == Status.OK for s in job.statuses)
            if not held:
                self._stats["mapped_pins_lost"] += 1
            return Completion(job.job_id, True, held, (), 0, secs), []
        ok = [Status.is_ok(s) for s in job.statuses]
        ok_keys = [k for k, good in zip(job.keys, ok, strict=True) if good]
        failed = [k for k, good in zip(job.keys, ok, strict=True) if not good]
        nbytes = sum(sz for sz, good in zip(job.sizes, ok, strict=True) if good)
        kind = "load" if job.is_load else "store"
        self._stats[f"{kind}_blocks_ok"] += len(ok_keys)
        self._stats[f"{kind}_blocks_failed"] += len(failed)
        self._stats[f"{kind}_bytes"] += nbytes
        self._stats[f"{kind}_seconds_x1e6"] += int(secs * 1e6)
        if job.is_load:
            if failed:
                # Evicted / gone / server down: never promote these again for a while.
                self._mark_missing(failed)
            bad_length = [k for k, s in zip(job.keys, job.statuses, strict=True)
                          if s == Status.LENGTH_MISMATCH]
            if bad_length and self._client is not None and not self._closed:
                # A value of another length is unusable for every reader of this namespace
                # (vLLM's fs tier likewise deletes a block file that reads short).
                self._stats["load_blocks_deleted"] += len(bad_length)
                self._delete(bad_length)
            gone = tuple(k for k, s in zip(job.keys, job.statuses, strict=True)
                         if s in (Status.NOT_FOUND, Status.LENGTH_MISMATCH))
            addrs = (tuple(a for a, good in zip(job.addresses, ok, strict=True) if good)
                     if job.kind == "mapped" else ())
            c = Completion(job.job_id, True, not failed, tuple(ok_keys), nbytes, secs,
                           gone_keys=gone, addresses=addrs, tickets=tuple(job.tickets))
            return c, job.buffers
        self._store_backlog -= self._store_bytes_by_job.pop(job.job_id, 0)
        exp = now + self.options.hit_ttl_s
        for k in ok_keys:
            self._set(k, Lookup.HIT, exp)
        return (Completion(job.job_id, False, not failed, tuple(ok_keys) + job.skipped,
                           nbytes, secs), job.buffers)

    def drain(self, timeout: float | None = None) -> bool:
        # Real time, not the injected clock: this waits on threads, it does not measure them.
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def wait_any(self, timeout: float) -> bool:
        """BLOCKING, any thread (see `DirectOffloader.wait_any`); `timeout` in real time."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (self._ready or not self._done.empty()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def has_pending_jobs(self) -> bool:
        return bool(self._inflight or self._ready or not self._done.empty())

    def stats(self) -> dict[str, int]:
        s = dict(self._stats)
        s["store_backlog_bytes"] = self._store_backlog
        s["jobs_in_flight"] = self._inflight
        return s

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        drained = self.drain(timeout)
        if not drained:
            logger.warning("memkv block store: I/O still in flight after %.0f s at close", timeout)
        if self._harvester is not None:
            # It ends once no operation is in flight: now if drained, else after the last one.
            self._queue.wake()
            self._harvester.join(timeout=1.0)
        if self._pooled is not None:
            self._pooled.shutdown()
        # No I/O runs any more: registrations end here, and their owners are released (jobs not
        # polled yet still refer to the buffers) so the caller can unmap the memory. I/O still
        # running keeps them: a mapping that outlives its user beats a write into freed memory.
        buffers, self._buffers = list(self._buffers.values()), {}
        if drained:
            for b in buffers:
                b.owner = None
        if isinstance(self._client, RegisteringClient):
            for ptr in (b.ptr for b in buffers):
                try:
                    self._client.unregister_buffer(ptr)
                except Exception as e:
                    logger.warning("memkv block store: unregistering %#x failed: %s", ptr, e)
