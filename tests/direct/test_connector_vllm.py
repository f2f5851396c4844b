"""The recompute connector against the installed vLLM's API (any generation, no engine): vLLM's
connector factory finds it by configuration alone, the hook it relies on is there, it switches
the real spec's worker to recompute (a failed load then answers vLLM's TransferResult as a success
and its blocks reach vLLM's hook), the real connector's scheduler side tells the spec's manager of
load errors, and it refuses models and specs it cannot recompute for. Real memkv servers; the
engine-level proof is tests/e2e/test_direct_faults.py."""

from __future__ import annotations

import time
import types

import pytest

pytest.importorskip("vllm", reason="needs vLLM")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.kv_offload import base as kvb  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm_specs import canonical_kv, engine_configs, make_spec  # noqa: E402

from memkv_vllm.core.interface import LoadErrorListener, LoadErrorReporter  # noqa: E402
from memkv_vllm.vllm.compat import api  # noqa: E402
from memkv_vllm.vllm.connector import (  # noqa: E402
    CONNECTOR_NAME,
    RecomputeRoute,
    connector_class,
)
from memkv_vllm.vllm.spec import MemKVLoadStoreSpec  # noqa: E402


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


def _engine(address: str) -> tuple[str, dict]:
    """A new engine id (its own prefix board) and the spec's extra config for `address`."""
    return (f"memkv-connector-test-{time.monotonic_ns()}",
            {"servers": [address], "memkv_num_threads": 1, "memkv_scratch_mb_per_thread": 1})


def _finished(worker, job_id: int, timeout: float = 30.0):
    """The worker's one TransferResult for `job_id`, polled as vLLM's connector worker does."""
    deadline = time.monotonic() + timeout
    while not (done := list(worker.get_finished())):
        assert time.monotonic() < deadline, "job never finished"
        time.sleep(0.01)
    assert [r.job_id for r in done] == [job_id]
    return done[0]


class _WorkerSide:
    """vLLM's OffloadingConnectorWorker as far as the connector uses it: registering the KV
    caches makes the spec's worker (`make()`)."""

    def __init__(self, make) -> None:
        self.worker = None
        self._make = make

    def register_kv_caches(self, kv_caches) -> None:
        self.worker = self._make()

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend) -> None:
        self.worker = self._make()


def _worker_side_connector(make):
    conn = object.__new__(connector_class())  # vLLM's own methods, no engine behind them
    conn.connector_worker = _WorkerSide(make)
    return conn


def _register(conn, hook: str) -> None:
    if not hasattr(OffloadingConnector, hook):
        assert not hasattr(connector_class(), hook)  # vLLM would never call it: not defined
        pytest.skip(f"this vLLM's connector has no {hook}")
    getattr(conn, hook)(*(({},) if hook == "register_kv_caches" else (None, None)))


@pytest.mark.parametrize("hook", ["register_kv_caches", "register_cross_layers_kv_cache"])
def test_a_failed_load_of_the_spec_worker_reaches_vllms_hook_as_blocks(memkv_server,
                                                                        hook: str) -> None:
    eid, extra = _engine(memkv_server.address)
    kv, tensors = canonical_kv(seed=1)
    worker = make_spec(extra, engine_id=eid).get_worker(kv)
    try:  # a hook this vLLM lacks skips the test: its worker must still shut down
        assert isinstance(worker, LoadErrorReporter)
        conn = _worker_side_connector(lambda: worker)
        assert api().offloading_worker(conn) is None
        _register(conn, hook)
        assert api().offloading_worker(conn) is worker  # driven as it is, nothing in between
        before = [t.clone() for t in tensors]
        # What vLLM's connector worker does: submit, then collect once per step, then ask the hook.
        assert worker.submit_load(1, MemKVLoadStoreSpec([(b"absent", 0)]),
                                  kvb.GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]))
        result = _finished(worker, 1)
        assert isinstance(result, kvb.TransferResult) and result.success  # vLLM asserts on this
        assert conn.get_block_ids_with_load_errors() == {5, 6}
        assert conn.get_block_ids_with_load_errors() == set()  # each block once
        assert all(t.equal(b) for t, b in zip(tensors, before, strict=True))  # nothing written
    finally:
        worker.shutdown()


def test_a_spec_whose_worker_cannot_name_failed_blocks_is_refused() -> None:
    class ForeignWorker:  # any OffloadingWorker without LoadErrorReporter
        def get_finished(self):
            return []

    conn = _worker_side_connector(ForeignWorker)
    with pytest.raises(RuntimeError, match="ForeignWorker.*does not implement LoadErrorReporter"):
        conn.register_kv_caches({})


@pytest.mark.parametrize("errors", [{3}, set()])
def test_the_spec_manager_hears_of_load_errors_from_the_real_connector(memkv_server,
                                                                       errors) -> None:
    eid, extra = _engine(memkv_server.address)
    kv, _ = canonical_kv(seed=2)
    worker = make_spec(extra, engine_id=eid).get_worker(kv)  # publishes the key prefix
    # The chunk is in the cluster, as this engine's worker stored it.
    assert worker.submit_store(1, kvb.GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0]),
                               MemKVLoadStoreSpec([(b"h", 0)]))
    assert _finished(worker, 1).success
    vllm_config, kv_cache_config = engine_configs(
        {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.spec",
         "block_size": 32, **extra}, engine_id=eid, connector=CONNECTOR_NAME,
        kv_connector_module_path="memkv_vllm.connector", kv_load_failure_policy="recompute")
    conn = connector_class()(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    manager = api().offloading_manager(conn)
    assert isinstance(manager, LoadErrorListener)
    key, ctx = kvb.make_offload_key(b"h", 0), kvb.ReqContext(req_id="r")
    deadline = time.monotonic() + 10
    while (v := manager.lookup(key, ctx)) is kvb.LookupResult.RETRY:
        assert time.monotonic() < deadline, "the probe never answered"
        manager.on_schedule_end(api().schedule_end_context())
        time.sleep(0.01)
    assert v is kvb.LookupResult.HIT
    manager.prepare_load([key], ctx)  # the load the workers then fail
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
    # Told of the errors, the manager no longer answers HIT for what was loading; otherwise the
    # cached verdict stands.
    want = kvb.LookupResult.MISS if errors else kvb.LookupResult.HIT
    assert manager.lookup(key, ctx) is want
    manager.shutdown()
    worker.shutdown()


def test_a_connector_without_the_hooks_is_refused_when_the_class_is_built() -> None:
    class Renamed(type(api())):  # an adapter whose vLLM renamed a hook
        def offloading_connector_class(self) -> type:
            return type("Connector", (), {"register_kv_caches": lambda self, kv: None,
                                          "get_block_ids_with_load_errors": lambda self: set()})

    with pytest.raises(RuntimeError, match="no update_connector_output"):
        Renamed().recompute_connector_class(RecomputeRoute, CONNECTOR_NAME, __name__)
