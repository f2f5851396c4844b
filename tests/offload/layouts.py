"""Paged KV caches in the shapes vLLM uses, filled with random bytes, for the offloader tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memkv_vllm.offload import KVRef, PagedKV

# name -> builder(num_blocks, device, scale): scale 1 gives real model shapes.
LAYOUTS: dict[str, Callable[..., PagedKV]] = {}


def _layout(fn: Callable[..., PagedKV]) -> Callable[..., PagedKV]:
    LAYOUTS[fn.__name__] = fn
    return fn


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    raw = torch.randint(-128, 127, shape, dtype=torch.int8, generator=g)
    return raw.view(dtype).to(device) if dtype != torch.int8 else raw.to(device)


def _heads(small: bool) -> tuple[int, int, int]:
    return (3, 2, 16) if small else (32, 8, 128)  # layers, KV heads, head_dim


@_layout
def kv_per_layer(num_blocks: int, device: str, small: bool = True, bpv: int = 1) -> PagedKV:
    """One (blocks, 2, heads, 16, head_dim) bf16 tensor per layer: 2 MiB blocks at full size."""
    layers, heads, dim = _heads(small)
    ts = [_rand((num_blocks, 2, heads, 16, dim * 2), torch.int8, device, i).view(torch.bfloat16)
          for i in range(layers)]
    return PagedKV(ts, blocks_per_value=bpv)


@_layout
def k_v_apart(num_blocks: int, device: str, small: bool = True, bpv: int = 1) -> PagedKV:
    """(2, blocks, 16, heads, head_dim) per layer (FlashAttention): K and V as two views."""
    layers, heads, dim = _heads(small)
    ts = []
    for i in range(layers):
        t = _rand((2, num_blocks, 16, heads, dim * 2), torch.int8, device, 100 + i)
        ts += [t[0].view(torch.bfloat16), t[1].view(torch.bfloat16)]
    return PagedKV(ts, blocks_per_value=bpv)


@_layout
def mla_latent(num_blocks: int, device: str, small: bool = True, bpv: int = 1) -> PagedKV:
    """One latent (blocks, 16, kv_lora_rank + rope_dim) bf16 tensor per layer (DeepSeek MLA)."""
    layers, width = (3, 36) if small else (61, 576)
    ts = [_rand((num_blocks, 16, width * 2), torch.int8, device, 200 + i).view(torch.bfloat16)
          for i in range(layers)]
    return PagedKV(ts, blocks_per_value=bpv)


@_layout
def cross_layer(num_blocks: int, device: str, small: bool = True, bpv: int = 1) -> PagedKV:
    """One tensor for all layers, (blocks, layers, 2, 16, heads, head_dim) (vLLM <= 0.28)."""
    layers, heads, dim = _heads(small)
    t = _rand((num_blocks, layers, 2, 16, heads, dim * 2), torch.int8, device, 300)
    return PagedKV([t.view(torch.bfloat16)], blocks_per_value=bpv)


@_layout
def padded_two_groups(num_blocks: int, device: str, small: bool = True, bpv: int = 1) -> PagedKV:
    """int8 pages with padding (only the first bytes of a page are KV) and two KV-cache groups
    sharing a tensor, as CanonicalKVCaches describes hybrid models."""
    page = 4096 if small else 65536
    a = _rand((num_blocks, page + 512), torch.int8, device, 400)
    b = _rand((num_blocks, page), torch.int8, device, 401)
    c = _rand((num_blocks, page // 2 + 64), torch.int8, device, 402)
    groups = [[KVRef(0, page), KVRef(1, page)], [KVRef(2, page // 2), KVRef(1, page)]]
    return PagedKV([a, b, c], groups, blocks_per_value=bpv)


def block_bytes(kv: PagedKV, group: int, block: int) -> list[bytes]:
    """The stored bytes of one block of `group`: each ref's bytes, in ref order."""
    out = []
    for r in kv.groups[group]:
        row = kv.tensors[r.tensor][block].view(torch.uint8).reshape(-1)
        out.append(row[: r.nbytes].cpu().numpy().tobytes())
    return out


def all_bytes(kv: PagedKV) -> list[bytes]:
    """Every tensor's whole storage of blocks, for checking that nothing else was written."""
    return [t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes()
            for t in kv.tensors]
