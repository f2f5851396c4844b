"""vLLM 0.26-0.27: specs are built from one `OffloadingConfig`.

`spec.config` replaces `vllm_config`/`kv_cache_config`, `blocks_per_chunk` replaces
`block_size_factor`, and the shared CPU-pool region is named by the engine id. (0.27 adds
`Locality`/`Medium` on tiers and the replicated layout; both are read by attribute.)
"""

from __future__ import annotations

import importlib.util
from typing import Any

from memkv_vllm.vllm.compat.base import DirectFacts
from memkv_vllm.vllm.compat.v0_25 import Api025


class Api026(Api025):
    name = "0.26"

    @staticmethod
    def probe() -> bool:
        return Api025.probe() and importlib.util.find_spec("vllm.v1.kv_offload.config") is not None

    def locality(self, name: str | None) -> Any:
        # 0.26 defines Locality but no tier attribute reads it yet; 0.27+ filters on it.
        loc = self.kvb.Locality
        if name is None:
            return loc.REMOTE
        try:
            return loc(name)
        except ValueError:
            # Worded like vLLM's own tiers' error (Locality(value)), plus the valid values.
            raise ValueError(f"memkv tier: {name!r} is not a valid Locality (one of "
                             f"{', '.join(repr(v.value) for v in loc)})") from None

    def worker_rank(self, spec: Any) -> int:
        if getattr(spec, "replicated_layout", False):
            return 0  # one copy of the KV for all workers, in worker 0's area
        par = spec.config.parallel
        return int(par.rank) % max(1, int(par.world_size))

    def blocks_per_chunk(self, spec: Any) -> int:
        return int(spec.blocks_per_chunk)

    def uses_canonical_layout(self, spec: Any) -> bool:
        return bool(getattr(spec.config, "canonical_layout", False))

    def engine_id(self, spec: Any) -> str:
        return str(spec.config.engine_id)

    def open_worker_region(self, spec: Any, rank: int) -> Any:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        # 0.28-0.29 name the row size kv_bytes_per_chunk while the region still says "block".
        kv_bytes = getattr(spec, "kv_bytes_per_chunk", None)
        if kv_bytes is None:
            kv_bytes = spec.kv_bytes_per_offloaded_block
        return SharedOffloadRegion(
            engine_id=self.engine_id(spec),
            num_blocks=spec.num_blocks,
            rank=rank,
            kv_bytes_per_block=kv_bytes,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )

    # ------------------------------------------------------------------ direct mode
    def direct_facts(self, spec: Any) -> DirectFacts:
        cfg = spec.config
        par = cfg.parallel
        mc = self._current_model_config()
        dtype = str(cfg.model.dtype)
        if dtype == "auto" and mc is not None:  # 0.26 records the raw cache dtype
            dtype = str(mc.dtype).replace("torch.", "")
        bpc = int(spec.blocks_per_chunk)
        # 0.29+ records the layout (and requires a block-leading "LBHNC" unless set); before,
        # the connector required "HND".
        layout = getattr(cfg, "kv_cache_layout", None) or (
            "LBHNC" if hasattr(cfg, "kv_cache_layout") else "HND")
        return DirectFacts(
            model=str(cfg.model.name), revision=getattr(mc, "revision", None), dtype=dtype,
            tp_size=int(par.tp_size), pp_size=int(par.pp_size), pcp_size=int(par.pcp_size),
            dcp_size=int(par.dcp_size), world_size=int(par.world_size), rank=int(par.rank),
            blocks_per_chunk=bpc, tokens_per_chunk=bpc * int(min(spec.tokens_per_block)),
            kv_layout=str(layout), engine_id=self.engine_id(spec),
            extra_config=dict(cfg.extra_config),
            kv_events=bool(cfg.enable_kv_cache_events))

