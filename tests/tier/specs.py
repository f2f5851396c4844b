"""Real vLLM offloading specs for the conformance suite, built without a GPU or a running model.

`SpecEngine` builds vLLM's own `TieringOffloadingSpec` and lets `spec.get_manager()` create the
CPU pool's shared region, the secondary tiers (through `SecondaryTierFactory`) and the
`TieringOffloadingManager`, exactly as the connector does in the scheduler process. Every engine
has a CPU pool of 16 chunks of ROW bytes (all workers' bytes of one chunk) and one full-attention
KV-cache group of two layers whose 4 KV heads are sharded over the TP ranks.

vLLM 0.26+ builds a spec from one `OffloadingConfig` (plain dataclasses, whose fields differ per
generation: filled by name); `agnostic` is vLLM's verdict on whether the layout is
parallelism-agnostic (`OffloadingParallelConfig.is_parallelism_agnostic`), `canonical` asks for
vLLM's canonical layout (`OffloadingConfig.canonical_layout`, where the generation has it; the
scheduler side only: no worker is built). vLLM 0.25 builds it
from a real `VllmConfig` (which reads the tiny model's config.json) and a `KVCacheConfig`; there
vLLM's FileMapper decides agnosticism from the KV-cache spec itself, so `agnostic=False` uses an
MLA spec, the layout 0.25 excludes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from harness import ROW, Engine

HAVE_OFFLOADING_CONFIG = importlib.util.find_spec("vllm.v1.kv_offload.config") is not None

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, NUM_CHUNKS = 4, 8, 16, 16


@functools.cache
def tiny_model() -> str:
    """The tiny model scripts/setup-vllm.sh makes (built in a temporary folder if missing)."""
    path = Path(os.environ.get("TINY_MODEL", ROOT / ".cache" / "tinymodel"))
    if not (path / "config.json").exists():
        path = Path(tempfile.mkdtemp(prefix="memkv-tinymodel-"))
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)],
                       check=True, capture_output=True)
    return str(path)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """An instance of a vLLM config dataclass from the fields this generation has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def _extra_config(cls: type, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spec_name": cls.__name__, "cpu_bytes_to_use": NUM_CHUNKS * ROW,
            "secondary_tiers": [dict(t) for t in tiers]}


def _spec_from_offloading_config(cls: type, tiers: list[dict[str, Any]], *, tp_size: int,
                                 agnostic: bool, kv_events: bool, dtype: str,
                                 canonical: bool) -> Any:
    from vllm.v1.kv_offload import config as oc

    config = _build(oc.OffloadingConfig, {
        "groups": (_build(oc.OffloadingGroupConfig, {
            "tokens_per_block": BLOCK_TOKENS, "block_size": BLOCK_TOKENS, "layer_names": LAYERS,
            "group_id": 0}),),
        "worker_kv_bytes_per_block": ROW // tp_size,
        "enable_kv_cache_events": kv_events,
        "extra_config": _extra_config(cls, tiers),
        "engine_id": f"memkv-conformance-{uuid.uuid4().hex[:12]}",
        "model": _build(oc.OffloadingModelConfig, {"name": "conformance/tiny", "dtype": dtype}),
        "cache": _build(oc.OffloadingCacheConfig, {"tokens_per_hash": BLOCK_TOKENS,
                                                   "blocks_per_chunk": 1}),
        "parallel": _build(oc.OffloadingParallelConfig, {
            "rank": 0, "world_size": tp_size, "tp_size": tp_size, "pp_size": 1, "pcp_size": 1,
            "dcp_size": 1, "data_parallel_index": 0, "data_parallel_size": 1,
            "data_parallel_rank_local": None, "is_parallelism_agnostic": agnostic}),
        "canonical_layout": canonical,
    })
    return cls(config)


def _spec_from_vllm_config(cls: type, tiers: list[dict[str, Any]], *, tp_size: int,
                           agnostic: bool, kv_events: bool, dtype: str, canonical: bool) -> Any:
    assert not canonical, "vLLM 0.25 has no canonical layout"
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
    )

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=tiny_model(), dtype=dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                            kv_role="kv_both",
                                            kv_connector_extra_config=_extra_config(cls, tiers)))
    if agnostic:
        kv_spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS // tp_size,
                                    head_size=HEAD_SIZE, dtype=torch.float32)
    else:  # a latent vector per token instead of K and V per head: same page size
        kv_spec = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS // tp_size,
                                   head_size=2 * HEAD_SIZE, dtype=torch.float32)
    page = kv_spec.page_size_bytes
    assert page * len(LAYERS) * tp_size == ROW, page
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_CHUNKS,
        kv_cache_tensors=[KVCacheTensor(size=page * NUM_CHUNKS, shared_by=[name])
                          for name in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), kv_spec)])
    return cls(vllm_config, kv_cache_config)


def tiering_spec(cls: type | None = None, tiers: list[dict[str, Any]] | None = None, *,
                 tp_size: int = 1, agnostic: bool = True, kv_events: bool = False,
                 dtype: str = "float32", canonical: bool = False) -> Any:
    """A real tiering spec of class `cls` (vLLM's TieringOffloadingSpec by default, or a subclass)
    for a fresh engine, with `tiers` as its secondary tiers (none by default)."""
    if cls is None:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec as cls
    build = _spec_from_offloading_config if HAVE_OFFLOADING_CONFIG else _spec_from_vllm_config
    return build(cls, tiers or [], tp_size=tp_size, agnostic=agnostic, kv_events=kv_events,
                 dtype=dtype, canonical=canonical)


class SpecEngine(Engine):
    """An `Engine` whose manager comes from a real TieringOffloadingSpec.get_manager()."""

    def __init__(self, tier_config: dict[str, Any], *, tp_size: int = 1, agnostic: bool = False,
                 kv_events: bool = False, dtype: str = "float32", canonical: bool = False
                 ) -> None:
        # Upstream's spec class, which serves the tier as it is: no worker is built here.
        self.spec = tiering_spec(tiers=[tier_config], tp_size=tp_size, agnostic=agnostic,
                                 kv_events=kv_events, dtype=dtype, canonical=canonical)
        self.manager = self.spec.get_manager()
        self.primary = self.manager.primary_tier
        (self.tier,) = self.manager.secondary_tiers
        self.pool: np.ndarray | None = np.asarray(self.primary.get_kv_memoryview())
        assert self.pool.shape == (NUM_CHUNKS, ROW), self.pool.shape

    def shutdown(self) -> None:
        if self.pool is None:
            return  # already shut down (tests may do it themselves)
        # vLLM closes the pool's mapping at shutdown, which fails while an export of it (this
        # array) is still alive.
        self.pool = None
        self.manager.shutdown()
