"""memkv-vllm: an open KV-cache cluster (memkv) and the vLLM plugin backed by it."""

from __future__ import annotations

import logging

__all__ = ["TIERING_SPEC", "register"]

_log = logging.getLogger("vllm.memkv")

# The tier mode's offloading spec as engines name it ("spec_name" in kv_connector_extra_config):
# the class of this name in memkv_vllm.vllm.tiering_spec.
TIERING_SPEC = "MemKVTieringOffloadingSpec"


def register() -> None:
    """The `vllm.general_plugins` hook (entry point `memkv_tier`); vLLM calls it in every process.

    Adds two names to vLLM's factories, through their public registration calls: the "memkv"
    secondary-tier type, and the TIERING_SPEC offloading spec (vLLM's TieringOffloadingSpec
    whose CPU pool loses its /dev/shm name once every engine process mapped it, with a copy
    worker on vLLM's CPU platform). Nothing vLLM already has is replaced: an engine whose config
    names neither runs exactly as without the plugin. Idempotent, cheap (both modules are
    imported only when a config names them) and it never raises: an exception here would abort
    vLLM's start-up even for engines that do not use memkv. Without vLLM it does nothing.
    """
    try:
        from memkv_vllm.vllm.compat import api

        adapter = api()
    except Exception:
        return  # vLLM absent or without the tiering API: nothing to plug into
    for what, add, args in (
        ("the memkv tier type", adapter.register_tier,
         ("memkv", "memkv_vllm.vllm.tier", "MemKVSecondaryTierManager")),
        (f"the {TIERING_SPEC} spec", adapter.register_spec,
         (TIERING_SPEC, "memkv_vllm.vllm.tiering_spec", TIERING_SPEC)),
    ):
        try:
            add(*args)
        except Exception as e:
            _log.warning("memkv: could not register %s: %s", what, e)
