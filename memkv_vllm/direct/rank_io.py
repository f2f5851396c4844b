"""One worker rank's I/O setup: which NIC its client uses and where its scratch slots live.

Decided once, at worker start, and logged in one line:

* **NIC.** A rank whose KV is on a GPU gives its client the NIC nearest that GPU by the PCIe
  topology (`_native.nic_for_gpu`, among the NICs ``rdma_devices`` / ``MEMKV_RDMA_DEVICES``
  narrow it to; every rank computes the same pairing on its own), for providers whose domains are
  NICs (``verbs``, ``efa``, ``tcp``, ``sockets``, or none named). A NIC that does not open keeps
  the configured devices.
* **Scratch.** ``memkv_scratch_medium: auto`` puts the slots in GPU memory exactly when a NIC
  moves values between them and the server with no copy through host memory: the transport is
  RDMA, its provider registers GPU memory (FI_HMEM: the client's `gpu_memory()`), and the NIC
  shares the GPU's PCIe switch (`_native.gpu_scratch_verdict`: the NIC's DMA into GPU memory then
  stays below the switch). Anything else (TCP, Redis, a provider without FI_HMEM, a NIC across
  the root complex) gets host slots, and so does ``shm`` (a server on this host): it reaches GPU
  memory only through synchronous CUDA copies into its bounce buffers, measured at a fifth of
  its host-memory speed on an H200 (docs/benchmarks.md), where host slots cost one copy-engine
  copy. ``gpu`` always gets GPU slots: the network reads and writes them where the transport
  reaches GPU memory (shm included), else each value is staged through a pinned host slot.

No vLLM imports: `spec.py` passes the KV tensors' device and the options in.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from memkv_vllm import _native
from memkv_vllm.core.backends import client_or_none, make_client
from memkv_vllm.core.config import MemKVConfig, load_config
from memkv_vllm.direct.cluster import store_for

logger = logging.getLogger("vllm.memkv_direct")

# Providers whose libfabric domains are NICs (or, for tcp/sockets, network interfaces), so that
# the rank's NIC is a domain name to open. None: `auto` tries the hardware ones (verbs, efa).
_NIC_PROVIDERS = (None, "verbs", "efa", "tcp", "sockets")
# The provider of a server on this host: shared memory, no NIC in the path; it copies GPU memory
# through host bounce buffers, slower than host scratch (see the module doc).
_SAME_HOST_PROVIDER = "shm"


@attrs.frozen
class ScratchChoice:
    medium: str  # "host" or "gpu"
    device_io: bool  # the network reads and writes the GPU slots themselves
    reason: str


def gpu_pci_address(ordinal: int) -> str | None:
    """The PCI address of CUDA device `ordinal` as the driver this process loaded gives it
    (``0000:1B:00.0``); None without a driver or device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None
    dev = ctypes.c_int()
    buf = ctypes.create_string_buffer(64)
    if cuda.cuDeviceGet(ctypes.byref(dev), int(ordinal)) != 0:
        return None
    if cuda.cuDeviceGetPCIBusId(buf, len(buf), dev) != 0:
        return None
    return buf.value.decode()


def rank_nic(gpu_pci: str | None, cfg: MemKVConfig, provider: str | None,
             sysfs: str = "/sys") -> tuple[str | None, str]:
    """(the NIC for this rank's client or None to keep ``cfg.rdma_devices``, why)."""
    if cfg.backend != "memkv" or cfg.transport == "tcp":
        return None, f"transport {cfg.transport} (backend {cfg.backend}) uses no NIC of its own"
    if provider not in _NIC_PROVIDERS:
        return None, f"provider {provider}'s domains are not NICs"
    if gpu_pci is None:
        return None, "no GPU address for this rank"
    try:
        nic = _native.nic_for_gpu(gpu_pci, list(cfg.rdma_devices), sysfs)
    except ValueError as e:
        return None, f"no NIC pairing for GPU {gpu_pci}: {e}"
    if nic is None:
        return None, f"no NIC pairs with GPU {gpu_pci}"
    name, proximity = nic
    narrowed = f" among {','.join(cfg.rdma_devices)}" if cfg.rdma_devices else ""
    return name, f"GPU {gpu_pci}'s nearest NIC{narrowed}: {name} ({proximity})"


