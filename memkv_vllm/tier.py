"""The `memkv` secondary tier: vLLM's CPU pool in front, the memkv cluster behind it.

Selected purely by configuration (no vLLM patch):

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1073741824,
        "secondary_tiers": [{"type": "memkv", "servers": ["10.0.0.5:7390"]}]}}'

`register()` (the vllm.general_plugins hook) adds the "memkv" type to vLLM's tier factory, which
constructs this class in the scheduler process with every other key of the tier dict as a
keyword argument. One value per (block hash, KV-cache group) holds a whole pool row (all workers'
bytes for one offloaded chunk); rows move straight between the pool's shared memory and the
cluster through `BlockStore`. Every vLLM-generation difference goes through `compat.api()`.

Tier keys (names and defaults of the product this replaces): prefix ("memkv"), n_read_threads
(8), n_write_threads (8), blocks_per_op (8), load_failure_grace_s (60), max_store_backlog_mb
(2048), lookup_timeout_s (5), locality ("remote"). Any memkv client setting (servers, auth_key,
transport, op_timeout_s, ...) may be given too and wins over MEMKV_CONFIG / MEMKV_* variables.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from memkv_vllm.compat import api
from memkv_vllm.keys import KeyLayout
from memkv_vllm.store import BlockStore, Lookup, StoreOptions

logger = logging.getLogger("vllm.memkv_tier")  # under vLLM's logger so its handlers print it

_API = api()
_LR = _API.LookupResult
_VERDICT = {Lookup.HIT: _LR.HIT, Lookup.MISS: _LR.MISS, Lookup.PENDING: _LR.RETRY}

TIER_DEFAULTS: dict[str, Any] = {
    "prefix": "memkv",
    "n_read_threads": 8,
    "n_write_threads": 8,
    "blocks_per_op": 8,
    "load_failure_grace_s": 60.0,
    "max_store_backlog_mb": 2048,
    "lookup_timeout_s": 5.0,
}

_M = "vllm:kv_offload_memkv_"
METRICS = {
    "lookups": (_M + "lookups", "counter", ("result",),
                "memkv tier lookups by answer (hit, miss, pending)."),
    "lookup_timeouts": (_M + "lookup_timeouts", "counter", (),
                        "memkv lookups answered MISS because the probe passed lookup_timeout_s."),
    "blocks": (_M + "blocks", "counter", ("op", "result"),
               "Offloaded chunks moved by the memkv tier (op: load/store; result: ok, failed, "
               "shed, skipped)."),
    "bytes": (_M + "bytes", "counter", ("op",), "Bytes moved by the memkv tier."),
    "store_backlog_bytes": (_M + "store_backlog_bytes", "gauge", (),
                            "Bytes of queued or in-flight memkv stores."),
    "held_loads": (_M + "held_load_jobs", "gauge", (),
                   "Timed-out loads whose pool slots are held for load_failure_grace_s."),
}
# store.stats() counter -> (metric, label values)
_COUNTERS = {
    "lookup_hit": ("lookups", ("hit",)),
    "lookup_miss": ("lookups", ("miss",)),
    "lookup_pending": ("lookups", ("pending",)),
    "lookup_timeouts": ("lookup_timeouts", ()),
    "load_blocks_ok": ("blocks", ("load", "ok")),
    "load_blocks_failed": ("blocks", ("load", "failed")),
    "store_blocks_ok": ("blocks", ("store", "ok")),
    "store_blocks_failed": ("blocks", ("store", "failed")),
    "store_blocks_shed": ("blocks", ("store", "shed")),
    "store_blocks_skipped": ("blocks", ("store", "skipped")),
    "load_bytes": ("bytes", ("load",)),
    "store_bytes": ("bytes", ("store",)),
}


def _make_client(tier_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(client or None, config). A bad setting raises (startup); an unreachable cluster does not."""
    from memkv_vllm.config import load_config

    cfg = load_config(tier_kwargs or None)
    try:
        from memkv_vllm.client import MemKVClient

        return MemKVClient.from_config(cfg), cfg
    except Exception as e:  # the engine must come up and recompute rather than die
        logger.error("memkv tier: cannot create the client (%s); every lookup will miss", e)
        return None, cfg


