"""The offloader core on CUDA KV tensors of real model shapes, host and gpu scratch, against a real
memkv server. Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import entries, offloader, run
from layouts import LAYOUTS, block_bytes

from memkv_vllm.offload import Entry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("method", ["kernel", "dma"])
@pytest.mark.parametrize("medium", ["host", "gpu"])
@pytest.mark.parametrize("layout", ["kv_per_layer", "mla_latent", "k_v_apart",
                                    "padded_two_groups", "cross_layer"])
def test_real_shapes_round_trip_byte_exact(memkv_server_factory, layout, medium, method):
    srv = memkv_server_factory(memory="1G")
    kv = LAYOUTS[layout](40, "cuda", small=False)
    if layout == "kv_per_layer":
        assert kv.value_bytes == [2 << 20]  # 32 layers x 8 heads x 128 x bf16 x 16 tokens x K,V
    off = offloader(srv.address, kv, medium=medium, scratch_values=8, copy_method=method)
    assert (off.medium, off.mover.method) == (medium, method)
    src, dst = list(range(0, 20)), list(range(20, 40))
    for g in range(len(kv.groups)):
        assert run(off, 1 + 2 * g, entries(b"g%d" % g, g, src), load=False).ok
        want = [block_bytes(kv, g, b) for b in src]
        r = run(off, 2 + 2 * g, [Entry(b"g%d/%d" % (g, i), g, (d,)) for i, d in enumerate(dst)],
                load=True)
        assert r.ok and [block_bytes(kv, g, b) for b in dst] == want
    off.close()


@pytest.mark.parametrize("method", ["kernel", "dma"])
def test_store_is_ordered_after_the_compute_stream(memkv_server_factory, method):
    """A store submitted right after the model wrote a block (no synchronisation) stores the new
    bytes: the copy waits for the compute stream."""
    srv = memkv_server_factory(memory="512M")
    kv = LAYOUTS["kv_per_layer"](8, "cuda", small=False)
    off = offloader(srv.address, kv, copy_method=method)
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for _ in range(20):  # keep the compute stream busy for a while before the writes
        big.add_(1)
    for t in kv.tensors:
        t[2].view(torch.uint8).fill_(0xA5)
    off.submit_store(1, [Entry(b"fresh", 0, (2,))])
    assert off.drain(30) and off.poll()[0].ok
    for t in kv.tensors:
        t[2].zero_()
    assert run(off, 2, [Entry(b"fresh", 0, (6,))], load=True).ok
    assert all((t[6].view(torch.uint8) == 0xA5).all() for t in kv.tensors)
    off.close()


@pytest.mark.parametrize("method", ["kernel", "dma"])
@pytest.mark.parametrize("medium", ["host", "gpu"])
def test_multi_block_values_and_partial_loads(memkv_server_factory, method, medium):
    srv = memkv_server_factory(memory="512M")
    kv = LAYOUTS["padded_two_groups"](24, "cuda", small=False, bpv=4)
    off = offloader(srv.address, kv, medium=medium, copy_method=method)
    stored = {0: (3, 9, 1, 17), 1: (4, 2, 8, 5)}
    for g, blocks in stored.items():
        assert run(off, 1 + g, [Entry(b"c%d" % g, g, blocks)], load=False).ok
    want = {g: [block_bytes(kv, g, b) for b in blocks[1:]] for g, blocks in stored.items()}
    r = run(off, 5, [Entry(b"c0", 0, (20, 21, 22), first_pos=1),
                     Entry(b"c1", 1, (10, 11, 12), first_pos=1)], load=True)
    assert r.ok
    assert [block_bytes(kv, 0, b) for b in (20, 21, 22)] == want[0]
    assert [block_bytes(kv, 1, b) for b in (10, 11, 12)] == want[1]
    off.close()


def test_waiting_for_a_copy_costs_no_cpu(memkv_server_factory):
    """While a store's gather waits behind a long stretch of compute-stream work, the copy thread
    sleeps in the driver (blocking-sync event) and the caller in wait(): little CPU is used."""
    srv = memkv_server_factory(memory="512M")
    kv = LAYOUTS["kv_per_layer"](8, "cuda", small=False)
    off = offloader(srv.address, kv)
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for _ in range(1500):  # a few hundred ms of compute-stream work ahead of the gather
        big.add_(1)
    off.submit_store(1, [Entry(b"late", 0, (3,))])
    cpu, wall = time.process_time(), time.monotonic()
    assert off.wait([1], 60)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert wall > 0.05, "the compute stream was not busy long enough to tell"
    assert cpu < 0.3 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"
    assert off.drain(30) and off.poll()[0].ok
    off.close()


def test_submit_does_not_wait_for_the_compute_stream(memkv_server_factory):
    """A store of many batches queued behind a long forward pass returns at once: its copies
    wait on the GPU, never the caller (the job rows of every launch have room of their own)."""
    srv = memkv_server_factory(memory="512M")
    kv = LAYOUTS["kv_per_layer"](48, "cuda", small=False)
    off = offloader(srv.address, kv, scratch_values=24, batch_values=1)
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for _ in range(1500):
        big.add_(1)
    busy = torch.cuda.Event()
    busy.record()
    off.submit_store(1, entries(b"q", 0, list(range(24))))  # 24 launches
    assert not busy.query(), "submit waited for the compute stream"
    assert off.drain(60) and off.poll()[0].ok
    off.close()


def test_gpu_scratch_read_by_the_network_needs_a_transport_that_reaches_gpu_memory(
        memkv_server_factory):
    """`device_io` hands the GPU scratch slots themselves to the transport: over TCP that is
    refused at construction, with the reason, instead of failing every job; without it the gpu
    slots are staged through pinned host slots the transport reads."""
    srv = memkv_server_factory()
    kv = LAYOUTS["kv_per_layer"](8, "cuda")
    with pytest.raises(ValueError, match=r"GPU memory \(CUDA device \d+\).*TCP transport moves "
                                         r"host memory only"):
        offloader(srv.address, kv, medium="gpu", device_io=True)
    staged = offloader(srv.address, kv, medium="gpu")
    assert staged.mover.staged and staged.mover.io is staged.mover.host
    assert not staged.device_io and "staged through pinned host slots" in staged.describe()
    staged.close()


def test_gpu_scratch_goes_to_the_network_without_host_slots(memkv_server_factory, monkeypatch):
    """Over a provider that registers GPU memory (MEMKV_TEST_GPU_PROVIDER, e.g. shm on a
    libfabric built with CUDA), the values go between the GPU slots and the server directly:
    no pinned host slot exists, and stores and loads are byte-exact."""
    import os

    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    prov = os.environ.get("MEMKV_TEST_GPU_PROVIDER")
    if not prov:
        pytest.skip("needs MEMKV_TEST_GPU_PROVIDER (a libfabric provider with FI_HMEM)")
    monkeypatch.setenv("MEMKV_RDMA", "true")
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", prov)
    monkeypatch.delenv("MEMKV_RDMA_DEVICES", raising=False)
    srv = memkv_server_factory(memory="1G")
    client = MemKVClient(load_config({"servers": [srv.address], "transport": "rdma"}),
                         gpu_memory=True)
    ok, why = client.gpu_memory()
    if not ok:
        pytest.skip(f"provider {prov} does not register GPU memory here: {why}")
    kv = LAYOUTS["padded_two_groups"](24, "cuda", small=False, bpv=2)
    off = offloader(srv.address, kv, medium="gpu", device_io=True, client=client,
                    scratch_values=4)
    assert off.device_io and off.mover.host is None and off.mover.io is off.mover.dev
    src, dst = list(range(0, 12)), list(range(12, 24))
    for g in range(len(kv.groups)):
        assert run(off, 1 + 2 * g, entries(b"d%d" % g, g, src, bpv=2), load=False).ok
        r = run(off, 2 + 2 * g, [Entry(b"d%d/%d" % (g, i), g, tuple(dst[i:i + 2]))
                                 for i in range(0, len(dst), 2)], load=True)
        assert r.ok
        assert [block_bytes(kv, g, b) for b in dst] == [block_bytes(kv, g, b) for b in src]
    off.close()
