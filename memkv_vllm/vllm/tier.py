"""The `memkv` secondary tier: vLLM's CPU pool in front, the memkv cluster behind it.

Selected purely by configuration (no vLLM patch):

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "MemKVTieringOffloadingSpec",
        "cpu_bytes_to_use": 1073741824,
        "secondary_tiers": [{"type": "memkv", "servers": ["10.0.0.5:7390"]}]}}'

(vLLM's own "TieringOffloadingSpec" serves the tier as well, except on vLLM's CPU platform, but
keeps the CPU pool's /dev/shm file until a clean shutdown: tiering_spec.py.)
`register()` (the vllm.general_plugins hook) adds the "memkv" type to vLLM's tier factory, which
constructs this class in the scheduler process with every other key of the tier dict as a
keyword argument. One value per (block hash, KV-cache group) holds a whole pool row (all workers'
bytes for one offloaded chunk); rows move straight between the pool's shared memory and the
cluster through the block store (an `Offloader`). Every vLLM-generation difference goes through
`compat.api()`.

Tier keys (names and defaults of the product this replaces): prefix ("memkv"), n_read_threads
(8) and n_write_threads (8) (load / store operations in flight: `StoreOptions`), blocks_per_op
(8), max_store_backlog_mb (2048), lookup_timeout_s (5); and, as vLLM's fs and obj tiers take
them, locality ("REMOTE" or "LOCAL"; default REMOTE) and enable_kv_events (false). Any memkv
client setting (servers, auth_key, transport, op_timeout_s, ...) may be given too and wins over
MEMKV_CONFIG / MEMKV_* variables; with `"backend": "redis"` and `redis://` servers the blocks
live in Redis / Valkey (docs/redis.md).

What vLLM's own tiers promise, this one keeps (tests/tier/test_conformance.py): drain_jobs()
leaves every job's result available, the tier declares its medium and locality (so per-request
kv_load_tiers filters apply), publishes KV events when asked, shares blocks across parallel
layouts only where the layout makes a pool row's bytes the same (compat's `rows_portable`), and
works from the first call (the key namespace does not wait for vLLM's NONE_HASH).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from memkv_vllm import TIERING_SPEC
from memkv_vllm.core.backends import client_or_none, store_for
from memkv_vllm.core.interface import Lookup, Offloader
from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.core.request_lookups import RequestLookups
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.metrics import StatsReporter, metric_definitions
from memkv_vllm.vllm.scheduler_side import end_step, warn_if_block_hashes_differ
from memkv_vllm.vllm.tiering_spec import MemKVTieringOffloadingSpec

logger = logging.getLogger("vllm.memkv_tier")  # under vLLM's logger so its handlers print it

_API = api()

TIER_DEFAULTS: dict[str, Any] = {
    "prefix": "memkv",
    "n_read_threads": 8,
    "n_write_threads": 8,
    "blocks_per_op": 8,
    "max_store_backlog_mb": 2048,
    "lookup_timeout_s": 5.0,
}


class MemKVSecondaryTierManager(_API.SecondaryTierManager):  # type: ignore[name-defined]  # base made by compat
    """Secondary tier over a memkv cluster. All methods run on the scheduler thread."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "memkv",
        *,
        prefix: str = TIER_DEFAULTS["prefix"],
        n_read_threads: int = TIER_DEFAULTS["n_read_threads"],
        n_write_threads: int = TIER_DEFAULTS["n_write_threads"],
        blocks_per_op: int = TIER_DEFAULTS["blocks_per_op"],
        max_store_backlog_mb: float = TIER_DEFAULTS["max_store_backlog_mb"],
        lookup_timeout_s: float = TIER_DEFAULTS["lookup_timeout_s"],
        locality: str | None = None,
        enable_kv_events: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         **_API.tier_base_kwargs(kwargs))
        from memkv_vllm.core.config import OVERRIDE_KEYS

        client_kw = {k: v for k, v in kwargs.items() if k in OVERRIDE_KEYS}
        unknown = sorted(set(kwargs) - set(client_kw))
        if unknown:
            # New framework kwargs or typos must not stop the engine; say so once.
            logger.warning("memkv tier: ignoring unknown tier keys %s", unknown)
        # The base sets locality = None; REMOTE lets kv_load_tiers filters address this tier.
        # A value vLLM does not know raises here: a typo must not silently change filtering.
        self.locality = _API.locality(locality)
        self._events: list[Any] | None = self._events_list(bool(enable_kv_events),
                                                           offloading_spec)
        if isinstance(offloading_spec, _API.tiering_spec_class()) and not isinstance(
                offloading_spec, MemKVTieringOffloadingSpec):
            logger.info("memkv tier: vLLM's TieringOffloadingSpec keeps the CPU pool's /dev/shm "
                        "file until a clean shutdown; spec_name %s drops it once every process "
                        "mapped it (docs/tier.md)", TIERING_SPEC)

        # zero-copy; keeps the mapping alive for I/O
        self._arr: np.ndarray | None = np.asarray(primary_kv_view)
        self._row = int(self._arr.strides[0])
        self._rows = len(primary_kv_view)
        self._base = int(self._arr.ctypes.data)
        self._prefix = str(prefix)
        model, fields = self._namespace_fields(offloading_spec)
        # Named now: block hashes already depend on vLLM's hash seed (NONE_HASH, initialized
        # only after the tiers are built), so the namespace need not wait for it.
        self._layout = KeyLayout(self._prefix, model, fields)

        self._client, cfg = client_or_none(client_kw, logger, "tier")
        self._store: Offloader = store_for(
            self._client, cfg, key_prefix=(self._layout.key_start, "prefix"),
            n_read_threads=int(n_read_threads),
            n_write_threads=int(n_write_threads),
            blocks_per_op=int(blocks_per_op),
            lookup_timeout_s=float(lookup_timeout_s),
            max_store_backlog_bytes=int(float(max_store_backlog_mb) * (1 << 20)),
        )
        # The whole pool is the only memory this tier's jobs address: registered once.
        self._store.register_buffer(self._base, self._rows * self._row, owner=self._arr)
        logger.info("memkv tier: key namespace %s (%s)", self._layout.namespace,
                    self._layout.describe())
        # job id -> {remote key: offload key}, to report successful keys in vLLM's terms
        self._jobs: dict[int, dict[bytes, bytes]] = {}
        self._failed_now: list[Any] = []  # results decided at submit time
        self._stats = StatsReporter()
        self._lookups = RequestLookups(self._store)

        logger.info(
            "memkv tier: servers=%s transport=%s value=%d B (%d pool rows) read_threads=%d "
            "write_threads=%d blocks_per_op=%d lookup_timeout_s=%g max_store_backlog_mb=%g "
            "vllm_api=%s", ",".join(cfg.servers), cfg.transport, self._row, self._rows,
            n_read_threads, n_write_threads, blocks_per_op, lookup_timeout_s,
            max_store_backlog_mb, _API.name,
        )
        # Said once: now, or else at the first lookup (xxhash seeds are told by their length,
        # which only the first block hashes show).
        self._seed_checked = warn_if_block_hashes_differ(logger, "tier")

    def _events_list(self, requested: bool, spec: Any) -> list[Any] | None:
        """The event buffer take_events() drains, if the tier should publish events."""
        if not requested:
            return None
        if not _API.tiers_publish_events():
            logger.warning("memkv tier: enable_kv_events is set but this vLLM collects no KV "
                           "events from secondary tiers; the tier will not emit events")
            return None
        if not _API.kv_events_enabled(spec):
            logger.warning("memkv tier: enable_kv_events is set but KV cache events are disabled "
                           "globally (kv_events_config); the tier will not emit events")
            return None
        return []

    # ------------------------------------------------------------------ key namespace
    def _namespace_fields(self, spec: Any) -> tuple[str, dict[str, Any]]:
        try:
            model, fields = _API.spec_config_fields(spec, self._prefix)
        except Exception as e:
            # Only a spec that is not a real vLLM spec gets here (unit tests pass a stand-in);
            # prefix, value size and hash seed still separate namespaces.
            logger.warning("memkv tier: cannot read the offloading spec (%s); namespacing by "
                           "prefix, value size and hash seed only", e)
            model, fields = "unknown-model", {}
        fields["value_bytes"] = self._row
        return model, fields

    def remote_key(self, offload_key: bytes) -> bytes:
        """The memkv key of a vLLM OffloadKey (tests, debugging)."""
        return self._layout.key(*_API.split_offload_key(offload_key))

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: bytes, req_context: Any) -> Any:
        try:
            if not self._seed_checked:
                self._seed_checked = True
                warn_if_block_hashes_differ(logger, "tier")
            verdict = self._lookups.lookup(self.remote_key(key), _API.request_id(req_context))
            return _API.lookup_result(verdict)
        except Exception:  # the scheduler's hot path: a bug here must cost a miss, not the engine
            logger.exception("memkv tier: lookup failed; answering MISS")
            return _API.lookup_result(Lookup.MISS)

    def on_schedule_end(self, context: Any = None) -> None:
        end_step(self._lookups.end_step, context, logger, "tier")

    # ------------------------------------------------------------------ transfers
    def _submit(self, job: Any, is_load: bool) -> None:
        try:
            keys = list(job.keys)
            slots = _API.job_slots(job)
            if len(slots) != len(keys):
                raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
            bad = [s for s in slots if not 0 <= s < self._rows]
            if bad:  # never address memory outside the pool
                raise ValueError(f"pool slots {bad[:4]} out of range 0..{self._rows - 1}")
            rkeys = [self.remote_key(k) for k in keys]
            ptrs = [self._base + s * self._row for s in slots]
            sizes = [self._row] * len(slots)
            self._jobs[job.job_id] = dict(zip(rkeys, keys, strict=True))
            if is_load:
                self._store.submit_load(job.job_id, rkeys, ptrs, sizes)
            else:
                self._store.submit_store(job.job_id, rkeys, ptrs, sizes)
        except Exception as e:
            # Reported as a failed job: the manager frees the slots, the chunks get recomputed.
            logger.warning("memkv tier: %s job %s not started: %s",
                           "load" if is_load else "store", job.job_id, e)
            self._jobs.pop(job.job_id, None)
            self._failed_now.append(_API.job_result(job.job_id, False, successful_keys=()))

    def submit_store(self, job_metadata: Any) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: Any) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[Any]:
        out, self._failed_now = self._failed_now, []
        for c in self._store.poll():
            names = self._jobs.pop(c.job_id, {})
            ok_keys = [names[k] for k in c.ok_keys if k in names]
            if self._events is not None:
                # Stored blocks (skipped ones are in the cluster too), and loaded blocks the
                # cluster no longer holds: what a cache-aware router should know.
                changed = ok_keys if not c.is_load else [names[k] for k in c.gone_keys
                                                         if k in names]
                if changed:
                    self._events.append(_API.offloading_event(
                        changed, removed=c.is_load, locality=self.locality))
            out.append(_API.job_result(
                c.job_id, c.ok,
                successful_keys=ok_keys if c.is_load else None,
                transfer_time=c.seconds, transfer_bytes=c.nbytes,
            ))
        return out

    def take_events(self) -> Iterable[Any]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def drain_jobs(self) -> None:
        # Every job's result is available once this returns (the store keeps none back), as
        # vLLM's reset_cache requires.
        self._store.drain()

    def has_pending_work(self) -> bool:
        return bool(self._failed_now) or self._store.has_pending_lookups() or (
            self._store.has_pending_jobs())

    # ------------------------------------------------------------------ requests
    def on_new_request(self, req_context: Any) -> Any:
        return _API.request_context()

    def on_request_finished(self, req_context: Any) -> None:
        return None

    # ------------------------------------------------------------------ metrics
    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def get_stats(self) -> Any:
        return self._stats.report(self._store.stats())

    def store_stats(self) -> dict[str, int]:
        """Cumulative block-store counters (tests, debugging)."""
        return self._store.stats()

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        # Stop touching the pool before vLLM unmaps it, and let go of it so that it can.
        self._store.close()
        self._arr = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception as e:
                logger.warning("memkv tier: client close failed: %s", e)
            self._client = None


_API.declare_tier_class(MemKVSecondaryTierManager)
