"""One worker rank's I/O, set up once at worker start and logged in one line: its client (on the
NIC `memkv_vllm.direct.nic` picks), the block store over it, and where its scratch slots live
(`memkv_vllm.direct.scratch`).

No vLLM imports: `spec.py` passes the KV tensors' device and the options in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs

from memkv_vllm import _native
from memkv_vllm.core.backends import client_or_none, make_client, store_for
from memkv_vllm.core.config import MemKVConfig, load_config
from memkv_vllm.core.interface import DirectOffloader
from memkv_vllm.direct.nic import gpu_pci_address, rank_nic
from memkv_vllm.direct.scratch import ScratchChoice, choose_scratch

logger = logging.getLogger("vllm.memkv_direct")


@attrs.frozen
class RankIO:
    """What `open_rank_io` set up: the block store and client (owned by the caller), the
    settings, the scratch choice and a log line."""

    store: DirectOffloader
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
    return ask()


def open_rank_io(kv_device: Any, requested: str, overrides: Mapping[str, Any],
                 sysfs: str = "/sys", **store_options: Any) -> RankIO:
    """Client, block store and scratch choice of one worker rank whose KV tensors are on
    `kv_device` (a torch device). A bad setting raises (startup); a client that cannot be made
    does not (see `memkv_vllm.direct.cluster.connect`)."""
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


