"""One worker rank's NIC (memkv_vllm.direct.nic), scratch medium (memkv_vllm.direct.scratch) and
the client and store set up on them (memkv_vllm.direct.rank_io): the decisions on the
recorded sysfs trees, and the wiring against real servers over TCP and over RDMA (libfabric's
tcp provider on loopback, which registers host memory only). No GPU needed: a rank "on a GPU"
here is one whose KV device says cuda, on a host whose process has no CUDA driver loaded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import sysfs_tree

from memkv_vllm import _native
from memkv_vllm.core.config import load_config
from memkv_vllm.core.interface import Status
from memkv_vllm.direct import rank_io
from memkv_vllm.direct.nic import gpu_pci_address, rank_nic
from memkv_vllm.direct.rank_io import open_rank_io
from memkv_vllm.direct.scratch import ScratchChoice, choose_scratch

REACH = (True, "provider verbs on mlx5_2 registers GPU memory (FI_HMEM)")
NO_REACH = (False, "provider tcp on lo registers host memory only (no FI_HMEM)")


@pytest.fixture
def tree(tmp_path: Path):
    return lambda name: str(sysfs_tree.build(name, tmp_path / name))


def verdict(gpu: str, root: str, devices: tuple[str, ...] = ()):
    return lambda reach: _native.gpu_scratch_verdict(gpu, list(devices), root, reach)


def never(reach: tuple[bool, str]) -> tuple[bool, str]:
    raise AssertionError("the topology must not be asked")


def test_auto_is_gpu_exactly_where_a_switch_local_nic_reaches_gpu_memory(tree) -> None:
    pairs, more, vm = tree("switch_pairs"), tree("more_gpus"), tree("h200_vm")
    c = choose_scratch("auto", True, REACH, "verbs;ofi_rxm", verdict("0000:18:00.0", pairs))
    assert c == ScratchChoice("gpu", True, "auto: gpu, RDMA NIC mlx5_2 shares GPU 0000:18:00.0's "
                                           "PCIe switch and " + REACH[1])
    # The provider cannot register GPU memory: host, whatever the topology.
    assert choose_scratch("auto", True, NO_REACH, "tcp;ofi_rxm", never) == ScratchChoice(
        "host", False, "auto: host, " + NO_REACH[1])
    # The NIC is only on the same root complex, or is a plain network device (the H200 VM).
    c = choose_scratch("auto", True, REACH, "verbs", verdict("0000:08:00.0", more))
    assert (c.medium, c.device_io) == ("host", False) and "not below its PCIe switch" in c.reason
    c = choose_scratch("auto", True, REACH, "verbs", verdict("0000:00:06.0", vm))
    assert (c.medium, c.device_io) == ("host", False) and "plain network device" in c.reason
    # shm reaches GPU memory only through bounce-buffer copies: auto keeps host slots, gpu
    # hands it the GPU slots.
    shm = (True, "provider shm on shm registers GPU memory (FI_HMEM, CUDA)")
    c = choose_scratch("auto", True, shm, "shm", never)
    assert (c.medium, c.device_io) == ("host", False) and "over shm" in c.reason
    c = choose_scratch("gpu", True, shm, "shm", never)
    assert (c.medium, c.device_io) == ("gpu", True)
    # Host KV never gets GPU scratch; explicit choices are kept, `gpu` staged where needed.
    assert choose_scratch("auto", False, REACH, "verbs", never) == ScratchChoice(
        "host", False, "KV in host memory")
    assert choose_scratch("host", True, REACH, "verbs", never).medium == "host"
    assert choose_scratch("gpu", True, NO_REACH, "tcp", never) == ScratchChoice(
        "gpu", False, "memkv_scratch_medium: gpu; values staged through pinned host slots ("
        + NO_REACH[1] + ")")
    c = choose_scratch("gpu", True, REACH, "verbs", never)
    assert (c.medium, c.device_io) == ("gpu", True)


def test_each_rank_takes_the_nic_nearest_its_gpu(tree) -> None:
    pairs, more = tree("switch_pairs"), tree("more_gpus")

    def cfg(**kw):
        return load_config({"servers": ["127.0.0.1:7390"], **kw}, env={})

    rdma = cfg(transport="rdma")
    assert rank_nic("0000:9a:00.0", rdma, None, pairs) == (
        "mlx5_0", "GPU 0000:9a:00.0's nearest NIC: mlx5_0 (same PCIe switch)")
    assert rank_nic("0000:84:00.0", cfg(transport="auto"), "verbs", more) == (
        "mlx5_2", "GPU 0000:84:00.0's nearest NIC: mlx5_2 (same PCIe switch)")
    # MEMKV_RDMA_DEVICES / rdma_devices narrow the candidates first.
    assert rank_nic("0000:84:00.0", cfg(transport="rdma", rdma_devices="mlx5_0"), "verbs",
                    more) == ("mlx5_0", "GPU 0000:84:00.0's nearest NIC among mlx5_0: mlx5_0 "
                                        "(across NUMA nodes)")
    nic, why = rank_nic("0000:9a:00.0", cfg(transport="rdma", rdma_devices="mlx5_9"), None,
                        pairs)
    assert nic is None and "names mlx5_9" in why
    # No choice to make: TCP, a provider whose domain is no NIC, no GPU address, no NIC.
    assert rank_nic("0000:9a:00.0", cfg(transport="tcp"), None, pairs)[0] is None
    assert rank_nic("0000:9a:00.0", rdma, "shm", pairs) == (
        None, "provider shm's domains are not NICs")
    assert rank_nic(None, rdma, None, pairs) == (None, "no GPU address for this rank")
    assert rank_nic("0000:19:00.0", rdma, None, pairs) == (
        None, "no NIC pairs with GPU 0000:19:00.0")


def test_the_gpu_address_comes_from_the_cuda_driver_this_process_loaded() -> None:
    addr = gpu_pci_address(0)
    if addr is None:  # no driver loaded here (and then no device memory either)
        assert _native.memory_kind(0) == ("host", None)
        return
    function = Path("/sys/bus/pci/devices") / addr.lower()
    assert (function / "vendor").read_text().strip() == "0x10de", addr


@pytest.fixture
def gpu_at(monkeypatch):
    """``gpu_at(address)``: the rank's GPU is at `address` whatever this host has (None: no
    GPU address), so the wiring reads the same everywhere."""
    return lambda addr: monkeypatch.setattr(rank_io, "gpu_pci_address", lambda ordinal: addr)


@pytest.mark.parametrize("requested", ["auto", "gpu"])
def test_a_rank_whose_transport_cannot_reach_gpu_memory(transport, memkv_server, gpu_at,
                                                        requested) -> None:
    gpu_at(None)
    gpu_kv = SimpleNamespace(type="cuda", index=0)
    io = open_rank_io(gpu_kv, requested, {"servers": [memkv_server.address],
                                          "transport": transport})
    try:
        assert io.client is not None
        ok, why = io.client.gpu_memory()
        assert not ok
        assert ("FI_HMEM" if transport == "rdma" else "TCP transport") in why
        # `auto` falls back to host slots, `gpu` stages through them; both say why.
        want = ("host", False) if requested == "auto" else ("gpu", False)
        assert (io.scratch.medium, io.scratch.device_io) == want and why in io.scratch.reason
        nic = ("no GPU address for this rank" if transport == "rdma"
               else f"transport {transport} (backend memkv) uses no NIC of its own")
        assert io.describe == f"NIC: {nic}; scratch: {io.scratch.reason}"
        # The block store's client moves host memory as before.
        v = np.arange(5000, dtype=np.uint8)
        assert io.client.put([b"k"], [v]) == [Status.OK]
    finally:
        io.store.close()
        io.client.close()


def test_a_ranks_nic_that_does_not_open_leaves_the_configured_devices(
        transport, memkv_server, gpu_at, tree) -> None:
    """The GPU's nearest configured NIC (mlx5_0 in the recorded tree) is no domain of the
    provider here: the client opens the configured devices (lo, the first that opens) and the
    log line says so."""
    gpu_at("0000:9a:00.0")
    io = open_rank_io(SimpleNamespace(type="cuda", index=0), "auto",
                      {"servers": [memkv_server.address], "transport": transport,
                       "rdma_devices": "lo,mlx5_0"},
                      sysfs=tree("switch_pairs"))
    try:
        if transport in ("tcp", "shm"):
            assert io.describe.startswith(f"NIC: transport {transport} (backend memkv) uses no NIC")
        else:
            assert io.describe.startswith(
                "NIC: GPU 0000:9a:00.0's nearest NIC among lo,mlx5_0: mlx5_0 (same PCIe "
                "switch); it did not open (transport 'rdma': "), io.describe
            assert "so the configured devices are used" in io.describe
            assert io.cfg.rdma_devices == ("lo", "mlx5_0")
            assert io.client.rdma_provider() == "tcp;ofi_rxm"
        assert io.client.put([b"n"], [np.ones(100, np.uint8)]) == [Status.OK]
    finally:
        io.store.close()
        io.client.close()


def test_a_rank_on_host_kv_asks_for_no_gpu_memory(transport, memkv_server) -> None:
    io = open_rank_io(SimpleNamespace(type="cpu", index=None), "auto",
                      {"servers": [memkv_server.address], "transport": transport})
    try:
        assert io.scratch == ScratchChoice("host", False, "KV in host memory")
        ok, why = io.client.gpu_memory()
        assert not ok and ("not asked" in why if transport == "rdma" else "TCP" in why)
    finally:
        io.store.close()
        io.client.close()
