"""Direct mode: `MemKVOffloadingSpec` moves KV blocks between the engine's own KV tensors (GPU or
host) and the memkv cluster, with no CPU pool in front. Selected purely by configuration:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "MemKVOffloadingSpec",
        "spec_module_path": "memkv_vllm.spec", "block_size": 64}}'

Every direct-mode key sits directly in kv_connector_extra_config (memkv_vllm.direct.options);
connection settings come from MEMKV_CONFIG / MEMKV_* (memkv_vllm.core.config).

This module is the thin vLLM-facing shell: vLLM's objects become plain values through
`compat.api()` and the work is done by memkv_vllm.direct (manager.py in the scheduler, worker.py
in each worker, over memkv_vllm.offload.KVOffloader); vLLM's results are built from the plain
answers here, once, and what a failed load becomes is `LoadFailurePolicy`'s decision. The
recompute connector (memkv_vllm.vllm.connector) meets the manager and the worker through
`LoadErrorListener` and `LoadErrorReporter` (memkv_vllm.core.interface).

vLLM constructs the spec in the scheduler and in every worker; the workers build theirs first
(EngineCore initializes the KV caches before it makes the scheduler), each publishes its key
prefix, and the scheduler's manager adopts the prefix they agree on (memkv_vllm.direct.prefixes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from memkv_vllm.core.interface import Lookup
from memkv_vllm.direct.cluster import connect
from memkv_vllm.direct.load_failures import LoadFailurePolicy
from memkv_vllm.direct.manager import DirectManager
from memkv_vllm.direct.namespace import worker_layout
from memkv_vllm.direct.options import DirectOptions, parse_options
from memkv_vllm.direct.prefixes import PrefixBoard
from memkv_vllm.direct.rank_io import open_rank_io
from memkv_vllm.direct.worker import DirectWorker
from memkv_vllm.offload import KVOffloader, KVRef, PagedKV
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.metrics import StatsReporter, metric_definitions
from memkv_vllm.vllm.scheduler_side import end_step, warn_if_block_hashes_differ

logger = logging.getLogger("vllm.memkv_direct")  # under vLLM's logger so its handlers print it

_API = api()
_BASES = _API.direct_base_classes()


def _close(client: Any) -> None:
    """Close a shell's client (None: there is none) once its store stopped using it."""
    if client is not None:
        try:
            client.close()
        except Exception as e:
            logger.warning("memkv direct: client close failed: %s", e)


class MemKVLoadStoreSpec(_BASES.load_store_spec):  # type: ignore[name-defined]  # base made by compat
    """The cluster side of one job: its chunks (block hash, key group) in job order. Crosses
    from the scheduler to the workers by pickle, so it holds plain values only."""

    def __init__(self, chunks: Iterable[tuple[bytes, int]]) -> None:
        self.chunks = tuple((bytes(h), int(g)) for h, g in chunks)

    @staticmethod
    def medium() -> str:  # abstract in the oldest generations
        return "memkv"

    def __repr__(self) -> str:
        return f"MemKVLoadStoreSpec({len(self.chunks)} chunks)"


