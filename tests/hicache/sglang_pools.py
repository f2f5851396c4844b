"""SGLang's real KV pools on CPU tensors, and memkv backends made by SGLang's own loader.

A host pool is built as SGLang builds it: over a device pool (here on the CPU), from the buffer
info that pool describes itself with. Backends come from `StorageBackendFactory.create_backend`
with SGLang's dynamic backend config, then `register_mem_pool_host`, as the cache controller
does it.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

DYNAMIC = {"backend_name": "memkv", "module_path": "memkv_vllm.sglang",
           "class_name": "MemKVHiCacheStorage", "interface_v1": 1}


def host_pool(kind: str, layout: str, *, layers: int = 4, page_size: int = 16,
              tokens: int = 256, heads: int = 2, head_dim: int = 8) -> Any:
    """An MHATokenToKVPoolHost ("mha") or MLATokenToKVPoolHost ("mla") of about `tokens` * 2
    rows over a device pool on the CPU, filled with random bytes."""
    if kind == "mha":
        dev = MHATokenToKVPool(tokens, page_size, torch.bfloat16, heads, head_dim, layers, "cpu",
                               False, start_layer=0, end_layer=layers)
        host = MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
            pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
            start_layer=dev.start_layer, end_layer=dev.end_layer)
    else:
        dev = MLATokenToKVPool(tokens, page_size, torch.bfloat16, 4 * head_dim, head_dim, layers,
                               "cpu", False, 0, layers)
        host = MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
            pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
            start_layer=dev.start_layer, end_layer=dev.end_layer,
            target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim)
    flat = host.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-32768, 32767, flat.shape, dtype=torch.int16))
    return host


def storage_config(is_mla: bool, *, tp_rank: int = 0, tp_size: int = 1, model: str = "org/m",
                   **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=True, is_page_first_layout=False,
        model_name=model, extra_config={**DYNAMIC, **extra})


def backend(host: Any, cfg: HiCacheStorageConfig) -> Any:
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    return b


def pages(host: Any, first_page: int, n: int) -> torch.Tensor:
    """Token indices of `n` pages from page `first_page` (what the controller passes)."""
    ps = host.page_size
    return torch.arange(first_page * ps, (first_page + n) * ps, dtype=torch.int64)


def page_bytes(host: Any, first_page: int, n: int) -> list[torch.Tensor]:
    """A copy of each page's data (SGLang's own accessor, any layout)."""
    return [host.get_data_page((first_page + i) * host.page_size).clone() for i in range(n)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Byte-equal pages (random bytes hold NaNs, which compare unequal as numbers)."""
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True))


def names(tag: str, n: int) -> list[str]:
    """`n` page names as SGLang makes them (hex SHA-256)."""
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]
