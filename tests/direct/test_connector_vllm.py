"""The recompute connector against the installed vLLM's API (any generation, no engine): vLLM's
connector factory finds it by configuration alone, the hook it relies on is there, it answers
vLLM's own TransferResult, and it refuses models it cannot recompute for. The engine-level proof
is tests/e2e/test_direct_faults.py."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="needs vLLM")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from memkv_vllm.vllm.compat import api  # noqa: E402
from memkv_vllm.vllm.connector import (  # noqa: E402
    CONNECTOR_NAME,
    LoadFailureGuard,
    RecomputeRoute,
    connector_class,
)


def test_vllm_resolves_the_connector_from_the_transfer_config() -> None:
    cfg = KVTransferConfig(kv_connector=CONNECTOR_NAME,
                           kv_connector_module_path="memkv_vllm.connector", kv_role="kv_both",
                           kv_load_failure_policy="recompute")
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is connector_class()
    assert issubclass(cls, OffloadingConnector)
    # What vLLM's scheduler and model runner call on it are the connector's own overrides.
    for name in ("get_block_ids_with_load_errors", "update_connector_output",
                 "register_kv_caches"):
        assert getattr(cls, name) is not getattr(OffloadingConnector, name), name


def test_this_vllm_has_the_load_error_hook_and_policy() -> None:
    assert api().load_error_hook_missing() == ""
    assert api().load_failure_policy(types.SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both",
        kv_load_failure_policy="recompute"))) == "recompute"


def test_a_model_with_two_kv_cache_groups_is_refused_at_construction() -> None:
    two_groups = types.SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(RuntimeError, match="2 KV-cache groups"):
        connector_class()(None, None, two_groups)


def test_the_guard_answers_vllms_transfer_results_as_successes() -> None:
    class Worker:
        def submit_load(self, job_id, src, dst, **kw):
            return True

        def get_finished(self):
            return [TransferResult(job_id=7, success=False, transfer_size=9, transfer_time=0.5)]

    guard = LoadFailureGuard(Worker(), api())
    guard.submit_load(7, None, GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]))
    assert guard.get_finished() == [TransferResult(job_id=7, success=True)]
    assert guard.take_load_errors() == {3, 4}


class _Inner:
    """What vLLM's connector worker made from the spec: a worker that reports one failed load."""

    def __init__(self) -> None:
        self.loads: list[int] = []

    def submit_load(self, job_id, src, dst, **kw):
        self.loads.append(job_id)
        return True

    def get_finished(self):
        return [TransferResult(job_id=j, success=False) for j in self.loads]


class _WorkerSide:
    """vLLM's OffloadingConnectorWorker as far as the connector uses it: registering the KV
    caches makes the spec's worker."""

    def __init__(self) -> None:
        self.worker = None

    def register_kv_caches(self, kv_caches) -> None:
        self.worker = _Inner()

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend) -> None:
        self.worker = _Inner()


def _worker_side_connector():
    conn = object.__new__(connector_class())  # vLLM's own methods, no engine behind them
    conn.connector_worker = _WorkerSide()
    return conn


@pytest.mark.parametrize("hook", ["register_kv_caches", "register_cross_layers_kv_cache"])
def test_registering_the_kv_caches_puts_the_guard_before_the_spec_worker(hook: str) -> None:
    if not hasattr(OffloadingConnector, hook):
        assert not hasattr(connector_class(), hook)  # vLLM would never call it: not defined
        pytest.skip(f"this vLLM's connector has no {hook}")
    conn = _worker_side_connector()
    assert api().offloading_worker(conn) is None
    getattr(conn, hook)(*(({},) if hook == "register_kv_caches" else (None, None)))
    guard = conn.connector_worker.worker
    assert isinstance(guard, LoadFailureGuard) and api().offloading_worker(conn) is guard
    # vLLM's connector worker drives the guard; the failed load reaches vLLM's hook as blocks.
    guard.submit_load(1, None, GPULoadStoreSpec([5, 6], group_sizes=[1, 1],
                                                block_indices=[0, 0]))
    assert [r.success for r in guard.get_finished()] == [True]
    assert conn.get_block_ids_with_load_errors() == {5, 6}
    assert conn.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("errors", [{3}, set()])
def test_the_manager_hears_of_load_errors_before_vllm_completes_their_jobs(errors) -> None:
    calls = []

    class Scheduler:  # vLLM's OffloadingConnectorScheduler, as far as the connector uses it
        class manager:  # noqa: N801
            @staticmethod
            def on_load_errors() -> None:
                calls.append("manager")

        @staticmethod
        def update_connector_output(output) -> None:
            calls.append("vllm")

    conn = object.__new__(connector_class())
    conn.connector_scheduler = Scheduler()
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
    assert calls == (["manager", "vllm"] if errors else ["vllm"])


def test_a_connector_without_the_hooks_is_refused_when_the_class_is_built() -> None:
    class Renamed(type(api())):  # an adapter whose vLLM renamed a hook
        def offloading_connector_class(self) -> type:
            return type("Connector", (), {"register_kv_caches": lambda self, kv: None,
                                          "get_block_ids_with_load_errors": lambda self: set()})

    with pytest.raises(RuntimeError, match="no update_connector_output"):
        Renamed().recompute_connector_class(RecomputeRoute, CONNECTOR_NAME, __name__)