class MemKVOffloadingManager(_BASES.manager):  # type: ignore[name-defined]  # base made by compat
    """Scheduler side: vLLM's OffloadingManager calls, answered by `DirectManager`. Runs on the
    scheduler thread; nothing here raises into vLLM's hot path (a failing lookup is a miss).
    Implements `LoadErrorListener` for the recompute connector."""

    def __init__(self, logic: DirectManager, client: Any, kv_events: bool) -> None:
        self.logic = logic
        self._client = client
        self._events = kv_events
        self._locality = _API.locality(None)
        self._stats = StatsReporter()

    def lookup(self, key: bytes, req_context: Any) -> Any:
        try:
            return _API.lookup_result(self.logic.lookup(bytes(key),
                                                        _API.request_id(req_context)))
        except Exception:
            logger.exception("memkv direct: lookup failed; answering MISS")
            return _API.lookup_result(Lookup.MISS)

    def get_load_source(self, key: bytes, req_context: Any) -> Any:
        return _API.direct_load_source()  # only where vLLM asks a manager for it

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        return MemKVLoadStoreSpec(self.logic.prepare_load([bytes(k) for k in keys]))

    def touch(self, keys: Any, req_context: Any = None) -> None:
        return None  # the cluster keeps its own recency; newer vLLM never calls this

    def complete_load(self, keys: Any, req_context: Any = None) -> None:
        self.logic.complete_load([bytes(k) for k in keys])

    def on_load_errors(self) -> None:
        """`LoadErrorListener`: workers reported failed loads (to memkv's recompute connector),
        whose jobs are not completed yet."""
        try:
            self.logic.on_load_errors()
        except Exception:
            logger.exception("memkv direct: forgetting the failed loads' lookups failed")

    def prepare_store(self, keys: Any, req_context: Any = None) -> Any:
        todo = self.logic.prepare_store([bytes(k) for k in keys])
        return _API.prepare_store_output(
            todo, MemKVLoadStoreSpec(self.logic.store_details(todo)))

    def complete_store(self, keys: Any, req_context: Any = None, success: bool = True) -> None:
        self.logic.complete_store([bytes(k) for k in keys], success)

    def on_new_request(self, req_context: Any) -> Any:
        return _API.request_context()

    def on_request_finished(self, req_context: Any) -> None:
        return None

    def take_events(self) -> Iterable[Any]:
        stored, self.logic.stored_events = self.logic.stored_events, []
        if self._events:
            for keys in stored:
                yield _API.offloading_event(keys, removed=False, locality=self._locality)

    def on_schedule_end(self, context: Any = None) -> None:
        end_step(self.logic.on_schedule_end, context, logger, "direct")

    def has_pending_work(self) -> bool:
        return self.logic.has_pending_work()

    def reset_cache(self) -> None:
        self.logic.reset_cache()

    def get_stats(self) -> Any:
        return self._stats.report(self.logic.stats())

    def shutdown(self) -> None:
        self.logic.shutdown()
        _close(self._client)
        self._client = None


