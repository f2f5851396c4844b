"""The direct-mode keys of kv_connector_extra_config, parsed once at startup.

Every key sits directly in kv_connector_extra_config (names and defaults of the product this
replaces). A bad value raises `ConfigError` naming the key, so the engine refuses to start instead
of running with a setting nobody asked for. Connection settings (servers, auth_key, transport,
op_timeout_s, lease_ms, ...) come from the MEMKV_* chain (memkv_vllm.core.config); any of them given
in
kv_connector_extra_config wins over MEMKV_CONFIG and the environment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from memkv_vllm.core.config import CONFIG_KEYS, ConfigError
from memkv_vllm.offload.movers import MEDIUMS

_SOURCE = "kv_connector_extra_config"


@attrs.frozen
class DirectOptions:
    scratch_medium: str = "auto"
    num_threads: int = 4
    scratch_mb_per_thread: int = 128
    # Load / store operations in flight per worker (the store's n_read_threads / n_write_threads;
    # the keys keep their names, no thread is made per operation).
    load_threads: int = 4
    store_threads: int = 4
    wait_timeout_s: float = 120.0
    lookup_miss_ttl_s: float = 30.0
    lookup_hit_ttl_s: float = 30.0
    spec_prefix: str = ""
    # How long the scheduler waits at startup for every rank's key prefix (direct/prefixes.py).
    prefix_wait_s: float = 10.0
    client_overrides: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def scratch_bytes(self) -> int:
        return self.num_threads * self.scratch_mb_per_thread << 20


def _int(key: str, raw: Any, lo: int, hi: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ConfigError(key, _SOURCE, f"expected an integer, got {raw!r}")
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(key, _SOURCE, f"expected an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(key, _SOURCE, f"{v} is outside {lo}..{hi}")
    return v


def _seconds(key: str, raw: Any, lo: float) -> float:
    if isinstance(raw, bool):
        raise ConfigError(key, _SOURCE, f"expected seconds, got {raw!r}")
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(key, _SOURCE, f"expected seconds, got {raw!r}") from None
    if not math.isfinite(v) or v < lo or v > 86_400:
        raise ConfigError(key, _SOURCE, f"{v} is outside {lo:g}..86400 s")
    return v


def parse_options(extra: Mapping[str, Any]) -> DirectOptions:
    """The direct-mode options of one kv_connector_extra_config. Raises ConfigError."""
    unknown = sorted(k for k in extra if k.startswith("memkv_") and k not in _KEYS)
    if unknown:
        # A typo in a memkv key must not silently fall back to a default.
        raise ConfigError(unknown[0], _SOURCE,
                          f"unknown direct-mode key; known: {', '.join(sorted(_KEYS))}")
    medium = str(extra.get("memkv_scratch_medium", "auto"))
    if medium not in MEDIUMS:
        raise ConfigError("memkv_scratch_medium", _SOURCE,
                          f"{medium!r} is not one of {', '.join(MEDIUMS)}")
    threads = _int("memkv_num_threads", extra.get("memkv_num_threads", 4), 1, 256)
    prefix = extra.get("memkv_spec_prefix", "")
    if not isinstance(prefix, str):
        raise ConfigError("memkv_spec_prefix", _SOURCE, f"expected a string, got {prefix!r}")
    return DirectOptions(
        scratch_medium=medium,
        num_threads=threads,
        scratch_mb_per_thread=_int("memkv_scratch_mb_per_thread",
                                   extra.get("memkv_scratch_mb_per_thread", 128), 1, 1 << 16),
        load_threads=_int("memkv_load_threads", extra.get("memkv_load_threads", threads), 1, 256),
        store_threads=_int("memkv_store_threads", extra.get("memkv_store_threads", threads), 1,
                           256),
        wait_timeout_s=_seconds("memkv_wait_timeout_s", extra.get("memkv_wait_timeout_s", 120),
                                0.001),
        lookup_miss_ttl_s=_seconds("memkv_lookup_miss_ttl",
                                   extra.get("memkv_lookup_miss_ttl", 30), 0.0),
        lookup_hit_ttl_s=_seconds("memkv_lookup_hit_ttl", extra.get("memkv_lookup_hit_ttl", 30),
                                  0.0),
        spec_prefix=prefix,
        prefix_wait_s=_seconds("memkv_prefix_wait_s", extra.get("memkv_prefix_wait_s", 10), 0.0),
        client_overrides={k: v for k, v in extra.items() if k in CONFIG_KEYS},
    )


_KEYS = frozenset({
    "memkv_scratch_medium", "memkv_num_threads", "memkv_scratch_mb_per_thread",
    "memkv_load_threads", "memkv_store_threads", "memkv_wait_timeout_s",
    "memkv_lookup_miss_ttl", "memkv_lookup_hit_ttl", "memkv_spec_prefix",
    "memkv_prefix_wait_s",
})
