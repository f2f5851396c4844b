"""memkv-vllm: an open KV-cache cluster (memkv) and the vLLM plugin backed by it."""

from __future__ import annotations

import logging

__all__ = ["register"]

_log = logging.getLogger("vllm.memkv")


def register() -> None:
    """The `vllm.general_plugins` hook (entry point `memkv_tier`); vLLM calls it in every process.

    Adds the "memkv" secondary-tier type to vLLM's tier factory and, on vLLM's CPU platform only,
    the CPU copy worker that TieringOffloadingSpec needs there. Idempotent, cheap (the tier module
    is imported only when a config names it) and it never raises: an exception here would abort
    vLLM's start-up even for engines that do not use memkv. Without vLLM it does nothing.
    """
    try:
        from memkv_vllm.compat import api

        adapter = api()
    except Exception:
        return  # vLLM absent or without the tiering API: nothing to plug into
    try:
        adapter.register_tier("memkv", "memkv_vllm.tier", "MemKVSecondaryTierManager")
    except Exception as e:
        _log.warning("memkv: could not register the memkv tier type: %s", e)
    try:
        from memkv_vllm.cpu_worker import install

        install()
    except Exception as e:
        _log.warning("memkv: CPU-platform worker not installed: %s", e)
