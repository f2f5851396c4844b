"""The CPU pool's /dev/shm name under MemKVTieringOffloadingSpec, with vLLM's real spec classes and
SharedOffloadRegion: the scheduler unlinks the name once it has mapped the pool a worker created,
a worker's shutdown then leaves a newer engine's file alone, and vLLM's own TieringOffloadingSpec
keeps its behaviour. The worker is the one this platform gets from the spec (the CPU platform's
copy worker here); tests/e2e/test_shm_cleanup.py covers a real API server. The region fields and
the shutdown hook that the plugin reaches through compat are checked in test_compat.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from specs import LAYERS, tiering_spec
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.tiering_spec import MemKVTieringOffloadingSpec


def _pool_path(spec: Any) -> str:
    return f"/dev/shm/vllm_offload_{api().engine_id(spec)}.mmap"


@pytest.fixture
def spec() -> Iterator[Any]:
    """The plugin's tiering spec for a fresh engine; removes the pool file if a test left it."""
    s = tiering_spec(MemKVTieringOffloadingSpec)
    yield s
    if api().scheduler_region(s) is not None:  # the test built the manager
        s.get_manager().shutdown()
    if os.path.exists(_pool_path(s)):
        os.unlink(_pool_path(s))


def _kv_caches(page: int, blocks: int = 4) -> Any:
    """One KV tensor per layer of the spec's group, host memory (the CPU platform's cache)."""
    tensors = [torch.zeros((blocks, page), dtype=torch.int8) for _ in LAYERS]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
                          for i in range(len(LAYERS))]])


@pytest.mark.skipif(not api().is_cpu_platform(), reason="builds the CPU platform's worker")
def test_the_scheduler_unlinks_the_pool_the_worker_created(spec) -> None:
    path = _pool_path(spec)
    page = spec.cpu_page_size_per_worker // len(LAYERS)
    kv = _kv_caches(page)
    kv.tensors[0].tensor[2, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.int8)
    worker = spec.get_worker(kv)  # what vLLM's worker does first: it creates the pool
    assert spec.get_worker(kv) is worker
    try:
        assert os.path.exists(path)
        manager = spec.get_manager()
        assert not os.path.exists(path)  # the name is gone ...
        pool = np.asarray(api().scheduler_region(spec).create_kv_memoryview())
        _copy_block_to_pool(worker, kv, block=2, chunk=3)
        assert pool[3, :4].tobytes() == b"\x01\x02\x03\x04"  # ... and both map the same memory
        assert manager is spec.get_manager()
    finally:
        with open(path, "wb"):  # a newer engine with the same engine id
            pass
        worker.shutdown()
    assert os.path.exists(path)  # the old worker's clean-up left the newer file alone


def _copy_block_to_pool(worker: Any, kv: Any, block: int, chunk: int) -> None:
    """Store GPU block `block` into pool row `chunk` through the worker, and wait for it."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    groups = len(kv.group_data_refs)
    src = GPULoadStoreSpec([block], group_sizes=[1] * groups, block_indices=[0] * groups)
    assert worker.submit_store(7, src, CPULoadStoreSpec([chunk]))
    worker.wait({7})
    # vLLM's TransferResult: a (job_id, success) tuple in the oldest generation, an object with
    # those fields later.
    assert [(r.job_id, r.success) if hasattr(r, "job_id") else tuple(r)[:2]
            for r in worker.get_finished()] == [(7, True)]


def test_a_scheduler_that_created_the_pool_keeps_its_name(spec) -> None:
    spec.get_manager()  # no worker mapped it first: workers may still have to find it by name
    region = api().scheduler_region(spec)
    assert region.mmap_path == _pool_path(spec) and os.path.exists(region.mmap_path)


def test_vllms_own_tiering_spec_keeps_its_pool_name() -> None:
    s = tiering_spec()
    path = _pool_path(s)
    worker_region = api().open_worker_region(s, 0)  # a worker created the pool
    try:
        manager = s.get_manager()
        assert os.path.exists(path)  # vLLM alone: the name stays until a clean shutdown
        manager.shutdown()
    finally:
        worker_region.cleanup()
    assert not os.path.exists(path)  # which removes it, as vLLM does


def test_a_worker_refuses_an_engine_across_nodes(spec, monkeypatch) -> None:
    """Where vLLM counts the engine's workers on several nodes (`--nnodes`, or ranks that share
    no /dev/shm), a worker refuses before it maps a pool: the other nodes' pool files reach no
    tier (tests/e2e/test_multinode_e2e.py runs it on two nodes)."""
    from vllm.distributed import parallel_state

    kv = _kv_caches(spec.cpu_page_size_per_worker // len(LAYERS))
    assert api().node_count() is None  # no distributed setup in this process
    monkeypatch.setattr(parallel_state, "_NODE_COUNT", 2)
    assert api().node_count() == 2
    with pytest.raises(RuntimeError, match="this engine's workers run on 2 nodes"):
        spec.get_worker(kv)
    assert not os.path.exists(_pool_path(spec))


@pytest.mark.skipif(not api().is_cpu_platform(), reason="builds the CPU platform's worker")
def test_data_parallel_replicas_on_separate_nodes_are_served(spec, monkeypatch) -> None:
    """An MoE engine with data parallelism: vLLM's world group, and so its node count, spans
    every replica, but a replica's ranks and its scheduler (each replica has one) share the
    nodes vLLM's multiprocessing executor gives that replica (`nnodes_within_dp`). Two replicas
    on two nodes, one each (`--data-parallel-size 2 --data-parallel-size-local 1`, no `--nnodes`):
    every worker shares its host's pool with its scheduler, and builds it. Two replicas of TP=2
    over four nodes (`--nnodes 4`) span two nodes each and are refused; under other executors
    (Ray's) the world's count stands (compat's node_count says why)."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    def replicas(**kw: Any) -> Any:
        return VllmConfig(parallel_config=ParallelConfig(
            data_parallel_size=2, data_parallel_size_local=1, **kw))

    kv = _kv_caches(spec.cpu_page_size_per_worker // len(LAYERS))
    monkeypatch.setattr(parallel_state, "_NODE_COUNT", 2)  # vLLM's probe over both replicas
    with set_current_vllm_config(replicas(distributed_executor_backend="mp")):
        assert api().node_count() == 1
        worker = spec.get_worker(kv)
    try:
        assert os.path.exists(_pool_path(spec))
    finally:
        worker.shutdown()
    # Ray's executor: the world's count. vLLM's config refuses to name it where Ray is not
    # installed (as here), so the field is set past the config's validation.
    ray = replicas(distributed_executor_backend="mp")
    object.__setattr__(ray.parallel_config, "distributed_executor_backend", "ray")
    with set_current_vllm_config(ray):
        assert api().node_count() == 2
    monkeypatch.setattr(parallel_state, "_NODE_COUNT", 4)  # `--nnodes 4`
    spanning = tiering_spec(MemKVTieringOffloadingSpec)
    with set_current_vllm_config(replicas(distributed_executor_backend="mp", nnodes=4,
                                          tensor_parallel_size=2)):
        assert api().node_count() == 2
        with pytest.raises(RuntimeError, match="this engine's workers run on 2 nodes"):
            spanning.get_worker(kv)
    assert not os.path.exists(_pool_path(spanning))
