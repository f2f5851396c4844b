"""What a failed direct-mode job becomes for vLLM (memkv_vllm.direct.load_failures), decided on the
answers of a real `DirectWorker` over a real memkv server: by default a failed load is reported
failed (vLLM's stock connector then stops the engine, never serving KV that was not loaded);
switched to recompute (what MemKVOffloadingConnector does), it is answered as done and exactly its
unwritten blocks go to vLLM, each once. Stores are never reported failed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_worker import finish, kv_cache, worker  # noqa: E402

from memkv_vllm.core.interface import LoadErrorReporter  # noqa: E402
from memkv_vllm.direct.load_failures import LoadFailurePolicy  # noqa: E402

PRESENT, ABSENT = (b"present", 0), (b"absent", 0)


@pytest.fixture
def answers(memkv_server):
    """The worker's answers to: a whole load (1), a load half of whose chunks are missing (2),
    a load of nothing that is there (3), a load its caller could not read (4)."""
    ws = worker(memkv_server.address, kv_cache(seed=1))
    ws.submit_store(9, [0, 1], [2], [0], [PRESENT])
    assert not finish(ws, 9).failed
    ws.shutdown()
    w = worker(memkv_server.address, kv_cache(seed=2))
    w.submit_load(1, [2, 3], [2], [0], [PRESENT])
    w.submit_load(2, [4, 5, 6, 7], [4], [0], [PRESENT, ABSENT])
    w.submit_load(3, [8, 9], [2], [0], [ABSENT])
    w.answer_unstarted(4, is_load=True, block_ids=None)
    assert w.offloader.drain(30)
    done = {f.job_id: f for f in w.get_finished()}
    w.shutdown()
    assert sorted(done) == [1, 2, 3, 4]
    return done


def test_by_default_a_failed_load_is_reported_failed_and_nothing_is_handed_over(answers):
    policy = LoadFailurePolicy()
    assert [policy.success(answers[j]) for j in (1, 2, 3, 4)] == [True, False, False, False]
    assert policy.take_load_errors() == set()


def test_switched_to_recompute_a_failed_load_is_done_and_its_unwritten_blocks_go_once(answers):
    policy = LoadFailurePolicy()
    assert isinstance(policy, LoadErrorReporter)
    policy.recompute_failed_loads()
    assert [policy.success(answers[j]) for j in (1, 2, 3)] == [True, True, True]
    assert policy.take_load_errors() == {6, 7, 8, 9}  # not the blocks that were written
    assert policy.take_load_errors() == set()


def test_a_load_whose_blocks_are_unknown_is_reported_failed_even_when_recomputing(answers):
    policy = LoadFailurePolicy()
    policy.recompute_failed_loads()
    assert policy.success(answers[4]) is False  # no one could name the blocks to recompute
    assert policy.take_load_errors() == set()


def test_a_store_that_failed_is_done_either_way(memkv_server):
    w = worker(memkv_server.address, kv_cache(seed=3), op_timeout_s=2.0)
    memkv_server.kill()
    w.submit_store(1, [0, 1], [2], [0], [(b"lost", 0)])
    f = finish(w, 1)
    w.shutdown()
    assert not f.is_load and f.failed_block_ids == {0, 1}
    for recompute in (False, True):
        policy = LoadFailurePolicy()
        if recompute:
            policy.recompute_failed_loads()
        assert policy.success(f) is True  # its values are simply absent: a later miss
        assert policy.take_load_errors() == set()
