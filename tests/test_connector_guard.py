"""LoadFailureGuard, the worker half of the recompute connector, without vLLM: a stand-in
offloading worker (the real one runs in tests/e2e/test_direct_faults.py), vLLM's TransferResult
shape (a dataclass with these four fields in 0.25-0.33) and a stand-in for the three adapter
methods the guard reads vLLM's objects with (tests/direct/test_connector_vllm.py runs the guard
with the real adapter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from memkv_vllm.vllm.connector import LoadFailureGuard


@dataclasses.dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


@dataclasses.dataclass
class Spec:
    block_ids: list[int]


class Adapter:
    def gpu_job(self, spec: Spec) -> tuple[list[int], list[int], list[int]]:
        return list(spec.block_ids), [len(spec.block_ids)], [0]

    def transfer_outcome(self, result: TransferResult) -> tuple[int, bool]:
        return result.job_id, result.success

    def transfer_succeeded_empty(self, result: TransferResult) -> TransferResult:
        return dataclasses.replace(result, success=True, transfer_size=None, transfer_time=None)


class Worker:
    """Reports what the test queues; optionally names failed blocks like memkv's worker."""

    def __init__(self, names_blocks: bool) -> None:
        self.finished: list[TransferResult] = []
        self.failed_ids: set[int] = set()
        self.calls: list[tuple] = []
        if names_blocks:
            self.take_failed_block_ids = self._take

    def _take(self) -> set[int]:
        ids, self.failed_ids = self.failed_ids, set()
        return ids

    def submit_store(self, job_id: int, src: Spec, dst: object) -> bool:
        self.calls.append(("store", job_id))
        return True

    def submit_load(self, job_id: int, src: object, dst: Spec, **kw: object) -> bool:
        self.calls.append(("load", job_id, kw))
        return True

    def get_finished(self) -> Iterable[TransferResult]:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.calls.append(("wait", job_ids))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


def test_a_failed_load_job_is_answered_as_success_and_all_its_blocks_are_load_errors() -> None:
    inner = Worker(names_blocks=False)
    guard = LoadFailureGuard(inner, Adapter())
    assert guard.submit_load(1, None, Spec([4, 5, 6]))
    assert guard.submit_load(2, None, Spec([7]))
    inner.finished = [TransferResult(1, False, 100, 0.1), TransferResult(2, True, 10, 0.01)]
    assert guard.get_finished() == [TransferResult(1, True), TransferResult(2, True, 10, 0.01)]
    assert guard.take_load_errors() == {4, 5, 6}
    assert guard.take_load_errors() == set()  # each id once
    assert guard.failed_loads == 1


def test_named_blocks_narrow_the_errors_and_wait_for_their_job() -> None:
    inner = Worker(names_blocks=True)
    guard = LoadFailureGuard(inner, Adapter())
    guard.submit_load(1, None, Spec([4, 5, 6]))
    guard.submit_load(2, None, Spec([8, 9]))
    # Job 2's block 9 failed, but job 2 is still in flight: reported only with its job.
    inner.failed_ids = {5, 9, 77}
    inner.finished = [TransferResult(1, False)]
    assert guard.get_finished() == [TransferResult(1, True)]
    assert guard.take_load_errors() == {5}  # 77 belongs to no load of ours: dropped
    inner.finished = [TransferResult(2, True, 20, 0.5)]
    assert guard.get_finished() == [TransferResult(2, True, 20, 0.5)]
    assert guard.take_load_errors() == {9}


def test_a_failed_store_is_answered_as_success_and_names_no_blocks() -> None:
    inner = Worker(names_blocks=True)
    guard = LoadFailureGuard(inner, Adapter())
    assert guard.submit_store(3, Spec([1]), None)
    inner.finished = [TransferResult(3, False, 5, 0.1)]
    assert guard.get_finished() == [TransferResult(3, True)]
    assert guard.take_load_errors() == set()
    assert guard.failed_stores == 1


def test_calls_reach_the_wrapped_worker() -> None:
    inner = Worker(names_blocks=False)
    guard = LoadFailureGuard(inner, Adapter())
    guard.submit_load(1, None, Spec([1]), expedited=True)
    guard.submit_load(2, None, Spec([2]))
    guard.wait({1})
    guard.shutdown()
    assert inner.calls == [("load", 1, {"expedited": True}), ("load", 2, {}), ("wait", {1}),
                           ("shutdown",)]
