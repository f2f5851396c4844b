"""Where a worker rank's scratch slots live: host or GPU memory.

``memkv_scratch_medium: auto`` puts the slots in GPU memory exactly when a NIC moves values between
them and the server with no copy through host memory: the transport is RDMA, its provider
registers GPU memory (FI_HMEM: the client's `gpu_memory()`), and the NIC shares the GPU's PCIe
switch (`_native.gpu_scratch_verdict`: the NIC's DMA into GPU memory then stays below the switch).
Anything else (TCP, Redis, a provider without FI_HMEM, a NIC across the root complex) gets host
slots, and so does ``shm`` (a server on this host): it reaches GPU memory only through synchronous
CUDA copies into its bounce buffers, measured at a fifth of its host-memory speed on an H200
(docs/benchmarks.md), where host slots cost one copy-engine copy. ``gpu`` always gets GPU slots:
the network reads and writes them where the transport reaches GPU memory (shm included), else
each value is staged through a pinned host slot.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

# The provider of a server on this host: shared memory, no NIC in the path; it copies GPU memory
# through host bounce buffers, slower than host scratch (see the module doc).
_SAME_HOST_PROVIDER = "shm"


@attrs.frozen
class ScratchChoice:
    medium: str  # "host" or "gpu"
    device_io: bool  # the network reads and writes the GPU slots themselves
    reason: str


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
