"""GPU memory and the client, against real servers: where a buffer lives (the CUDA driver's
answer), GPU memory refused with a clear error before any byte moves where the transport cannot
move it (TCP; RDMA over a provider without FI_HMEM, such as libfabric's tcp), and, where the
provider registers GPU memory, PUT from and GET into CUDA tensors. The CUDA cases skip without a
GPU; the round trips also without a provider that registers GPU memory (named by
MEMKV_TEST_GPU_PROVIDER, e.g. ``shm`` on a libfabric built with CUDA)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from memkv_vllm import _native
from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import MemKVConfig
from memkv_vllm.core.interface import Status

try:
    import torch
except ImportError:  # the host-memory cases need no torch
    torch = None

cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs CUDA")

# What each transport says about GPU memory (its `gpu_memory()` reason, and the refusals').
WHY = {"tcp": "the TCP transport moves host memory only",
       "shm": "the TCP transport moves host memory only",
       "rdma": "offers no domain that registers GPU memory (FI_HMEM)"}


def client_for(server, transport: str, gpu_memory: bool = True) -> MemKVClient:
    kw = {"rdma_devices": ("lo",)} if transport == "rdma" else {}
    return MemKVClient(MemKVConfig(servers=(server.address,), transport=transport, **kw),
                       gpu_memory=gpu_memory)


def test_host_memory_is_host_memory_and_the_client_says_why_it_moves_no_gpu_memory(
        transport, memkv_server) -> None:
    arr = np.arange(4096, dtype=np.uint8)
    assert _native.memory_kind(arr.ctypes.data) == ("host", None)
    assert _native.memory_kind(0) == ("host", None)
    c = client_for(memkv_server, transport)
    ok, why = c.gpu_memory()
    assert not ok and WHY[transport] in why
    assert c.rdma_provider() == (None if transport in ("tcp", "shm") else "tcp;ofi_rxm")
    # Host memory moves as before, registered or not.
    c.register_buffer(arr.ctypes.data, arr.nbytes)
    assert c.put([b"h"], [arr]) == [Status.OK]
    out = np.zeros_like(arr)
    assert c.get_into([b"h"], [out]) == [Status.OK] and (out == arr).all()
    c.unregister_buffer(arr.ctypes.data)
    unasked = client_for(memkv_server, transport, gpu_memory=False)
    ok, why = unasked.gpu_memory()
    assert not ok and ("not asked" in why if transport == "rdma" else WHY["tcp"] in why)
    c.close()
    unasked.close()


def test_a_server_on_this_host_over_shm_moves_host_memory(memkv_server_factory,
                                                         monkeypatch) -> None:
    """libfabric's shm provider (a server co-located with the engine) carries the one-sided
    path too; whether it reaches GPU memory depends on libfabric's CUDA support, and the client
    says which (the distributions' builds have none)."""
    monkeypatch.setenv("MEMKV_RDMA", "true")
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "shm")
    monkeypatch.delenv("MEMKV_RDMA_DEVICES", raising=False)
    srv = memkv_server_factory()
    c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma"), gpu_memory=True)
    assert c.rdma_provider() == "shm"
    ok, why = c.gpu_memory()
    assert ok or "built without CUDA support" in why or "CUDA support did not start" in why, why
    vals = [np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            for n in (1, 4097, 3 << 20)]
    keys = [b"shm/%d" % v.nbytes for v in vals]
    assert c.put(keys, vals) == [Status.OK] * 3
    outs = [np.zeros_like(v) for v in vals]
    assert c.get_into(keys, outs) == [Status.OK] * 3
    assert all((a == b).all() for a, b in zip(vals, outs, strict=True))
    c.close()


