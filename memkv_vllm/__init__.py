"""memkv-vllm: an open KV-cache cluster (memkv) and the vLLM plugin backed by it."""

from __future__ import annotations

import logging

__all__ = ["register"]

_log = logging.getLogger("vllm.memkv")


def register() -> None:
    """The `vllm.general_plugins` hook (entry point `memkv_tier`); vLLM calls it in every process.

    Adds the "memkv" secondary-tier type to vLLM's tier factory and replaces TieringOffloadingSpec
    by a subclass whose CPU pool loses its /dev/shm name once every engine process mapped it, with
    the CPU copy worker it needs on vLLM's CPU platform (cpu_worker.install). Idempotent, cheap
    (the tier module is imported only when a config names it) and it never raises: an exception
    here would abort vLLM's start-up even for engines that do not use memkv. Without vLLM it does
    nothing.
    """
    try:
        from memkv_vllm.vllm.compat import api

        adapter = api()
    except Exception:
        return  # vLLM absent or without the tiering API: nothing to plug into
    try:
        adapter.register_tier("memkv", "memkv_vllm.vllm.tier", "MemKVSecondaryTierManager")
    except Exception as e:
        _log.warning("memkv: could not register the memkv tier type: %s", e)
    try:
        from memkv_vllm.vllm.cpu_worker import install

        install()
    except Exception as e:
        _log.warning("memkv: TieringOffloadingSpec not replaced: %s", e)
