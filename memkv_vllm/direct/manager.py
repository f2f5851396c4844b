"""Scheduler side of direct mode: which chunks the cluster holds, and which to load and store.

A chunk (vLLM's OffloadKey: block hash + KV-cache group) is stored as one value per TP rank, so
it is a hit only when every rank's value is. Lookups go through a `DirectOffloader` (the block
store): unknown keys are probed in one batch per scheduler step (`on_schedule_end`), each probe
leases the hits it finds on the server, and verdicts are cached (`memkv_lookup_hit_ttl` /
`memkv_lookup_miss_ttl`). `prepare_load` has the store renew the chunk's leases, so a hit answered
from the verdict cache (older than its lease) is still pinned until the worker's GET, which
releases the lease; a value that renewal does not find turns the chunk into a miss for later
lookups.

Stores: the manager only decides what to store (not what is present or in flight) and remembers
what its workers stored. A completed store does not make lookups answer HIT by itself: a rank's
write may have failed (the worker reports a failed store as done: the value is simply absent),
so presence is always what the cluster answers.

Threads: the scheduler thread only (vLLM calls every manager method there). No vLLM imports:
keys arrive as bytes and `split` (from compat) turns an OffloadKey into (block hash, group).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence

from memkv_vllm.core.interface import DirectOffloader, Lookup
from memkv_vllm.core.request_lookups import RequestLookups
from memkv_vllm.direct.keys import key_under

_MAX_REMEMBERED = 1 << 18


class _Expiring:
    """Keys with an expiry, oldest first, bounded (a full map forgets its oldest keys)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._d: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._clock = clock

    def add(self, key: bytes, ttl: float) -> None:
        self._d[key] = self._clock() + ttl
        self._d.move_to_end(key)
        if len(self._d) > _MAX_REMEMBERED:
            self._d.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        exp = self._d.get(key)
        return exp is not None and exp > self._clock()

    def discard(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._d.pop(k, None)

    def clear(self) -> None:
        self._d.clear()


class DirectManager:
    """The direct-mode OffloadingManager's logic (see the module doc)."""

    def __init__(self, store: DirectOffloader, prefix: bytes, tp_size: int,
                 split: Callable[[bytes], tuple[bytes, int]], *, stored_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size={tp_size}")
        self.store, self.prefix, self.tp_size = store, prefix, tp_size
        self._split = split
        self._stored_ttl = stored_ttl_s
        self._stored = _Expiring(clock)  # chunks this engine stored recently
        self._storing: collections.Counter[bytes] = collections.Counter()  # chunk -> jobs
        self._loading: collections.Counter[bytes] = collections.Counter()
        self._lookups = RequestLookups(store)
        self.stored_events: list[list[bytes]] = []  # chunks stored since take_stored()

    def remote_keys(self, key: bytes) -> list[bytes]:
        """The cluster keys of chunk `key` (an OffloadKey), one per TP rank."""
        block_hash, group = self._split(key)
        return [key_under(self.prefix, block_hash, group, r) for r in range(self.tp_size)]

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: bytes, req_id: str) -> Lookup:
        pending = False
        for rk in self.remote_keys(key):
            v = self._lookups.lookup(rk, req_id)
            if v is Lookup.MISS:
                return Lookup.MISS
            pending = pending or v is Lookup.PENDING
        return Lookup.PENDING if pending else Lookup.HIT

    def on_schedule_end(self, preempted_req_ids: Iterable[str] = ()) -> None:
        """Send this step's probes as one batch (the store reads finished lease renewals)."""
        self._lookups.end_step(preempted_req_ids)

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """(block hash, group) of each chunk, in order; leases every rank's value again."""
        out = [self._split(k) for k in keys]
        for k in keys:
            self._loading[k] += 1
        self.store.renew_leases([rk for k in keys for rk in self.remote_keys(k)])
        return out

    def complete_load(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._loading[k] -= 1
            if self._loading[k] <= 0:
                del self._loading[k]

    def on_load_errors(self) -> None:
        """Some load failed on a worker (the recompute connector saw its blocks come back as load
        errors). Its chunks are among those loading now: they become misses for the store's
        failed-load TTL, so the request's next lookup does not hit the cached verdict and load
        (and fail) again. Other chunks loading right now are probed again, nothing worse."""
        self.store.mark_missing([rk for k in self._loading for rk in self.remote_keys(k)])

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[bytes]) -> list[bytes]:
        """The chunks of `keys` to store, in input order: not stored by this engine recently,
        not being stored, not known to the cluster."""
        todo = []
        for k in keys:
            if k in self._stored or k in self._storing or self._known_present(k):
                continue
            todo.append(k)
        for k in todo:
            self._storing[k] += 1
        return todo

    def _known_present(self, key: bytes) -> bool:
        return all(self.store.known_hit(rk) for rk in self.remote_keys(key))

    def store_details(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        return [self._split(k) for k in keys]

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        done = []
        for k in keys:
            self._storing[k] -= 1
            if self._storing[k] <= 0:
                del self._storing[k]
            if success:
                self._stored.add(k, self._stored_ttl)
                done.append(k)
        if done:
            self.stored_events.append(done)

    # ------------------------------------------------------------------ state
    def has_pending_work(self) -> bool:
        return bool(self._storing or self._loading or self.store.has_pending_lookups())

    def reset_cache(self) -> None:
        """vLLM flushed every job and will ignore their completions: forget them."""
        self._storing.clear()
        self._loading.clear()
        self._stored.clear()
        self._lookups.clear()

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def shutdown(self) -> None:
        self.store.close()