@cuda
def test_cuda_tensors_are_located_on_their_device() -> None:
    t = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    assert _native.memory_kind(t.data_ptr()) == ("cuda", dev)
    assert _native.memory_kind(t.data_ptr() + 12345) == ("cuda", dev)
    pinned = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    assert _native.memory_kind(pinned.data_ptr()) == ("host", None)
    assert _native.memory_kind(np.zeros(64, np.uint8).ctypes.data) == ("host", None)


@cuda
def test_gpu_memory_the_transport_cannot_move_is_refused_before_any_byte_moves(
        transport, memkv_server) -> None:
    c = client_for(memkv_server, transport)
    t = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    ptr = t.data_ptr()
    where = f"GPU memory (CUDA device {t.device.index or 0})"
    for call in (lambda: c.put([b"g"], [t]),
                 lambda: c.get_into([b"g"], [t]),
                 lambda: c.put_ptrs([b"g"], [ptr], [t.numel()]),
                 lambda: c.codes.submit_get_into([b"g"], [t]),
                 lambda: c.register_buffer(ptr, t.numel())):
        with pytest.raises(ValueError) as e:
            call()
        assert where in str(e.value) and WHY[transport] in str(e.value), str(e.value)
    # Nothing reached the server and it stays up: host memory still moves, the key is absent.
    host = np.full(4096, 3, np.uint8)
    assert c.put([b"h"], [host]) == [Status.OK]
    assert c.exists([b"g", b"h"]) == [Status.NOT_FOUND, Status.OK]
    assert all(h["up"] for h in c.health().values())
    c.close()


@pytest.fixture
def gpu_provider(memkv_server_factory, monkeypatch):
    """A server and a client over the provider MEMKV_TEST_GPU_PROVIDER names, whose domain
    registers GPU memory; skips when none is named or it does not."""
    prov = os.environ.get("MEMKV_TEST_GPU_PROVIDER")
    if not prov or torch is None or not torch.cuda.is_available():
        pytest.skip("needs CUDA and MEMKV_TEST_GPU_PROVIDER (a libfabric provider with FI_HMEM)")
    monkeypatch.setenv("MEMKV_RDMA", "true")
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", prov)
    monkeypatch.delenv("MEMKV_RDMA_DEVICES", raising=False)
    srv = memkv_server_factory(memory="512M")
    c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma"), gpu_memory=True)
    ok, why = c.gpu_memory()
    if not ok:
        c.close()
        pytest.skip(f"provider {prov} does not register GPU memory here: {why}")
    yield c
    c.close()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 4097, 3 << 20])
def test_put_from_and_get_into_cuda_memory_byte_exact(gpu_provider, size) -> None:
    c = gpu_provider
    g = torch.Generator(device="cuda").manual_seed(size)
    src = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=g)
           for _ in range(3)]
    keys = [b"gpu/%d/%d" % (size, i) for i in range(3)]
    assert c.put(keys, src) == [Status.OK] * 3
    dst = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(3)]
    assert c.get_into(keys, dst) == [Status.OK] * 3
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    # A host buffer reads what the GPU stored.
    host = np.zeros(size, np.uint8)
    assert c.get_into(keys[:1], [host]) == [Status.OK]
    assert (host == src[0].cpu().numpy()).all()


@cuda
@pytest.mark.gpu
def test_a_registered_cuda_pool_moves_its_blocks(gpu_provider) -> None:
    c = gpu_provider
    pool = torch.randint(0, 256, (16, 1 << 16), dtype=torch.uint8, device="cuda")
    c.register_buffer(pool.data_ptr(), pool.numel())
    row = pool.shape[1]
    keys = [b"pool/%d" % i for i in range(8)]
    assert c.put_ptrs(keys, [pool.data_ptr() + i * row for i in range(8)], [row] * 8) == (
        [Status.OK] * 8)
    assert c.get_into_ptrs(keys, [pool.data_ptr() + (8 + i) * row for i in range(8)],
                           [row] * 8) == [Status.OK] * 8
    assert torch.equal(pool[:8], pool[8:])
    c.unregister_buffer(pool.data_ptr())
