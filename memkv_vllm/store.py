"""The block store: the stable internal interface between serving-stack adapters and memkv.

Why it exists: vLLM's tier API changes every few releases, other serving stacks have their own,
and none of that should leak into how blocks move. Adapters (memkv_vllm.tier for vLLM, anything
else later) speak only this interface; it speaks only to `MemKVClient`. No vLLM imports here.

Model:
* Lookups are non-blocking. `lookup(key)` answers from a verdict cache or returns PENDING and
  queues the key; `flush_lookups()` sends everything queued since the last flush as ONE batched
  asynchronous `exists` probe (call it once per scheduler step). A probe unresolved after
  `lookup_timeout_s` answers MISS: a slow cluster must never stall scheduling.
* Loads and stores are jobs over caller memory given as (pointer, size) per key; the caller keeps
  that memory alive and untouched until the job's `Completion` comes out of `poll()`. Data goes
  straight between that memory and the cluster (no Python copies), `blocks_per_op` keys per client
  call. Loads and stores have separate thread pools, so a store backlog never delays a load.
* Nothing here raises on I/O problems: an unreachable server is a miss (lookups), a failed load
  (the caller recomputes) or a dropped store.
* State (verdicts, backlog, stats) is only mutated on the caller's thread; pool threads do I/O
  and hand results back through a queue.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

logger = logging.getLogger(__name__)

# Status codes of memkv_vllm.client.Status, repeated as ints so this module imports without the
# native extension (tests of the interface, other stacks bringing their own client).
_OK, _NOT_FOUND, _UNAVAILABLE, _OK_NO_LEASE, _TIMEOUT = 0, 1, 5, 8, 16


class Lookup(enum.Enum):
    PENDING = "pending"  # probe not answered yet: ask again next step
    HIT = "hit"  # present in the cluster (as of the probe / our own store)
    MISS = "miss"


class BlockClient(Protocol):
    """The subset of memkv_vllm.client.MemKVClient the store uses."""

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> Any: ...
    def get_into_ptrs(
        self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int], owner: object = None
    ) -> list[int]: ...
    def put_ptrs(
        self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int], owner: object = None
    ) -> list[int]: ...


@attrs.frozen
class Completion:
    """One finished job, reported exactly once by `BlockStore.poll()`."""

    job_id: int
    is_load: bool
    ok: bool  # every key transferred
    ok_keys: tuple[bytes, ...]  # keys that transferred (loads: safe to use; stores: now remote)
    nbytes: int  # bytes actually transferred
    seconds: float  # submit -> I/O done
    shed: bool = False  # store dropped unsent because of the backlog limit


@attrs.define
class StoreOptions:
    n_read_threads: int = 8
    n_write_threads: int = 8
    blocks_per_op: int = 8
    lookup_timeout_s: float = 5.0
    load_failure_grace_s: float = 60.0
    # A failed load whose I/O ran at least this long timed out (rather than being refused or
    # answered): its request may still be on the wire, and with server-driven transfers (RDMA) the
    # server could still write into the destination later. Such loads are reported only after
    # `load_failure_grace_s`, so the caller cannot reuse that memory meanwhile. Set it to the
    # client's op timeout.
    load_timeout_s: float = 10.0
    max_store_backlog_bytes: int = 2048 << 20
    # Verdict lifetimes. A HIT may be evicted remotely later (the load then fails and the key turns
    # MISS); a MISS is re-probed soon because another engine may store the block meanwhile.
    hit_ttl_s: float = 30.0
    miss_ttl_s: float = 1.0
    failed_load_miss_ttl_s: float = 30.0  # long enough to stop re-promoting a key that fails
    lookup_lease_ms: int = 5000  # server pins probed hits this long: covers lookup -> load
    max_verdicts: int = 1 << 18


@attrs.define(eq=False)
class _Job:
    job_id: int
    is_load: bool
    keys: list[bytes]
    ptrs: list[int]
    sizes: list[int]
    owner: object
    t0: float
    skipped: tuple[bytes, ...] = ()  # keys of a store already known to be remote
    statuses: list[int] = attrs.Factory(list)
    remaining: int = 0
    t_done: float = 0.0
    timed_out: bool = False  # some op ran into the op timeout (TIMEOUT, or UNAVAILABLE that late)


@attrs.define(eq=False)
class _Probe:
    op: Any
    keys: list[bytes]
    deadline: float


class BlockStore:
    """Batched, asynchronous, never-raising block I/O against a memkv cluster (see module doc)."""

    def __init__(
        self,
        client: BlockClient | None,
        options: StoreOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self.options = opts = options or StoreOptions()
        self._clock = clock
        # key -> (verdict, expiry); insertion-ordered so the oldest entries go first when full.
        self._verdicts: collections.OrderedDict[bytes, tuple[Lookup, float]] = (
            collections.OrderedDict()
        )
        self._queued: dict[bytes, None] = {}  # keys to probe at the next flush (ordered set)
        self._probing: dict[bytes, _Probe] = {}
        self._probes: list[_Probe] = []
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._ready: list[Completion] = []  # finished without I/O (shed stores)
        self._held: list[tuple[float, Completion]] = []  # failed loads kept back (grace)
        self._store_backlog = 0
        self._store_bytes_by_job: dict[int, int] = {}
        self._inflight = 0
        self._cv = threading.Condition()
        self._stats: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._load_q: queue.SimpleQueue[tuple[_Job, int, int] | None] = queue.SimpleQueue()
        self._store_q: queue.SimpleQueue[tuple[_Job, int, int] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._io_loop, args=(self._load_q, True),
                             name=f"memkv-load-{i}", daemon=True)
            for i in range(max(1, opts.n_read_threads))
        ] + [
            threading.Thread(target=self._io_loop, args=(self._store_q, False),
                             name=f"memkv-store-{i}", daemon=True)
            for i in range(max(1, opts.n_write_threads))
        ]
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------------------- lookups
    def lookup(self, key: bytes) -> Lookup:
        """Non-blocking presence check; PENDING until a flushed probe answers or times out."""
        now = self._clock()
        v = self._verdicts.get(key)
        if v is not None:
            if v[1] > now:
                self._stats["lookup_" + v[0].value] += 1
                return v[0]
            del self._verdicts[key]
        probe = self._probing.get(key)
        if probe is not None:
            self._harvest(now)
            v = self._verdicts.get(key)
            if v is not None:
                self._stats["lookup_" + v[0].value] += 1
                return v[0]
        elif key not in self._queued:
            self._queued[key] = None
        self._stats["lookup_pending"] += 1
        return Lookup.PENDING

    def flush_lookups(self) -> None:
        """Send all keys queued since the last flush as one asynchronous exists probe."""
        now = self._clock()
        self._harvest(now)
        if not self._queued:
            return
        keys = list(self._queued)
        self._queued.clear()
        op = None
        if self._client is not None:
            try:
                op = self._client.submit_exists(keys, lease_ms=self.options.lookup_lease_ms)
            except Exception as e:  # a broken client is a miss, never an engine failure
                logger.warning("memkv exists probe failed to start (%s); treating as misses", e)
        self._stats["probes"] += 1
        self._stats["probe_keys"] += len(keys)
        if op is None:
            self._stats["lookup_errors"] += len(keys)
            for k in keys:
                self._set(k, Lookup.MISS, now + self.options.miss_ttl_s)
            return
        probe = _Probe(op, keys, now + self.options.lookup_timeout_s)
        self._probes.append(probe)
        for k in keys:
            self._probing[k] = probe

    def mark_missing(self, keys: Sequence[bytes], ttl_s: float | None = None) -> None:
        """Remember keys as absent (e.g. after a failed load) so they are not promoted again."""
        exp = self._clock() + (self.options.failed_load_miss_ttl_s if ttl_s is None else ttl_s)
        for k in keys:
            self._set(k, Lookup.MISS, exp)

    def forget(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._verdicts.pop(k, None)

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
                statuses = [_UNAVAILABLE] * len(p.keys)
            if statuses is None and now < p.deadline:
                keep.append(p)
                continue
            if statuses is None:  # past lookup_timeout_s: a slow cluster is a miss
                self._stats["lookup_timeouts"] += len(p.keys)
                statuses = [_UNAVAILABLE] * len(p.keys)
            for k, s in zip(p.keys, statuses, strict=False):
                if self._probing.get(k) is p:
                    del self._probing[k]
                if s in (_OK, _OK_NO_LEASE):
                    self._set(k, Lookup.HIT, now + self.options.hit_ttl_s)
                else:
                    if s != _NOT_FOUND:
                        self._stats["lookup_errors"] += 1
                    self._set(k, Lookup.MISS, now + self.options.miss_ttl_s)
        self._probes = keep

    def has_pending_lookups(self) -> bool:
        return bool(self._queued or self._probes)

    # ----------------------------------------------------------------------------- transfers
    def submit_load(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                    sizes: Sequence[int], owner: object = None) -> None:
        """Read `keys` into the caller's memory. Loads are never shed."""
        self._submit(True, job_id, keys, ptrs, sizes, owner)

    def submit_store(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                     sizes: Sequence[int], owner: object = None) -> None:
        """Write the caller's memory under `keys`; shed (reported, not sent) past the backlog cap.

        Keys known to be present are skipped (reported as stored).
        """
        now = self._clock()
        present = [self._known_hit(k, now) for k in keys]
        todo = [i for i, p in enumerate(present) if not p]
        skipped = tuple(k for k, p in zip(keys, present, strict=False) if p)
        self._stats["store_blocks_skipped"] += len(skipped)
        nbytes = sum(int(sizes[i]) for i in todo)
        if todo and self._store_backlog + nbytes > self.options.max_store_backlog_bytes:
            # Shedding drops the newest work: the blocks stay computable, the engine never waits.
            self._stats["store_jobs_shed"] += 1
            self._stats["store_blocks_shed"] += len(todo)
            self._ready.append(Completion(job_id, False, False, skipped, 0, 0.0, shed=True))
            return
        self._store_backlog += nbytes
        self._store_bytes_by_job[job_id] = nbytes
        self._submit(False, job_id, [keys[i] for i in todo], [ptrs[i] for i in todo],
                     [sizes[i] for i in todo], owner, skipped)

    def _known_hit(self, key: bytes, now: float) -> bool:
        v = self._verdicts.get(key)
        return v is not None and v[0] is Lookup.HIT and v[1] > now

    def _submit(self, is_load: bool, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                sizes: Sequence[int], owner: object, skipped: tuple[bytes, ...] = ()) -> None:
        job = _Job(job_id, is_load, list(keys), [int(p) for p in ptrs], [int(s) for s in sizes],
                   owner, self._clock(), skipped)
        job.statuses = [_UNAVAILABLE] * len(job.keys)
        self._stats["load_jobs" if is_load else "store_jobs"] += 1
        n = len(job.keys)
        if n == 0 or self._client is None or self._closed:
            job.t_done = self._clock()
            self._done.put(job)
            return
        step = max(1, self.options.blocks_per_op)
        ranges = [(i, min(n, i + step)) for i in range(0, n, step)]
        job.remaining = len(ranges)
        with self._cv:
            self._inflight += 1
        q = self._load_q if is_load else self._store_q
        for lo, hi in ranges:
            q.put((job, lo, hi))

    def _io_loop(self, q: queue.SimpleQueue, is_load: bool) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            job, lo, hi = item
            client = self._client
            t_op = time.monotonic()
            try:
                assert client is not None
                fn = client.get_into_ptrs if is_load else client.put_ptrs
                st = fn(job.keys[lo:hi], job.ptrs[lo:hi], job.sizes[lo:hi], owner=job.owner)
                st = [int(s) for s in st]
                if len(st) != hi - lo:
                    raise RuntimeError(f"client returned {len(st)} statuses for {hi - lo} keys")
            except Exception as e:  # an exception here must not kill the pool or hang the job
                logger.warning("memkv %s failed: %s", "load" if is_load else "store", e)
                st = [_UNAVAILABLE] * (hi - lo)
            job.statuses[lo:hi] = st
            if _TIMEOUT in st or (
                _UNAVAILABLE in st
                and time.monotonic() - t_op >= 0.9 * self.options.load_timeout_s
            ):
                job.timed_out = True
            with self._cv:
                job.remaining -= 1
                last = job.remaining == 0
                if last:
                    job.t_done = self._clock()
                    self._done.put(job)
                    self._inflight -= 1
                    self._cv.notify_all()

    def poll(self) -> list[Completion]:
        """Completions of finished jobs, each exactly once. Call from the owning thread."""
        now = self._clock()
        out, self._ready = self._ready, []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            out.extend(self._complete(job, now))
        if self._held:
            out.extend(c for release, c in self._held if release <= now)
            self._held = [(release, c) for release, c in self._held if release > now]
        return out

    def _complete(self, job: _Job, now: float) -> list[Completion]:
        ok_keys = [k for k, s in zip(job.keys, job.statuses, strict=False) if s == _OK]
        failed = [k for k, s in zip(job.keys, job.statuses, strict=False) if s != _OK]
        nbytes = sum(sz for sz, s in zip(job.sizes, job.statuses, strict=False) if s == _OK)
        secs = max(0.0, job.t_done - job.t0)
        kind = "load" if job.is_load else "store"
        self._stats[f"{kind}_blocks_ok"] += len(ok_keys)
        self._stats[f"{kind}_blocks_failed"] += len(failed)
        self._stats[f"{kind}_bytes"] += nbytes
        self._stats[f"{kind}_seconds_x1e6"] += int(secs * 1e6)
        if job.is_load:
            if failed:
                # Evicted / gone / server down: never promote these again for a while.
                self.mark_missing(failed)
            c = Completion(job.job_id, True, not failed, tuple(ok_keys), nbytes, secs)
            if job.timed_out and self.options.load_failure_grace_s > 0:
                # The request may still be in flight on the wire; the destination memory must not
                # be reused before a late write can no longer land, so the job stays open.
                self._stats["load_jobs_held"] += 1
                self._held.append((now + self.options.load_failure_grace_s, c))
                return []
            return [c]
        self._store_backlog -= self._store_bytes_by_job.pop(job.job_id, 0)
        exp = now + self.options.hit_ttl_s
        for k in ok_keys:
            self._set(k, Lookup.HIT, exp)
        return [Completion(job.job_id, False, not failed, tuple(ok_keys) + job.skipped,
                           nbytes, secs)]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job has I/O in flight (held failed loads excluded). True if drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def has_pending_jobs(self) -> bool:
        return bool(self._inflight or self._held or self._ready or not self._done.empty())

    @property
    def store_backlog_bytes(self) -> int:
        return self._store_backlog

    def stats(self) -> dict[str, int]:
        """Cumulative counters since creation (plus gauges); cheap, for metrics."""
        s = dict(self._stats)
        s["store_backlog_bytes"] = self._store_backlog
        s["load_jobs_held_now"] = sum(1 for _, c in self._held if c.is_load)
        s["jobs_in_flight"] = self._inflight
        return s

    def close(self, timeout: float = 10.0) -> None:
        """Finish in-flight I/O (so caller memory is untouched afterwards) and stop the pools."""
        if self._closed:
            return
        self._closed = True
        if not self.drain(timeout):
            logger.warning("memkv block store: I/O still in flight after %.0f s at close", timeout)
        for t in self._threads:
            (self._load_q if t.name.startswith("memkv-load") else self._store_q).put(None)
        for t in self._threads:
            t.join(timeout=1.0)
