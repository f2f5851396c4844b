"""Random sequences of stores, loads, answers from the network (good and failed), polls, jumps
ahead (`prioritize`), waits that time out and give their jobs up (as `DirectWorker.wait` does),
and plain `abandon`s against a `KVOffloader` over host KV tensors and a store the test answers by
hand (gated_store.py), checking after every step (hypothesis state machine; no server, no sleeps):

* every job is answered exactly once, with a result that says what happened to each block;
* a load given up never writes its blocks after that (the caller has handed them on);
* no exception escapes, neither to the caller nor on the progress threads.
"""

from __future__ import annotations

import logging

import torch
from gated_store import GatedStore, deliver
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from layouts import LAYOUTS, block_bytes

from memkv_vllm.offload import Entry, JobResult, KVOffloader

KEYS = [b"k%d" % i for i in range(6)]  # key i is always stored from block i, never written
ABSENT = b"never-stored"
DST = list(range(len(KEYS), 24))  # loads write only these
FRESH, MARK = 0x11, 0xEE  # a load's blocks before it runs; after its caller took them back

picks_st = st.lists(st.integers(0, 63), min_size=1, max_size=3)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _Model:
    """One job as the caller sees it: its entries, and whether it gave the job up."""

    def __init__(self, is_load: bool, entries: list[Entry]) -> None:
        self.is_load, self.entries = is_load, entries
        self.given_up = False

    @property
    def blocks(self) -> list[int]:
        return [b for e in self.entries for b in e.block_ids]


class GivingUpMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = LAYOUTS["kv_per_layer"](DST[-1] + 1, "cpu")
        self.want = {k: b"".join(block_bytes(self.kv, 0, i)) for i, k in enumerate(KEYS)}
        self.store = GatedStore()
        slot = -(-self.kv.max_value_bytes // 4096) * 4096
        self.off = KVOffloader(self.kv, self.store, scratch_bytes=3 * slot,  # type: ignore[arg-type]
                               batch_values=2)
        self.errors = _Errors()
        logging.getLogger("memkv_vllm.offload").addHandler(self.errors)
        self.open: dict[int, _Model] = {}  # submitted, not answered by poll yet
        self.answered: set[int] = set()
        self.next_id = 0

    def teardown(self) -> None:
        """Every job is answered by close at the latest, and only once."""
        try:
            while io := self.store.in_flight():  # queued values go out as others are answered
                deliver(self.off, self.store, io[0].io_id, ok=False)
            self.off.close()
            self._take(self.off.poll())
            assert not self.open, f"jobs never answered: {sorted(self.open)}"
            assert self.store.closed
        finally:
            logging.getLogger("memkv_vllm.offload").removeHandler(self.errors)

    # ------------------------------------------------------------------ helpers
    def _fill(self, blocks: list[int], byte: int) -> None:
        for t in self.kv.tensors:
            for b in blocks:  # one at a time: indexing by a list would fill a copy
                t[b].view(torch.uint8).fill_(byte)

    def _holds(self, block: int, byte: int) -> bool:
        return all(bool((t[block].view(torch.uint8) == byte).all()) for t in self.kv.tensors)

    def _ids(self, picks: list[int]) -> list[int]:
        """Job ids from `picks`: open ones, answered ones and an unknown one."""
        pool = sorted(self.open) + sorted(self.answered) + [10_000]
        return [pool[p % len(pool)] for p in picks]

    def _take(self, results: list[JobResult]) -> None:
        for r in results:
            assert r.job_id in self.open, f"job {r.job_id} answered twice or never submitted"
            job = self.open.pop(r.job_id)
            self.answered.add(r.job_id)
            keys = {e.key for e in job.entries}
            assert r.is_load == job.is_load and set(r.ok_keys) <= keys
            assert len(r.ok_keys) == len(set(r.ok_keys))
            failed = sorted(b for e in job.entries if e.key not in r.ok_keys for b in e.block_ids)
            assert sorted(r.failed_block_ids) == failed and r.ok == (not failed)
            assert r.nbytes == self.kv.value_bytes[0] * len(r.ok_keys)
            for e in job.entries:
                (b,) = e.block_ids
                ok = e.key in r.ok_keys
                if not job.is_load:
                    assert not ok or self.store.client.data[e.key] == self.want[e.key]
                elif job.given_up:  # nothing written since: what its caller wrote is still there
                    assert self._holds(b, MARK), f"job {r.job_id} wrote block {b} after abandon"
                elif ok:
                    assert b"".join(block_bytes(self.kv, 0, b)) == self.want[e.key]
                else:
                    assert self._holds(b, FRESH), f"failed load {r.job_id} wrote block {b}"

    def _give_up(self, ids: list[int]) -> None:
        """`abandon` as a caller does it: jobs that finished meanwhile are answered normally, the
        others' load blocks go to someone else right after."""
        self._take(self.off.poll())
        self.off.abandon(ids)
        for j in set(ids) & set(self.open):
            job = self.open[j]
            job.given_up = True
            if job.is_load:
                self._fill(job.blocks, MARK)

    # ------------------------------------------------------------------ rules
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def submit_store(self, keys: list[bytes]) -> None:
        job = self.next_id = self.next_id + 1
        es = [Entry(k, 0, (KEYS.index(k),)) for k in keys]
        self.off.submit_store(job, es)
        self.open[job] = _Model(False, es)

    @rule(keys=st.lists(st.sampled_from([*KEYS, ABSENT]), min_size=1, max_size=4, unique=True),
          start=st.integers(0, len(DST) - 1))
    def submit_load(self, keys: list[bytes], start: int) -> None:
        busy = {b for j in self.open.values() if j.is_load for b in j.blocks}
        free = [b for b in DST[start:] + DST[:start] if b not in busy]
        if len(free) < len(keys):
            return
        job = self.next_id = self.next_id + 1
        es = [Entry(k, 0, (b,)) for k, b in zip(keys, free, strict=False)]
        self._fill([b for e in es for b in e.block_ids], FRESH)
        self.off.submit_load(job, es)
        self.open[job] = _Model(True, es)

    @rule(pick=st.integers(0, 63), ok=st.booleans())
    def answer(self, pick: int, ok: bool) -> None:
        io = self.store.in_flight()
        if io:
            deliver(self.off, self.store, io[pick % len(io)].io_id, ok)

    @rule()
    def poll(self) -> None:
        self._take(self.off.poll())

    @rule(picks=picks_st)
    def prioritize(self, picks: list[int]) -> None:
        self.off.prioritize(self._ids(picks))

    @rule(picks=picks_st)
    def wait_times_out_and_gives_up(self, picks: list[int]) -> None:
        """`DirectWorker.wait` with the timeout passed: jump ahead, wait, give up."""
        ids = self._ids(picks)
        self.off.prioritize(ids)
        if not self.off.wait(ids, timeout=0):
            self._give_up(ids)

    @rule(picks=picks_st)
    def abandon(self, picks: list[int]) -> None:
        self._give_up(self._ids(picks))

    @rule()
    def everything_completes(self) -> None:
        while io := self.store.in_flight():
            deliver(self.off, self.store, io[0].io_id)
        assert self.off.drain(timeout=10)
        self._take(self.off.poll())
        assert not self.open and not self.off.has_pending_jobs()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def given_up_loads_write_nothing(self) -> None:
        for j, job in self.open.items():
            if job.given_up and job.is_load:
                for b in job.blocks:
                    assert self._holds(b, MARK), f"job {j} wrote block {b} after abandon"

    @invariant()
    def pending_iff_unanswered(self) -> None:
        assert self.off.has_pending_jobs() == bool(self.open)

    @invariant()
    def nothing_failed_on_the_progress_threads(self) -> None:
        assert self.errors.records == [], self.errors.records[0].getMessage()


GivingUpMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                             deadline=None)
TestGivingUpMachine = GivingUpMachine.TestCase
