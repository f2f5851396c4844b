"""`MemKVHiCacheStorage`: memkv (or Redis / Valkey, ``backend: redis``) as SGLang HiCache's L3
storage, loaded by SGLang's dynamic backend (docs/sglang.md):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "memkv", "module_path": "memkv_vllm.sglang",
      "class_name": "MemKVHiCacheStorage", "interface_v1": 1, "namespace": "team-a"}'

``interface_v1: 1`` makes SGLang's cache controller take the zero-copy calls
(`batch_get_v1` / `batch_set_v1`: segments move between the registered host pool and the
cluster); without it, it takes the copying `batch_get` / `batch_set` of flat pages. Both store the
same values, so either reads what the other wrote.

Settings: memkv's client settings (servers, backend, auth_key, op_timeout_s, ...) come from the
extra config, then the ``MEMKV_CONFIG`` file, then ``MEMKV_*`` (memkv_vllm.core.config); this
backend's own from the extra config (`OWN_DEFAULTS`).

Failures: none of the storage calls raises into SGLang's cache controller. A page that is
missing, evicted, corrupt (a value of the wrong length, or failing Redis' checksum), slow past
the client's timeout or on an unreachable server is a miss (False, or a shorter hit run), and the
controller recomputes it. Only a bad setting or an unsupported pool raises, at startup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from memkv_vllm.core.backends import client_or_none, store_for
from memkv_vllm.core.config import CONFIG_KEYS
from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.sglang.blocking import BlockingStore
from memkv_vllm.sglang.keys import PageKeys, namespace_fields
from memkv_vllm.sglang.pages import PageGeometry, leading_hits, page_runs

logger = logging.getLogger(__name__)

# This backend's own extra-config keys and their defaults.
OWN_DEFAULTS: dict[str, Any] = {
    "namespace": "default",  # the tenant: pages of two namespaces are never shared
    "prefix": "memkv",  # first component of every key
    "n_read_threads": 8,
    "n_write_threads": 8,
    "blocks_per_op": 16,
    "lookup_timeout_s": 5.0,
}
# Extra-config keys SGLang itself reads (the dynamic loader's, the zero-copy switch).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "tp_lcm_size"})


def split_settings(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(memkv client overrides, this backend's settings) from an SGLang extra config. Unknown
    keys are logged and ignored: a typo must not take the engine down."""
    extra = dict(extra or {})
    client = {k: v for k, v in extra.items() if k in CONFIG_KEYS}
    own = {k: type(d)(extra.get(k, d)) for k, d in OWN_DEFAULTS.items()}
    unknown = sorted(set(extra) - CONFIG_KEYS - set(OWN_DEFAULTS) - SGLANG_KEYS)
    if unknown:
        logger.warning("memkv sglang: ignoring unknown extra-config keys %s", unknown)
    if not own["namespace"]:
        raise ValueError("memkv sglang: 'namespace' must not be empty")
    return client, own


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


