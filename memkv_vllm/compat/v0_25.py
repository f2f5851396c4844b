"""vLLM 0.25 API generation, and the base every later generation overrides.

0.25 is the floor: it introduced `LookupResult`, `ScheduleEndContext`, tier metrics and the
`OffloadingWorker` API. Its specs are built from `(vllm_config, kv_cache_config)`, tier jobs are
`JobMetadata(job_id, keys, block_ids, is_promotion, req_context)`, `JobResult` is
`(job_id, success)` only, and the CPU pool's shared region is named by `instance_id`.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from collections.abc import Collection, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class VllmApi:
    """Everything memkv_vllm needs from vLLM, phrased version-free."""

    name = "0.25"
    # Can a promotion report which of its keys loaded (JobResult.successful_keys)?
    partial_results = False

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

    def __init__(self) -> None:
        from vllm.v1.kv_offload import base as kvb
        from vllm.v1.kv_offload.tiering import base as tb

        self.kvb = kvb
        self.tb = tb
        self.LookupResult = kvb.LookupResult
        self.SecondaryTierManager = tb.SecondaryTierManager

    # ------------------------------------------------------------------ tier construction
    def tier_base_kwargs(self, backpressure_detector: Any) -> dict[str, Any]:
        """Extra keyword arguments for SecondaryTierManager.__init__ (none before 0.31)."""
        return {}

    def remote_locality(self) -> Any:
        """The tier's `locality` (matched by a request's kv_load_tiers filter); 0.25 has none."""
        return None

    def request_context(self) -> Any:
        """The default per-request preference: offload new chunks only."""
        return self.kvb.RequestOffloadingContext()

    # ------------------------------------------------------------------ jobs
    def job_slots(self, job: Any) -> list[int]:
        """Primary-pool rows of a tier job, as Python ints (offsets must not wrap in int32)."""
        return [int(s) for s in job.block_ids]

    def job_result(self, job_id: int, success: bool, *,
                   successful_keys: Collection[bytes] | None = None,
                   transfer_time: float | None = None,
                   transfer_bytes: int | None = None) -> Any:
        return self.tb.JobResult(job_id=job_id, success=success)

    # ------------------------------------------------------------------ spec facts
    def spec_config_fields(self, spec: Any, prefix: str) -> tuple[str, dict[str, Any]]:
        """(model name, fields that change the KV bytes) for the key namespace.

        Starts from vLLM's own FileMapper run config (what the fs tier namespaces by) and adds what
        it misses: the resolved model dtype (0.25-0.26 FileMapper records the raw cache dtype,
        usually "auto", so a bf16 and an fp16 run of one model would collide) and the API
        generation (the KV byte layout changed at 0.29 without a FileMapper field).
        """
        from vllm.v1.kv_offload.file_mapper import FileMapper

        fields = dict(FileMapper.from_offloading_spec(prefix or "memkv", spec).get_run_config())
        model = str(fields.get("model_name", "unknown-model"))
        fields["model_dtype"] = self._model_dtype(spec)
        fields["vllm_api"] = self.name
        return model, fields

    def _model_dtype(self, spec: Any) -> str | None:
        vc = getattr(spec, "vllm_config", None)
        if vc is None:
            try:
                from vllm.config import get_current_vllm_config

                vc = get_current_vllm_config()
            except Exception:
                vc = None
        mc = getattr(vc, "model_config", None)
        return None if mc is None else str(mc.dtype).replace("torch.", "")

    def none_hash_digest(self) -> str | None:
        """Digest of the block-hash chain's seed, or None before vLLM initialized it.

        Different seeds give unrelated hashes; putting the seed in the namespace keeps engines
        with different seeds from even probing each other's keys.
        """
        from vllm.v1.core import kv_cache_utils

        nh = getattr(kv_cache_utils, "NONE_HASH", None)
        if nh is None:
            return None
        return hashlib.sha256(bytes(nh)).hexdigest()[:16]

    def block_hashes_reproducible(self) -> tuple[bool, str]:
        """Will another process compute the same block hashes? (answer, reason if not)."""
        if os.environ.get("PYTHONHASHSEED"):
            return True, ""
        kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
        if not hasattr(kcu, "get_none_hash_seed"):
            return False, "PYTHONHASHSEED is unset, so this vLLM seeds block hashes randomly"
        # 0.29+: a fixed seed for sha256/sha256_cbor, still a random one for xxhash. The algorithm
        # is not always visible from the scheduler, but xxh3-128 digests are 16 bytes long.
        algo = self._hash_algo() or ""
        nh = getattr(kcu, "NONE_HASH", None)
        if algo.startswith("xxhash") or (nh is not None and len(nh) == 16):
            return False, "prefix_caching_hash_algo=xxhash seeds block hashes randomly"
        return True, ""

    def _hash_algo(self) -> str | None:
        try:
            from vllm.config import get_current_vllm_config

            return str(get_current_vllm_config().cache_config.prefix_caching_hash_algo)
        except Exception:
            return None

    # ------------------------------------------------------------------ metrics
    def counter(self, doc: str, labels: Sequence[str] = ()) -> Any:
        return self.kvb.OffloadingCounterMetadata(documentation=doc, labelnames=tuple(labels))

    def gauge(self, doc: str, labels: Sequence[str] = ()) -> Any:
        return self.kvb.OffloadingGaugeMetadata(documentation=doc, labelnames=tuple(labels))

    def new_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        return OffloadingConnectorStats()

    # ------------------------------------------------------------------ CPU platform worker
    def is_cpu_platform(self) -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    def worker_rank(self, spec: Any) -> int:
        """Which per-worker area of a pool row this worker fills."""
        pc = spec.vllm_config.parallel_config
        return int(getattr(pc, "rank", 0)) % max(1, int(pc.world_size))

    def blocks_per_chunk(self, spec: Any) -> int:
        return int(spec.block_size_factor)

    def uses_canonical_layout(self, spec: Any) -> bool:
        return False

    def open_worker_region(self, spec: Any, rank: int) -> Any:
        """The worker's mapping of the CPU pool's /dev/shm region (what the tiers read)."""
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        return SharedOffloadRegion(
            instance_id=spec.vllm_config.instance_id,
            num_blocks=spec.num_blocks,
            rank=rank,
            kv_bytes_per_block=spec.kv_bytes_per_offloaded_block,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )

    def region_worker_view(self, region: Any, nbytes: int) -> Any:
        """Next (num_chunks, nbytes) int8 view of this worker's area for one KV tensor."""
        return region.create_next_view(nbytes)
