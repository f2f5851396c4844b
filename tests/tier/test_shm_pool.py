"""The CPU pool's /dev/shm name on every platform, with vLLM's real TieringOffloadingSpec and
SharedOffloadRegion: the spec the plugin installs makes the scheduler unlink the name once it has
mapped the pool the workers created, and a worker's shutdown then leaves a newer engine's file
alone. No engine: the worker side is the region vLLM's worker maps (through compat), so this runs
on the GPU build without a GPU too (tests/e2e/test_shm_cleanup.py covers a real CPU-platform
engine; test_compat.py checks that the plugin installs this spec)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.shm_region import forget_dropped_name_at_shutdown, tiering_spec_class

PAGE = 4096  # KV bytes per block and worker: one page, so a pool row needs no padding


def _build(cls: type, **values: Any) -> Any:
    """`cls` (a vLLM config dataclass) from the fields of `values` it has; vLLM adds fields
    between releases, and one without a default that this test does not know fails loudly."""
    fields = dataclasses.fields(cls)
    unknown = [f.name for f in fields if f.name not in values
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    assert not unknown, f"{cls.__name__} needs {unknown}: add them to this test"
    return cls(**{f.name: values[f.name] for f in fields if f.name in values})


def _offloading_config(engine_id: str, chunks: int) -> Any:
    """An OffloadingConfig as vLLM builds it for a one-worker engine (0.26+)."""
    cfg = pytest.importorskip("vllm.v1.kv_offload.config",
                              reason="vLLM 0.25 builds specs from a VllmConfig")
    return _build(
        cfg.OffloadingConfig,
        groups=(_build(cfg.OffloadingGroupConfig, tokens_per_block=16, layer_names=("l0",),
                       group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunks * PAGE, "secondary_tiers": []},
        engine_id=engine_id,
        model=_build(cfg.OffloadingModelConfig, name="tiny", dtype="float32",
                     max_model_len=1024),
        cache=_build(cfg.OffloadingCacheConfig, tokens_per_hash=16, blocks_per_chunk=1),
        parallel=_build(cfg.OffloadingParallelConfig, rank=0, world_size=1, tp_size=1,
                        pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
                        data_parallel_size=1, data_parallel_rank_local=None,
                        is_parallelism_agnostic=True),
    )


@pytest.fixture
def spec() -> Iterator[tuple[Any, str]]:
    """The plugin's tiering spec for a fresh engine id, and the pool file vLLM names after it;
    removes that file if a test left it."""
    engine_id = f"memkv-test-{uuid.uuid4().hex[:12]}"
    s = tiering_spec_class()(_offloading_config(engine_id, 8))
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    yield s, path
    manager = getattr(s, "_manager", None)
    if manager is not None:
        manager.shutdown()
    if os.path.exists(path):
        os.unlink(path)


def test_the_scheduler_unlinks_the_pool_the_worker_created(spec) -> None:
    a = api()
    spec, path = spec
    worker_region = a.open_worker_region(spec, 0)  # what vLLM's worker maps, before the scheduler
    try:
        assert worker_region.mmap_path == path and os.path.exists(path)
        view = a.region_worker_view(worker_region, PAGE)
        view[3, :4] = view.new_tensor([1, 2, 3, 4])
        manager = spec.get_manager()
        assert not os.path.exists(path)  # the name is gone ...
        pool = np.asarray(a.scheduler_region(spec).create_kv_memoryview())
        assert pool[3, :4].tobytes() == b"\x01\x02\x03\x04"  # ... and both map the same memory
        assert manager is spec.get_manager()
    finally:
        worker = type("Worker", (), {"shutdown": lambda self: worker_region.cleanup()})()
        forget_dropped_name_at_shutdown(worker, worker_region)
        with open(path, "wb"):  # a newer engine with the same engine id
            pass
        worker.shutdown()
    assert os.path.exists(path)  # the old worker's clean-up left the newer file alone


def test_a_scheduler_that_created_the_pool_keeps_its_name(spec) -> None:
    spec, path = spec
    spec.get_manager()  # no worker mapped it first: workers may still have to find it by name
    assert api().scheduler_region(spec).mmap_path == path and os.path.exists(path)