class MemKVOffloadingWorker(_BASES.worker):  # type: ignore[name-defined]  # base made by compat
    """Worker side: vLLM's OffloadingWorker calls, done by `DirectWorker`. Never blocks in
    submit_*, never raises, answers every job once (see memkv_vllm.direct.worker). Each job's
    specs are read once, here; `LoadFailurePolicy` decides what a failed load is reported as, and
    through it this worker implements `LoadErrorReporter` for the recompute connector."""

    def __init__(self, logic: DirectWorker, client: Any) -> None:
        self.logic = logic
        self.load_failures = LoadFailurePolicy()
        self._client = client

    def recompute_failed_loads(self) -> None:
        self.load_failures.recompute_failed_loads()

    def take_load_errors(self) -> set[int]:
        return self.load_failures.take_load_errors()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        try:
            gpu, chunks = _API.gpu_job(src_spec), dst_spec.chunks
        except Exception:  # DirectWorker answers its jobs; this guards the reading only
            logger.exception("memkv direct: store job %d unreadable", job_id)
            self.logic.answer_unstarted(job_id, is_load=False, block_ids=None)
            return True
        self.logic.submit_store(job_id, *gpu, chunks)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        try:
            gpu, chunks = _API.gpu_job(dst_spec), src_spec.chunks
        except Exception:
            logger.exception("memkv direct: load job %d unreadable", job_id)
            self.logic.answer_unstarted(job_id, is_load=True, block_ids=None)
            return True
        self.logic.submit_load(job_id, *gpu, chunks)
        if expedited:  # vLLM waits for it before this step's forward pass
            self.logic.prioritize([job_id])
        return True

    def get_finished(self) -> list[Any]:
        return [_API.transfer_result(f.job_id, f.nbytes, f.seconds,
                                     success=self.load_failures.success(f))
                for f in self.logic.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.logic.wait(job_ids)

    def shutdown(self) -> None:
        self.logic.shutdown()
        _close(self._client)
        self._client = None


class MemKVOffloadingSpec(_BASES.spec):  # type: ignore[name-defined]  # base made by compat
    """vLLM offloading spec of direct mode (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (vllm_config, kv_cache_config) or (config), by generation: passed on as given.
        super().__init__(*args, **kwargs)
        self.facts = _API.direct_facts(self)
        f = self.facts
        if f.pp_size != 1 or f.pcp_size != 1:
            raise ValueError(
                f"memkv direct mode does not support pipeline parallelism or prefill context "
                f"parallelism (pipeline_parallel_size={f.pp_size}, "
                f"prefill_context_parallel_size={f.pcp_size}): each stored block would hold "
                f"only part of a rank's KV")
        self.options: DirectOptions = parse_options(f.extra_config)
        self._manager: MemKVOffloadingManager | None = None
        self._worker: MemKVOffloadingWorker | None = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def _board(self, client: Any) -> PrefixBoard:
        return PrefixBoard(self.facts.engine_id, client, wait_s=self.options.prefix_wait_s,
                           spec_prefix=self.options.spec_prefix)

    def get_manager(self) -> MemKVOffloadingManager:
        if self._manager is None:
            f, o = self.facts, self.options
            store, client, cfg = connect(o.client_overrides, n_read_threads=1, n_write_threads=1,
                                         hit_ttl_s=o.lookup_hit_ttl_s,
                                         miss_ttl_s=o.lookup_miss_ttl_s)
            try:
                prefix = self._board(client).adopt(f.world_size)  # a mismatch stops the engine
            except Exception:
                store.close()
                _close(client)
                raise
            warn_if_block_hashes_differ(logger, "direct")
            self._manager = MemKVOffloadingManager(
                DirectManager(store, prefix, f.world_size, _API.split_offload_key,
                              stored_ttl_s=o.lookup_hit_ttl_s),
                client, kv_events=f.kv_events)
            logger.info("memkv direct: scheduler adopted key prefix %s from %d worker(s); %s",
                        prefix.hex(), f.world_size, cfg.describe())
        return self._manager

    def get_worker(self, kv_caches: Any) -> MemKVOffloadingWorker:
        if self._worker is None:
            self._worker = self._make_worker(kv_caches)
        return self._worker

    def _make_worker(self, kv_caches: Any) -> MemKVOffloadingWorker:
        f, o = self.facts, self.options
        tensors, groups = _API.canonical_kv(kv_caches)
        kv = PagedKV(tensors, [[KVRef(t, n) for t, n in g] for g in groups],
                     blocks_per_value=f.blocks_per_chunk)
        layout = worker_layout(
            model=f.model, revision=f.revision, dtype=f.dtype, tp_size=f.world_size,
            tokens_per_chunk=f.tokens_per_chunk, kv_layout=f.kv_layout, api=_API.name,
            value_bytes=kv.value_bytes, ref_bytes=[[n for _, n in g] for g in groups],
            hash_algo=_API.hash_algo(), spec_prefix=o.spec_prefix)
        io = open_rank_io(kv.device, o.scratch_medium, o.client_overrides,
                          key_prefix=(layout.prefix, "memkv_spec_prefix"),
                          n_read_threads=o.load_threads, n_write_threads=o.store_threads)
        store, client, cfg = io.store, io.client, io.cfg
        try:
            off = KVOffloader(kv, store, medium=io.scratch.medium, scratch_bytes=o.scratch_bytes,
                              device_io=io.scratch.device_io)
        except Exception:
            store.close()
            if client is not None:
                client.close()
            raise
        self._board(client).publish(f.rank, layout.prefix)
        logger.info(
            "memkv direct worker rank %d: value %s B per chunk of %d blocks (%d tokens), "
            "scratch medium %s, total scratch %d MiB (%s), key prefix %s, %s; %s", f.rank,
            "/".join(str(v) for v in kv.value_bytes), f.blocks_per_chunk, f.tokens_per_chunk,
            off.medium, off.n_slots * off.slot_bytes >> 20, off.describe(),
            layout.prefix.hex(), cfg.describe(), io.describe)
        return MemKVOffloadingWorker(
            DirectWorker(off, layout.prefix, f.rank, f.blocks_per_chunk, o.wait_timeout_s),
            client)
