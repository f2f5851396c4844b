"""Real `MemKVOffloadingSpec`s built the way vLLM builds them, without a model running: from an
`OffloadingConfig` (vLLM 0.26+) or from a `VllmConfig` + `KVCacheConfig` (0.25), one per process
role (the scheduler is rank 0, workers have their own rank), the engine configs a connector is
built from, plus vLLM's canonical KV caches over host tensors, which is what the
OffloadingConnector hands a worker."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tier"))
from specs import tiny_model  # noqa: E402

HAVE_OFFLOADING_CONFIG = importlib.util.find_spec("vllm.v1.kv_offload.config") is not None
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_TOKENS, NUM_BLOCKS, PAGE = 16, 32, 512


def _build(cls: type, values: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def make_spec(extra: dict[str, Any], *, engine_id: str, rank: int = 0, tp_size: int = 1,
              pp_size: int = 1, blocks_per_chunk: int = 2) -> Any:
    from memkv_vllm.vllm.spec import MemKVOffloadingSpec

    extra = {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.spec",
             "block_size": BLOCK_TOKENS * blocks_per_chunk, **extra}
    if HAVE_OFFLOADING_CONFIG:
        from vllm.v1.kv_offload import config as oc

        return MemKVOffloadingSpec(_build(oc.OffloadingConfig, {
            "groups": (_build(oc.OffloadingGroupConfig, {
                "tokens_per_block": BLOCK_TOKENS, "layer_names": LAYERS, "group_id": 0}),),
            "worker_kv_bytes_per_block": PAGE * len(LAYERS),
            "enable_kv_cache_events": False,
            "extra_config": extra,
            "engine_id": engine_id,
            "model": _build(oc.OffloadingModelConfig, {"name": tiny_model(), "dtype": "float32"}),
            "cache": _build(oc.OffloadingCacheConfig, {"tokens_per_hash": BLOCK_TOKENS,
                                                       "blocks_per_chunk": blocks_per_chunk}),
            "parallel": _build(oc.OffloadingParallelConfig, {
                "rank": rank, "world_size": tp_size * pp_size, "tp_size": tp_size,
                "pp_size": pp_size, "pcp_size": 1, "dcp_size": 1, "data_parallel_index": 0,
                "data_parallel_size": 1, "data_parallel_rank_local": None,
                "is_parallelism_agnostic": False}),
        }))
    return MemKVOffloadingSpec(*engine_configs(extra, engine_id=engine_id, rank=rank,
                                               tp_size=tp_size, pp_size=pp_size))


def engine_configs(extra: dict[str, Any], *, engine_id: str, rank: int = 0, tp_size: int = 1,
                   pp_size: int = 1, connector: str = "OffloadingConnector",
                   **transfer: Any) -> tuple[Any, Any]:
    """(VllmConfig, KVCacheConfig) of an engine on the tiny model whose KV transfer config names
    `connector` with `extra` (and `transfer`'s other KVTransferConfig fields): what vLLM hands a
    connector, and on 0.25 a spec."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=tiny_model(), dtype="float32"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size,
                                       pipeline_parallel_size=pp_size),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            engine_id=engine_id,
                                            kv_connector_extra_config=extra, **transfer))
    vllm_config.instance_id = engine_id
    vllm_config.parallel_config.rank = rank
    kv_spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=4,
                                dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        # One tensor per layer, in the fields of this generation (newer ones place layers by
        # strides, older ones name who shares the tensor).
        kv_cache_tensors=[_build(KVCacheTensor, {
            "size": kv_spec.page_size_bytes * NUM_BLOCKS, "shared_by": [name], "layers": [name],
            "layer_stride": kv_spec.page_size_bytes * NUM_BLOCKS,
            "block_stride": kv_spec.page_size_bytes}) for name in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), kv_spec)])
    return vllm_config, kv_cache_config


def canonical_kv(seed: int) -> tuple[Any, list[torch.Tensor]]:
    """vLLM's CanonicalKVCaches over two host layers of PAGE-byte blocks, random bytes."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=g)
          for _ in LAYERS]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in ts],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(len(ts))]]), ts
