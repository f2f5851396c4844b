"""memkv as SGLang HiCache's L3 storage backend (docs/sglang.md). The only package that
imports SGLang; it builds on the block store (memkv_vllm.core) as the vLLM wing does.

* `storage` — `MemKVHiCacheStorage`, the class SGLang's dynamic backend loads from here;
* `pages` — where a page lies in a host KV pool (its segments);
* `keys` — the memkv key of each segment, under a namespace with a tenant;
* `blocking` — the block store as the blocking, thread-safe calls SGLang makes.

Only `storage` imports SGLang, when the class is first asked for: the other modules import (and
are tested) without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MemKVHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "MemKVHiCacheStorage":
        from memkv_vllm.sglang.storage import MemKVHiCacheStorage

        return MemKVHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
