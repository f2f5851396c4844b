"""The block client a configuration names (memkv's own cluster or Redis / Valkey), and the block
store over it.

`make_client(cfg)` is what the vLLM tier and direct mode (and any other store owner) call, so that
``backend: redis`` in the tier dict, the ``MEMKV_CONFIG`` file or ``MEMKV_BACKEND`` switches the
engine below without touching the code above. Both answers have a ``codes`` face (one ``bytes``
of `Status` numbers per batch) that implements `memkv_vllm.core.interface.BlockClient`, and
``close``. `store_for(client, cfg)` is the one place that builds a `BlockStore` for them: its
owners see it only as the `Offloader` / `DirectOffloader` contract. Given the prefix every key of
its owner starts with, it first checks that prefix against the tenant the servers say our
credential names (a server started with ``--tenants``), so that a tier or spec ``prefix``
outside the tenant's namespace stops the engine at startup instead of missing on every key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from memkv_vllm.core.config import ConfigError, MemKVConfig, load_config
from memkv_vllm.core.interface import DirectOffloader
from memkv_vllm.core.store import BlockStore, StoreOptions


def make_client(cfg: MemKVConfig, io_threads: int | None = None,
                gpu_memory: bool = False) -> Any:
    """`MemKVClient` for ``backend: memkv``, `RedisBlockClient` for ``backend: redis``. Raises
    ValueError / ImportError for a setting this installation cannot honour. ``gpu_memory``: ask
    memkv's RDMA transport to reach GPU memory too (Redis moves host memory only)."""
    if cfg.backend == "redis":
        from memkv_vllm.core.redis_client import RedisBlockClient

        return RedisBlockClient(cfg, io_threads)
    from memkv_vllm.core.client import MemKVClient

    return MemKVClient.from_config(cfg, io_threads, gpu_memory)


def client_or_none(overrides: Mapping[str, Any] | None, log: logging.Logger, who: str,
                   gpu_memory: bool = False) -> tuple[Any, MemKVConfig]:
    """(client or None, settings) for a vLLM-side owner (`who`: "tier", "direct"). A bad setting
    raises (startup); a client that cannot be made is logged on `log` and answered with None, so
    the engine comes up, every lookup misses and it computes everything itself."""
    cfg = load_config(dict(overrides) if overrides else None)
    try:
        return make_client(cfg, gpu_memory=gpu_memory), cfg
    except Exception as e:  # the engine must come up and recompute rather than die
        log.error("memkv %s: cannot create the %s client (%s); every lookup will miss", who,
                  cfg.backend, e)
        return None, cfg


def check_tenant_prefix(client: Any, key_prefix: bytes, setting: str) -> None:
    """Raises ConfigError, naming both prefixes, when a server's tenant for our credential has a
    prefix that `key_prefix` (the start of every key the caller names; `setting` says where it
    comes from) does not start with. Servers without tenants, clients that cannot say (Redis)
    and servers that do not answer now pass: the server refuses such keys anyway."""
    tenants = getattr(client, "tenants", None)
    if tenants is None:
        return
    for addr, tenant in tenants().items():
        if tenant is not None and not key_prefix.startswith(tenant.prefix):
            raise ConfigError(
                setting, "the tenant check",
                f"keys start with {key_prefix!r}, outside the key prefix {tenant.prefix!r} of "
                f"tenant {tenant.name!r}, which our credentials (auth key or client "
                f"certificate) name on {addr}: set the prefix to start with "
                f"{tenant.prefix.decode(errors='replace')!r}, or use that tenant's own "
                f"credentials")


def store_for(client: Any, cfg: MemKVConfig, clock: Callable[[], float] = time.monotonic,
              key_prefix: tuple[bytes, str] | None = None,
              **store_options: Any) -> DirectOffloader:
    """The block store over `client` (None: every lookup misses and every job fails) with `cfg`'s
    lease on its lookups and renewals; `store_options` are `StoreOptions` fields. `key_prefix`:
    (the start of every key the owner names, the setting it comes from), checked first against
    our tenant (`check_tenant_prefix`)."""
    if key_prefix is not None and client is not None:
        check_tenant_prefix(client, *key_prefix)
    store_options.setdefault("lookup_lease_ms", int(cfg.lease_ms))
    # The store compares status numbers: it takes the client's code-bytes face.
    return BlockStore(None if client is None else client.codes, StoreOptions(**store_options),
                      clock=clock)
