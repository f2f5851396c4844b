"""Random sequences of lookups, flushes, stores, loads, polls, probe answers, failures and clock
steps against `BlockStore` over a fake cluster, checking the `Offloader` contract's invariants
after every step (hypothesis state machine; no server, no vLLM, no sleeps)."""

from __future__ import annotations

import numpy as np
from fakes import FakeClient, FakeClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from memkv_vllm.core.interface import Lookup, Status
from memkv_vllm.core.store import BlockStore, StoreOptions

ROW = 32
ROWS = 12
KEYS = [b"k%d" % i for i in range(6)]
CAP = 3 * ROW

keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True)


class OffloaderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.client = FakeClient(auto_answer=False)
        self.pool = np.zeros((ROWS, ROW), dtype=np.uint8)
        self.store = BlockStore(self.client, StoreOptions(
            n_read_threads=2, n_write_threads=2, blocks_per_op=2, lookup_timeout_s=5.0,
            max_store_backlog_bytes=CAP,
            hit_ttl_s=30.0, miss_ttl_s=1.0, failed_load_miss_ttl_s=8.0, max_verdicts=4,
        ), clock=self.clock)
        self.store.register_buffer(self.pool.ctypes.data, self.pool.nbytes, owner=self.pool)
        self.next_id = 0
        # job id -> (is_load, keys, slots, store bytes); removed when its completion is polled
        self.open: dict[int, tuple[bool, list[bytes], list[int], int]] = {}
        self.completed: set[int] = set()
        self.backlog = 0  # bytes of store jobs accepted and not completed yet, by our count

    def teardown(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ helpers
    def _free_slots(self, n: int) -> list[int] | None:
        busy = {s for _, _, slots, _ in self.open.values() for s in slots}
        free = [s for s in range(ROWS) if s not in busy]
        return free[:n] if len(free) >= n else None

    def _ptrs(self, slots: list[int]) -> list[int]:
        return [self.pool.ctypes.data + s * ROW for s in slots]

    def _take(self, completions: list) -> None:
        for c in completions:
            assert c.job_id in self.open, f"job {c.job_id} completed twice or never submitted"
            is_load, keys, slots, nbytes = self.open.pop(c.job_id)
            self.completed.add(c.job_id)
            assert c.is_load == is_load
            assert set(c.ok_keys) <= set(keys)
            assert c.ok == (set(c.ok_keys) == set(keys)) or c.shed
            if is_load:
                for k, s in zip(keys, slots, strict=True):
                    if k in c.ok_keys:  # a loaded row holds exactly the stored bytes
                        assert bytes(self.pool[s]) == self.client.data[k]
                assert c.nbytes == ROW * len(c.ok_keys)
            else:
                self.backlog -= nbytes
                if c.shed:
                    assert c.nbytes == 0 and not c.ok
                for k in c.ok_keys:  # a stored key is in the cluster
                    assert k in self.client.data

    # ------------------------------------------------------------------ rules
    @rule(keys=keys_st)
    def lookup(self, keys: list[bytes]) -> None:
        for k in keys:
            v = self.store.lookup(k)
            if v is Lookup.HIT:  # no rule deletes from the fake cluster: a HIT is true
                assert k in self.client.data

    @rule()
    def flush(self) -> None:
        self.store.flush_lookups()

    @rule()
    def answer_probes(self) -> None:
        for p in self.client.probes:
            if not p.done():
                p.answer()

    @rule(keys=keys_st)
    def cancel(self, keys: list[bytes]) -> None:
        self.store.cancel_lookups(keys)

    @rule(keys=keys_st)
    def submit_store(self, keys: list[bytes]) -> None:
        slots = self._free_slots(len(keys))
        if slots is None:
            return
        for k, s in zip(keys, slots, strict=True):
            # One content per key, so a load checked later cannot see a newer version.
            self.pool[s] = KEYS.index(k) + 1
        job = self.next_id = self.next_id + 1
        before = self.store.stats()["store_backlog_bytes"]
        self.store.submit_store(job, keys, self._ptrs(slots), [ROW] * len(keys))
        added = self.store.stats()["store_backlog_bytes"] - before
        assert added >= 0 and (added == 0 or before + added <= CAP)
        self.open[job] = (False, keys, slots, added)
        self.backlog += added

    @rule(keys=keys_st)
    def submit_load(self, keys: list[bytes]) -> None:
        slots = self._free_slots(len(keys))
        if slots is None:
            return
        job = self.next_id = self.next_id + 1
        loads_before = self.store.stats().get("load_jobs", 0)
        self.store.submit_load(job, keys, self._ptrs(slots), [ROW] * len(keys))
        assert self.store.stats()["load_jobs"] == loads_before + 1  # never shed
        self.open[job] = (True, keys, slots, 0)

    @rule(key=st.sampled_from(KEYS),
          status=st.sampled_from([None, Status.NOT_FOUND, Status.TIMEOUT, Status.CORRUPT,
                                  Status.LENGTH_MISMATCH]))
    def set_failure(self, key: bytes, status: int | None) -> None:
        if status is None:
            self.client.fail.pop(key, None)
        else:
            self.client.fail[key] = status

    @rule()
    def drain_and_poll(self) -> None:
        assert self.store.drain(timeout=10)
        self._take(self.store.poll())

    @rule()
    def poll(self) -> None:
        self._take(self.store.poll())

    @rule(seconds=st.sampled_from([0.5, 1.0, 4.0, 6.0, 25.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def everything_completes(self) -> None:
        # The drain contract vLLM's reset_cache relies on: after drain, ONE poll returns every
        # job not returned yet, timed-out loads included. No precondition on open jobs: which
        # jobs a poll returned depends on the store's threads, and hypothesis needs the rules it
        # may pick to be the same on every replay (FlakyStrategyDefinition otherwise).
        assert self.store.drain(timeout=10)
        self._take(self.store.poll())
        assert not self.open and not self.store.has_pending_jobs()
        assert self.store.stats()["store_backlog_bytes"] == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def backlog_is_the_open_stores(self) -> None:
        assert self.store.stats()["store_backlog_bytes"] == self.backlog <= CAP

    @invariant()
    def pending_jobs_iff_open(self) -> None:
        if self.open:
            assert self.store.has_pending_jobs()


OffloaderMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                              deadline=None)
TestOffloaderMachine = OffloaderMachine.TestCase
