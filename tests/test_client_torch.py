"""Round trips through torch tensors (the form vLLM's KV blocks take). Runs where torch is
installed (the vLLM venvs); skipped elsewhere."""

from __future__ import annotations

import pytest

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("size", [1 << 10, 1 << 20, 16 << 20, 64 << 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_tensor_round_trip_is_byte_exact(memkv_server_factory, size, dtype):
    srv = memkv_server_factory(memory="512M", lanes=2)
    c = MemKVClient(MemKVConfig(servers=(srv.address,)))
    dt = getattr(torch, dtype)
    n = size // torch.tensor([], dtype=dt).element_size()
    g = torch.Generator().manual_seed(size)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) if dtype == "uint8" \
        else torch.randn(n, generator=g).to(dt)
    assert c.put([b"t"], [src]) == [Status.OK]
    dst = torch.zeros_like(src)
    assert c.get_into([b"t"], [dst]) == [Status.OK]
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


def test_views_into_a_kv_like_tensor(memkv_server):
    """Blocks are slices of one big tensor: contiguous slices work, strided ones are refused."""
    c = MemKVClient(MemKVConfig(servers=(memkv_server.address,)))
    kv = torch.randn(8, 2, 16, 64)
    keys = [b"blk/%d" % i for i in range(8)]
    assert c.put(keys, [kv[i] for i in range(8)]) == [Status.OK] * 8
    out = torch.zeros_like(kv)
    assert c.get_into(keys[::-1], [out[7 - i] for i in range(8)]) == [Status.OK] * 8
    assert torch.equal(out, kv)
    with pytest.raises(ValueError, match="contiguous"):
        c.put([b"strided"], [kv[:, 0]])