class MemKVSecondaryTierManager(_API.SecondaryTierManager):  # type: ignore[misc,name-defined]
    """Secondary tier over a memkv cluster. All methods run on the scheduler thread."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "memkv",
        *,
        backpressure_detector: Any = None,
        prefix: str = TIER_DEFAULTS["prefix"],
        n_read_threads: int = TIER_DEFAULTS["n_read_threads"],
        n_write_threads: int = TIER_DEFAULTS["n_write_threads"],
        blocks_per_op: int = TIER_DEFAULTS["blocks_per_op"],
        load_failure_grace_s: float = TIER_DEFAULTS["load_failure_grace_s"],
        max_store_backlog_mb: float = TIER_DEFAULTS["max_store_backlog_mb"],
        lookup_timeout_s: float = TIER_DEFAULTS["lookup_timeout_s"],
        locality: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         **_API.tier_base_kwargs(backpressure_detector))
        from memkv_vllm.config import CONFIG_KEYS

        client_kw = {k: v for k, v in kwargs.items() if k in CONFIG_KEYS}
        unknown = sorted(set(kwargs) - set(client_kw))
        if unknown:
            # New framework kwargs or typos must not stop the engine; say so once.
            logger.warning("memkv tier: ignoring unknown tier keys %s", unknown)
        # The base sets locality = None; REMOTE lets kv_load_tiers filters address this tier.
        loc = _API.remote_locality()
        if locality is not None and loc is not None:
            loc = type(loc)(locality.upper())
        self.locality = loc

        self._arr = np.asarray(primary_kv_view)  # zero-copy; keeps the mapping alive for I/O
        self._row = int(primary_kv_view.strides[0])
        self._rows = len(primary_kv_view)
        self._base = int(self._arr.ctypes.data)
        self._prefix = str(prefix)

        self._client, cfg = _make_client(client_kw)
        self._store = BlockStore(self._client, StoreOptions(
            n_read_threads=int(n_read_threads),
            n_write_threads=int(n_write_threads),
            blocks_per_op=int(blocks_per_op),
            lookup_timeout_s=float(lookup_timeout_s),
            load_failure_grace_s=float(load_failure_grace_s),
            max_store_backlog_bytes=int(float(max_store_backlog_mb) * (1 << 20)),
            load_timeout_s=float(cfg.op_timeout_s),
            lookup_lease_ms=int(cfg.lease_ms),
        ))
        self._model, self._fields = self._namespace_fields(offloading_spec)
        self._layout: KeyLayout | None = None
        # job id -> {remote key: offload key}, to report successful keys in vLLM's terms
        self._jobs: dict[int, dict[bytes, bytes]] = {}
        self._failed_now: list[Any] = []  # results decided at submit time (no namespace yet)
        self._reported: collections.Counter[str] = collections.Counter()

        logger.info(
            "memkv tier: servers=%s transport=%s value=%d B (%d pool rows) read_threads=%d "
            "write_threads=%d blocks_per_op=%d lookup_timeout_s=%g max_store_backlog_mb=%g "
            "vllm_api=%s", ",".join(cfg.servers), cfg.transport, self._row, self._rows,
            n_read_threads, n_write_threads, blocks_per_op, lookup_timeout_s,
            max_store_backlog_mb, _API.name,
        )
        self._warned_hashes = False
        self._warn_if_hashes_differ()

    def _warn_if_hashes_differ(self) -> None:
        if self._warned_hashes:
            return
        ok, why = _API.block_hashes_reproducible()
        if not ok:
            self._warned_hashes = True
            logger.warning(
                "memkv tier: %s; other processes will compute different block hashes and never "
                "hit this engine's blocks (set PYTHONHASHSEED to the same value everywhere)", why)

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

    def _key_layout(self) -> KeyLayout | None:
        # NONE_HASH is initialized after the tiers are built: name keys on first use.
        if self._layout is None:
            nh = _API.none_hash_digest()
            if nh is None:
                return None
            self._warn_if_hashes_differ()  # now the seed itself is known (xxhash: 16 bytes)
            self._layout = KeyLayout(self._prefix, self._model, {**self._fields, "none_hash": nh})
            logger.info("memkv tier: key namespace %s (%s)", self._layout.namespace,
                        self._layout.describe())
        return self._layout

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: bytes, req_context: Any) -> Any:
        try:
            layout = self._key_layout()
            if layout is None:
                return _LR.MISS
            return _VERDICT[self._store.lookup(layout.offload_key(key))]
        except Exception:  # the scheduler's hot path: a bug here must cost a miss, not the engine
            logger.exception("memkv tier: lookup failed; answering MISS")
            return _LR.MISS

    def on_schedule_end(self, context: Any = None) -> None:
        try:
            self._store.flush_lookups()  # this step's new keys: one exists batch
        except Exception:
            logger.exception("memkv tier: flushing lookups failed")

    # ------------------------------------------------------------------ transfers
    def _submit(self, job: Any, is_load: bool) -> None:
        try:
            layout = self._key_layout()
            keys = list(job.keys)
            slots = _API.job_slots(job)
            if layout is None or len(slots) != len(keys):
                raise ValueError("no key namespace yet" if layout is None else
                                 f"{len(keys)} keys for {len(slots)} slots")
            bad = [s for s in slots if not 0 <= s < self._rows]
            if bad:  # never address memory outside the pool
                raise ValueError(f"pool slots {bad[:4]} out of range 0..{self._rows - 1}")
            rkeys = [layout.offload_key(k) for k in keys]
            ptrs = [self._base + s * self._row for s in slots]
            sizes = [self._row] * len(slots)
            self._jobs[job.job_id] = dict(zip(rkeys, keys, strict=True))
            if is_load:
                self._store.submit_load(job.job_id, rkeys, ptrs, sizes, owner=self._arr)
            else:
                self._store.submit_store(job.job_id, rkeys, ptrs, sizes, owner=self._arr)
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
            out.append(_API.job_result(
                c.job_id, c.ok,
                successful_keys=ok_keys if c.is_load else None,
                transfer_time=c.seconds, transfer_bytes=c.nbytes,
            ))
        return out

    def drain_jobs(self) -> None:
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
        defs = {}
        for name, kind, labels, doc in METRICS.values():
            defs[name] = (_API.counter if kind == "counter" else _API.gauge)(doc, labels)
        return defs

    def get_stats(self) -> Any:
        now = self._store.stats()
        stats = _API.new_stats()
        changed = False
        for counter, (metric, labels) in _COUNTERS.items():
            delta = now.get(counter, 0) - self._reported[counter]
            if delta > 0:
                stats.increase_counter(METRICS[metric][0], delta, labels)
                self._reported[counter] = now.get(counter, 0)
                changed = True
        for metric, value in (("store_backlog_bytes", now["store_backlog_bytes"]),
                              ("held_loads", now["load_jobs_held_now"])):
            if value != self._reported["gauge:" + metric]:
                stats.set_gauge(METRICS[metric][0], value)
                self._reported["gauge:" + metric] = value
                changed = True
        return stats if changed else None

    def store_stats(self) -> dict[str, int]:
        """Cumulative block-store counters (tests, debugging)."""
        return self._store.stats()

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        # Stop touching the pool before vLLM unmaps it.
        self._store.close()
        if self._client is not None:
            try:
                self._client.close()
            except Exception as e:
                logger.warning("memkv tier: client close failed: %s", e)
            self._client = None
