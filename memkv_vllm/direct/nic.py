"""Which NIC a worker rank's client uses.

A rank whose KV is on a GPU gives its client the NIC nearest that GPU by the PCIe topology
(`_native.nic_for_gpu`, among the NICs ``rdma_devices`` / ``MEMKV_RDMA_DEVICES`` narrow it to;
every rank computes the same pairing on its own), for providers whose domains are NICs
(``verbs``, ``efa``, ``tcp``, ``sockets``, or none named). `memkv_vllm.direct.rank_io` opens the
client on it; a NIC that does not open keeps the configured devices.

No vLLM imports.
"""

from __future__ import annotations

import ctypes

from memkv_vllm import _native
from memkv_vllm.core.config import MemKVConfig
from memkv_vllm.offload.cuda_driver import cuda_driver

# Providers whose libfabric domains are NICs (or, for tcp/sockets, network interfaces), so that
# the rank's NIC is a domain name to open. None: `auto` tries the hardware ones (verbs, efa).
_NIC_PROVIDERS = (None, "verbs", "efa", "tcp", "sockets")


def gpu_pci_address(ordinal: int) -> str | None:
    """The PCI address of CUDA device `ordinal` as the driver this process loaded gives it
    (``0000:1B:00.0``); None without a driver or device."""
    try:
        cuda = cuda_driver(loaded_only=True)
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
    if cfg.backend != "memkv" or cfg.transport in ("tcp", "shm"):  # no NIC in their path
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