def choose_scratch(requested: str, kv_on_cuda: bool, gpu_memory: tuple[bool, str],
                   provider: str | None,
                   verdict: Callable[[tuple[bool, str]], tuple[bool, str]]) -> ScratchChoice:
    """Where the scratch slots live (see the module doc). `gpu_memory` is the client's answer,
    `verdict(gpu_memory)` the topology's (`_native.gpu_scratch_verdict` for this GPU)."""
    reach, how = gpu_memory
    if requested == "host" or not kv_on_cuda:
        why = "memkv_scratch_medium: host" if requested == "host" else "KV in host memory"
        return ScratchChoice("host", False, why)
    if requested == "gpu":
        return ScratchChoice("gpu", reach, "memkv_scratch_medium: gpu; " + (
            f"the network reads and writes the GPU slots ({how})" if reach
            else f"values staged through pinned host slots ({how})"))
    if not reach:
        return ScratchChoice("host", False, f"auto: host, {how}")
    if provider == _SAME_HOST_PROVIDER:
        return ScratchChoice("host", False, "auto: host, the server shares this host over shm, "
                             "which copies GPU memory through host bounce buffers (slower than "
                             "host slots; memkv_scratch_medium: gpu hands it the GPU slots)")
    ok, why = verdict(gpu_memory)
    return ScratchChoice("gpu" if ok else "host", ok, f"auto: {'gpu' if ok else 'host'}, {why}")


@attrs.frozen
class RankIO:
    """What `open_rank_io` set up: the block store and client (owned by the caller), the
    settings, the scratch choice and a log line."""

    store: Any
    client: Any
    cfg: MemKVConfig
    scratch: ScratchChoice
    describe: str


def _gpu_memory(client: Any) -> tuple[bool, str]:
    if client is None:
        return False, "no client"
    ask = getattr(client, "gpu_memory", None)
    if ask is None:
        return False, f"{type(client).__name__} moves host memory only"
    return ask()  # type: ignore[no-any-return]


def open_rank_io(kv_device: Any, requested: str, overrides: Mapping[str, Any],
                 sysfs: str = "/sys", **store_options: Any) -> RankIO:
    """Client, block store and scratch choice of one worker rank whose KV tensors are on
    `kv_device` (a torch device). A bad setting raises (startup); a client that cannot be made
    does not (see `connect`)."""
    kv_on_cuda = kv_device.type == "cuda"
    gpu_pci = None
    if kv_on_cuda:
        ordinal = kv_device.index if kv_device.index is not None else _current_device()
        gpu_pci = gpu_pci_address(ordinal)
    cfg = load_config(dict(overrides) if overrides else None)
    provider = os.environ.get("MEMKV_RDMA_PROVIDER") or None
    nic, nic_why = rank_nic(gpu_pci, cfg, provider, sysfs)
    want_gpu = kv_on_cuda and requested != "host"
    client = None
    if nic is not None:
        try:
            nic_cfg = load_config({**overrides, "rdma_devices": [nic]})
            client, cfg = make_client(nic_cfg, gpu_memory=want_gpu), nic_cfg
        except Exception as e:  # the configured devices may still open: they are tried next
            nic_why += f"; it did not open ({e}), so the configured devices are used"
    if client is None:
        client, cfg = client_or_none(overrides, logger, "direct", want_gpu)
    store = store_for(client, cfg, **store_options)
    reach = _gpu_memory(client)
    used = client.rdma_provider() if hasattr(client, "rdma_provider") else None
    devices = list(cfg.rdma_devices)
    choice = choose_scratch(
        requested, kv_on_cuda, reach, used,
        lambda r: (_native.gpu_scratch_verdict(gpu_pci, devices, sysfs, r) if gpu_pci
                   else (False, "no GPU address for this rank")))
    line = f"NIC: {nic_why}; scratch: {choice.reason}"
    return RankIO(store, client, cfg, choice, line)


def _current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


