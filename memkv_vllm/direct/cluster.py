"""The block client (memkv or Redis, by ``backend``) and `BlockStore` of one direct-mode process
(scheduler or worker)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from memkv_vllm.core.backends import client_or_none
from memkv_vllm.core.config import MemKVConfig
from memkv_vllm.core.store import BlockStore, StoreOptions

logger = logging.getLogger("vllm.memkv_direct")


def connect(overrides: Mapping[str, Any], **store_options: Any
            ) -> tuple[BlockStore, Any, MemKVConfig]:
    """(block store, client or None, settings). A bad setting raises (startup); a client that
    cannot be made does not: every lookup then misses and every job fails, and the engine
    computes everything itself."""
    client, cfg = client_or_none(overrides, logger, "direct")
    return store_for(client, cfg, **store_options), client, cfg


def store_for(client: Any, cfg: MemKVConfig, **store_options: Any) -> BlockStore:
    """The block store over `client` (None: every job fails) with `cfg`'s lease."""
    store_options.setdefault("lookup_lease_ms", int(cfg.lease_ms))
    # The store compares status numbers: it takes the client's code-bytes face.
    return BlockStore(None if client is None else client.codes, StoreOptions(**store_options))
