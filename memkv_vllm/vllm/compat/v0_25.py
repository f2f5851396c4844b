"""vLLM 0.25: the floor.

0.25 introduced `LookupResult`, `ScheduleEndContext`, tier metrics and the `OffloadingWorker`
API. Its specs are built from `(vllm_config, kv_cache_config)`, tier jobs are
`JobMetadata(job_id, keys, block_ids, is_promotion, req_context)`, `JobResult` is
`(job_id, success)` only, and the CPU pool's shared region is named by `instance_id`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from memkv_vllm.vllm.compat.base import DirectFacts, VllmAdapter


class Api025(VllmAdapter):
    name = "0.25"

    @staticmethod
    def probe() -> bool:
        try:
            from vllm.v1.kv_offload import base as kvb
            from vllm.v1.kv_offload.tiering import base as tb
        except ImportError:
            return False
        return all(
            (hasattr(kvb, "LookupResult"), hasattr(kvb, "OffloadingWorker"),
             hasattr(tb, "SecondaryTierManager"))
        )

    # ------------------------------------------------------------------ jobs
    def job_slots(self, job: Any) -> list[int]:
        return [int(s) for s in job.block_ids]

    def job_result(self, job_id: int, success: bool, *,
                   successful_keys: Collection[bytes] | None = None,
                   transfer_time: float | None = None,
                   transfer_bytes: int | None = None) -> Any:
        # All or nothing: a partly failed promotion frees every slot (keys get recomputed).
        return self.tb.JobResult(job_id=job_id, success=success)

    # ------------------------------------------------------------------ spec facts
    def spec_config_fields(self, spec: Any, prefix: str) -> tuple[str, dict[str, Any]]:
        """Adds to the FileMapper fields (see the base class) what they miss: the resolved model
        dtype (0.25-0.26 FileMapper records the raw cache dtype, usually "auto", so a bf16 and an
        fp16 run of one model would collide) and the API generation (the KV byte layout changed
        at 0.29 without a FileMapper field), and keeps the parallel sizes in them unless the
        pool's rows are portable (`rows_portable`)."""
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.from_offloading_spec(prefix or "memkv", spec,
                                                 parallel_agnostic=self.rows_portable(spec))
        fields = dict(mapper.get_run_config())
        model = str(fields.get("model_name", "unknown-model"))
        fields["model_dtype"] = self._model_dtype(spec)
        fields["vllm_api"] = self.name
        return model, fields

    # ------------------------------------------------------------------ CPU platform worker
    def worker_rank(self, spec: Any) -> int:
        pc = spec.vllm_config.parallel_config
        return int(getattr(pc, "rank", 0)) % max(1, int(pc.world_size))

    def blocks_per_chunk(self, spec: Any) -> int:
        return int(spec.block_size_factor)

    def engine_id(self, spec: Any) -> str:
        return str(spec.vllm_config.instance_id)  # 0.25 names it the instance id

    def open_worker_region(self, spec: Any, rank: int) -> Any:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        return SharedOffloadRegion(
            instance_id=self.engine_id(spec),
            num_blocks=spec.num_blocks,
            rank=rank,
            kv_bytes_per_block=spec.kv_bytes_per_offloaded_block,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )

    def region_worker_view(self, region: Any, nbytes: int) -> Any:
        return region.create_next_view(nbytes)

    # ------------------------------------------------------------------ direct mode
    def direct_facts(self, spec: Any) -> DirectFacts:
        vc = spec.vllm_config
        mc, pc = vc.model_config, vc.parallel_config
        dtype = str(vc.cache_config.cache_dtype)
        if dtype == "auto":
            dtype = str(mc.dtype).replace("torch.", "")
        bpc = int(spec.block_size_factor)
        return DirectFacts(
            model=str(mc.model), revision=getattr(mc, "revision", None), dtype=dtype,
            tp_size=int(pc.tensor_parallel_size), pp_size=int(pc.pipeline_parallel_size),
            pcp_size=int(getattr(pc, "prefill_context_parallel_size", 1)),
            dcp_size=int(getattr(pc, "decode_context_parallel_size", 1)),
            world_size=int(pc.world_size), rank=int(getattr(pc, "rank", 0)),
            blocks_per_chunk=bpc, tokens_per_chunk=bpc * int(min(spec.gpu_block_size)),
            kv_layout="HND", engine_id=self.engine_id(spec),
            extra_config=dict(spec.extra_config),
            kv_events=bool(spec.kv_events_config.enable_kv_cache_events))

