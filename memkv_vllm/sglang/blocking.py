"""`BlockingStore`: the block store (`memkv_vllm.core.interface.DirectOffloader`) as the blocking,
thread-safe calls a storage API such as SGLang's HiCacheStorage makes.

SGLang calls its storage backend from several threads at once (prefetch, backup, the scheduler)
and waits for each answer; the block store belongs to one owner thread and never waits. So every
store call here happens under one lock, and a caller waits for its own job outside it:
completions `poll` returns for other callers' jobs are kept for them.

Nothing here raises for a failed transfer or probe: an unreachable, slow or broken cluster
answers False for the keys concerned (the store's contract). A job always completes: the client
gives up on a key after its per-operation timeout, and writes nothing after its call returned,
so once a load answered, no late byte can land in memory the caller reuses.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from memkv_vllm.core.interface import Completion, DirectOffloader, Lookup

# How often a caller looks again for a probe's answer (the store exposes no wait for those).
_RECHECK_S = 0.0005
# The longest a job's waiter sleeps: `wait_any` wakes it when a completion lands; only one that
# another caller's poll took for it arrives without a wake-up.
_HANDOFF_S = 0.005


class BlockingStore:
    """Blocking transfers and presence checks over `store`, from any thread."""

    def __init__(self, store: DirectOffloader) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)
        self._finished: dict[int, Completion] = {}  # jobs polled on behalf of another caller

    def register(self, ptr: int, nbytes: int, owner: object) -> None:
        """Register memory that transfers may address (see `Offloader.register_buffer`)."""
        with self._lock:
            self._store.register_buffer(ptr, nbytes, owner)

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._store.unregister_buffer(ptr)

    def transfer(self, is_load: bool, keys: Sequence[bytes], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[bool]:
        """BLOCKING: load (`is_load`) or store each key's `sizes[i]` bytes at `ptrs[i]`; True for
        the keys that transferred. Memory must lie in registered buffers (else ValueError)."""
        if not keys:
            return []
        with self._lock:
            job_id = next(self._job_ids)
            submit = self._store.submit_load if is_load else self._store.submit_store
            submit(job_id, keys, ptrs, sizes)
        done = self._wait(job_id)
        ok = set(done.ok_keys)
        return [k in ok for k in keys]

    def _wait(self, job_id: int) -> Completion:
        while True:
            with self._lock:
                for c in self._store.poll():
                    self._finished[c.job_id] = c
                mine = self._finished.pop(job_id, None)
            if mine is not None:
                return mine
            self._store.wait_any(_HANDOFF_S)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """BLOCKING: is each key in the cluster? One batched probe for the keys without a fresh
        verdict; a probe unanswered within the store's lookup timeout answers False."""
        verdicts = [Lookup.PENDING] * len(keys)
        while True:
            with self._lock:
                verdicts = [self._store.lookup(k) if v is Lookup.PENDING else v
                            for k, v in zip(keys, verdicts, strict=True)]
                if Lookup.PENDING not in verdicts:
                    return [v is Lookup.HIT for v in verdicts]
                # Sends what lookup() queued (a verdict may also expire while we wait).
                self._store.flush_lookups()
            time.sleep(_RECHECK_S)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._store.stats()

    def close(self) -> None:
        """BLOCKING: wait for running I/O, then stop the store (see `Offloader.close`)."""
        with self._lock:
            self._store.close()
