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
from vllm.v1.kv_offload.base import TransferResult  # noqa: E402

from memkv_vllm.compat import api  # noqa: E402
from memkv_vllm.connector import CONNECTOR_NAME, LoadFailureGuard, connector_class  # noqa: E402


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

    guard = LoadFailureGuard(Worker())
    guard.submit_load(7, None, types.SimpleNamespace(block_ids=[3, 4]))
    assert guard.get_finished() == [TransferResult(job_id=7, success=True)]
    assert guard.take_load_errors() == {3, 4}
