"""memkv as SGLang HiCache's L3 storage backend (docs/sglang.md). The only package that
imports SGLang; it builds on the block store (memkv_vllm.core) as the vLLM wing does.

* `storage` — `MemKVHiCacheStorage`, the class SGLang's dynamic backend loads;
* `pages` — where a page lies in a host KV pool (its segments);
* `keys` — the memkv key of each segment, under a namespace with a tenant;
* `blocking` — the block store as the blocking, thread-safe calls SGLang makes.
"""

from memkv_vllm.sglang.storage import MemKVHiCacheStorage

__all__ = ["MemKVHiCacheStorage"]
