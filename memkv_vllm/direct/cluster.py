"""The block client (memkv or Redis, by ``backend``) and block store of one direct-mode process
(scheduler or worker)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from memkv_vllm.core.backends import client_or_none, store_for
from memkv_vllm.core.config import MemKVConfig
from memkv_vllm.core.interface import DirectOffloader

logger = logging.getLogger("vllm.memkv_direct")


def connect(overrides: Mapping[str, Any], **store_options: Any
            ) -> tuple[DirectOffloader, Any, MemKVConfig]:
    """(block store, client or None, settings). A bad setting raises (startup); a client that
    cannot be made does not: every lookup then misses and every job fails, and the engine
    computes everything itself."""
    client, cfg = client_or_none(overrides, logger, "direct")
    return store_for(client, cfg, **store_options), client, cfg