class MemKVHiCacheStorage(HiCacheStorage):
    """HiCacheStorage over memkv's block store. Thread-safe: SGLang's prefetch, backup and
    scheduler threads call it concurrently; every call blocks until its I/O is done."""

    def __init__(self, storage_config: HiCacheStorageConfig, _factory_kwargs: Any = None
                 ) -> None:
        # SGLang's dynamic loader passes (config, kwargs); the pool arrives by
        # register_mem_pool_host.
        self.storage_config = storage_config
        client_kw, own = split_settings(storage_config.extra_config)
        self._own = own
        self._client, self._cfg = client_or_none(client_kw, logger, "sglang")
        store = store_for(
            self._client, self._cfg,
            n_read_threads=own["n_read_threads"], n_write_threads=own["n_write_threads"],
            blocks_per_op=own["blocks_per_op"], lookup_timeout_s=own["lookup_timeout_s"])
        self._io = BlockingStore(store)
        self._geometry: PageGeometry | None = None
        self._keys: PageKeys | None = None
        self._buffers: list[tuple[int, int]] = []  # registered host pool memory (ptr, nbytes)
        self._metrics = StorageMetrics()
        logger.info("memkv sglang: %s servers=%s namespace=%r", self._cfg.backend,
                    ",".join(self._cfg.servers), own["namespace"])

    # ------------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's buffers with the store once and name the key namespace.
        Raises ValueError (attach fails) for a pool whose pages this backend cannot address."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = PageGeometry.of(mem_pool_host, bool(self.storage_config.is_mla_model))
        hybrid = getattr(mem_pool_host, "get_hybrid_pool_buffer", None)
        buffers = list(hybrid()) if callable(hybrid) else [mem_pool_host.kv_buffer]
        for buf in buffers:
            ptr, nbytes = int(buf.data_ptr()), _nbytes(buf)
            self._io.register(ptr, nbytes, owner=buf)
            self._buffers.append((ptr, nbytes))
        fields, rank = namespace_fields(self.storage_config, mem_pool_host, geometry,
                                        self._own["namespace"])
        model = self.storage_config.model_name or "unknown-model"
        layout = KeyLayout(self._own["prefix"], model, fields, rank)
        self._geometry, self._keys = geometry, PageKeys(layout, geometry.segments)
        self._gb_per_page = geometry.page_bytes / (1 << 30)
        logger.info("memkv sglang: key namespace %s (%s), %d segment(s) per page",
                    layout.namespace, layout.describe(), geometry.segments)

    # ------------------------------------------------------------------------ hybrid pools (v2)
    # Side pools of hybrid models (Mamba, SWA, DSA indexers, draft KV) are not stored: their
    # prefixes miss in L3, and SGLang recomputes them. Said once at registration, never raised.
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name != PoolName.KV:
            logger.warning("memkv sglang: host pool %r of a hybrid model is not stored; prefixes "
                           "that need it miss in L3", str(host_pool_name))

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or ()) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self.batch_get_v2(transfers)

    # ------------------------------------------------------------------------ zero copy (v1)
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of pages from the start of `keys` whose every segment is stored."""
        if self._keys is None or not keys:
            return 0
        try:
            present = self._io.present(self._keys.of_all(keys))
            return leading_hits(page_runs(present, self._keys.segments))
        except Exception as e:  # a miss, never an exception into the cache controller
            logger.warning("memkv sglang: batch_exists failed (%s); answering 0", e)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._v1(True, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._v1(False, keys, host_indices)

    def _v1(self, is_load: bool, keys: list[str], host_indices: Any) -> list[bool]:
        if not keys:
            return []
        if self._keys is None or self._geometry is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        try:
            ptrs, sizes = self._geometry.ranges(self.mem_pool_host, host_indices, len(keys))
            ok = self._io.transfer(is_load, self._keys.of_all(keys), ptrs, sizes)
        except Exception as e:
            logger.warning("memkv sglang: %s of %d pages failed (%s); answering misses",
                           "get" if is_load else "set", len(keys), e)
            return [False] * len(keys)
        pages = page_runs(ok, self._keys.segments)
        self._record(is_load, sum(pages), time.perf_counter() - t0)
        return pages

    def _record(self, is_load: bool, pages: int, seconds: float) -> None:
        """StorageMetrics of SGLang's zero-copy backends: pages per call and GB/s."""
        if pages == 0:
            return
        gbps = pages * self._gb_per_page / max(seconds, 1e-9)
        if is_load:
            self._metrics.prefetch_pgs.append(pages)
            self._metrics.prefetch_bandwidth.append(gbps)
        else:
            self._metrics.backup_pgs.append(pages)
            self._metrics.backup_bandwidth.append(gbps)

    # ------------------------------------------------------------------------ flat pages
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read page `key` into the flat data page `target_location`; it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read flat data pages (SGLang's copying path) into `target_locations`; per key the
        tensor, or None on a miss."""
        targets = list(target_locations or [None] * len(keys))
        ok = self._flat(True, keys, targets)
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat data pages; True when every page is stored."""
        return bool(keys) and all(self._flat(False, keys, list(values or [None] * len(keys))))

    def _flat(self, is_load: bool, keys: list[str], tensors: list[Any]) -> list[bool]:
        """Move flat data pages: each is split into its segments, so these are the values
        the zero-copy calls move. Tensors outside the host pool are registered for the call."""
        if not keys:
            return []
        geometry, page_keys = self._geometry, self._keys
        if geometry is None or page_keys is None or len(tensors) != len(keys):
            return [False] * len(keys)
        try:
            ready = [self._flat_view(t, geometry.page_bytes, is_load) for t in tensors]
        except Exception as e:
            logger.warning("memkv sglang: flat pages refused (%s)", e)
            return [False] * len(keys)
        usable = [i for i, r in enumerate(ready) if r is not None]
        rkeys: list[bytes] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for i in usable:
            p, s = geometry.flat_ranges(int(ready[i].data_ptr()))
            rkeys += page_keys.of(keys[i])
            ptrs += p
            sizes += s
        temp = [r for r in {id(r): r for r in (ready[i] for i in usable)}.values()
                if not self._in_pool(int(r.data_ptr()), _nbytes(r))]
        registered = []
        try:
            for r in temp:
                self._io.register(int(r.data_ptr()), _nbytes(r), owner=r)
                registered.append(r)
            ok = self._io.transfer(is_load, rkeys, ptrs, sizes)
        except Exception as e:
            logger.warning("memkv sglang: %s of %d flat pages failed (%s)",
                           "get" if is_load else "set", len(keys), e)
            ok = [False] * len(rkeys)
        finally:
            for r in registered:
                self._io.unregister(int(r.data_ptr()))
        pages = page_runs(ok, page_keys.segments)
        out = [False] * len(keys)
        for i, good in zip(usable, pages, strict=True):
            out[i] = good
            if good and is_load and ready[i] is not tensors[i]:
                tensors[i].copy_(ready[i])  # a non-contiguous target, read through a copy
        return out

    @staticmethod
    def _flat_view(t: Any, page_bytes: int, is_load: bool) -> Any:
        """A contiguous tensor of `page_bytes` holding (store) or receiving (load) `t`'s bytes,
        or None when `t` is no such page."""
        if t is None or not hasattr(t, "data_ptr") or _nbytes(t) != page_bytes:
            return None
        if t.is_contiguous():
            return t
        return t.contiguous() if not is_load else t.new_empty(t.shape)

    def _in_pool(self, ptr: int, nbytes: int) -> bool:
        return any(b <= ptr and ptr + nbytes <= b + n for b, n in self._buffers)

    def remote_keys(self, key: str) -> list[bytes]:
        """The memkv keys page `key` is stored under, one per segment (for operators and
        tests); empty before `register_mem_pool_host`."""
        return [] if self._keys is None else self._keys.of(key)

    # ------------------------------------------------------------------------ admin
    def clear(self) -> None:
        """memkv deletes no namespace at once: values stay until evicted (LRU). A deployment
        that needs an empty cache now starts a new `namespace`."""
        logger.warning("memkv sglang: clear() deletes nothing; namespace %r stays until its "
                       "values are evicted (set a new 'namespace' to start empty)",
                       self._own["namespace"])

    def get_stats(self) -> StorageMetrics:
        """Pages and GB/s of the zero-copy calls since the last call (SGLang's metrics)."""
        out, self._metrics = self._metrics, StorageMetrics()
        return out

    def memkv_stats(self) -> dict[str, int]:
        """The block store's counters (lookups, transfers, failures)."""
        return self._io.stats()

    def close(self) -> None:
        """Wait for running I/O, end the registrations and drop the connections."""
        self._io.close()
        if self._client is not None:
            self._client.close()
            self._client = None
