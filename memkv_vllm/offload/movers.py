"""Moving blocks between the KV tensors and scratch slots: a gather is one batched copy of pieces.

Why copies and not kernels: a block of a real model is one piece per layer (e.g. 32 x 64 KiB), and
launching one copy (or one index_select) per piece and layer from Python costs more than moving the
bytes. `cuMemcpyBatchAsync` (CUDA driver 12.8+) takes every piece of a job in ONE call and the copy
engines write them straight into pinned host memory, so the gather IS the device-to-host copy and
no SM time is taken from the model. The same call scatters on loads. Host KV tensors (vLLM's CPU
platform) are gathered with memmove.

Scratch medium: `host` keeps the slots in pinned host memory (what a TCP transport reads); `gpu`
keeps them in device memory. With `device_io` (a transport that registers GPU memory: RDMA with
FI_HMEM) the network reads and writes those device slots themselves and no host memory is
involved; otherwise each value is staged through a pinned host slot of the same index.

Ordering: every copy runs on the mover's own CUDA stream, after an event recorded on the caller's
current (compute) stream at submit time, so a store never reads KV the model is still writing and a
load never races the zeroing of freshly allocated blocks. Completion is a CUDA event (`Fence`)
created blocking-sync, so the offloader's copy thread sleeps in the driver while it waits instead
of spinning on a CPU core the engine needs.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from memkv_vllm.offload.cuda_driver import cuda_driver
from memkv_vllm.offload.paged import Entry, PagedKV
from memkv_vllm.offload.shared_host import SharedHostBuffer, register_read_only, unregister

MEDIUMS = ("auto", "host", "gpu")


class Fence(Protocol):
    """The end of an enqueued copy."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class _Done:
    """A copy that already happened (memmove)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _EventFence:
    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()  # releases the GIL while it waits


class Mover(Protocol):
    """Copies between a `PagedKV` and `slots` scratch slots of `slot_bytes` each."""

    medium: str
    method: str  # how blocks move (memmove, kernel, dma), for the startup log
    io: Any  # the uint8 tensor the transport reads and writes (slot i at i * slot_bytes)
    scratch_reason: str  # where the host slots live and why (memfd, pinned), for the startup log

    def ready_marker(self) -> Any:
        """Called at submit on the caller's thread: marks the point of the caller's compute
        stream after which a gather may read / a scatter may write the job's blocks."""
        ...

    def gather(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        """Enqueue KV blocks -> the `io` slots of `slots` (one value per entry)."""
        ...

    def scatter(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        """Enqueue the `io` slots of `slots` -> KV blocks."""
        ...

    def scatter_from(self, entries: Sequence[Entry], addrs: Sequence[int], ready: Any) -> Fence:
        """Enqueue the values at host addresses `addrs` (inside memory `register_host`
        accepted) -> KV blocks: a load in place, out of a same-host server's memory."""
        ...

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Make the read-only host memory `[ptr, ptr + nbytes)` readable by `scatter_from`;
        raises when it cannot."""
        ...

    def unregister_host(self, ptr: int, nbytes: int) -> None:
        """Undo `register_host`; no copy reads the memory any more."""
        ...

    def close(self) -> None: ...


class JobRows:
    """The copy kernel's job rows (block ids, slot addresses, positions: 3 int64 per block) on
    their way to the GPU: a ring of int64 in host memory (pinned for CUDA) and its mirror on the
    device. Each launch takes the next free stretch, the host writes it, one asynchronous copy on
    the current stream moves it, and the stretch is free again once the fence of the job that
    used it has passed.

    Why a ring sized well past what is in flight: `take` must never wait for an earlier job on
    the caller's hot path (a store's copies may all be queued behind a long forward pass on the
    compute stream). Every stretch whose fence has not passed belongs to a batch that holds its
    scratch slots, so at most `rows` rows are live; three times that (and at least 64 KiB) leaves
    a free stretch after the newest one even when the ring wraps."""

    MIN_WORDS = 8192

    def __init__(self, torch: Any, rows: int, device: Any) -> None:
        self.words = max(3 * (3 * rows + 2), self.MIN_WORDS)
        pin = device.type == "cuda"
        self.host = torch.empty(self.words, dtype=torch.int64, pin_memory=pin)
        self.dev = torch.empty(self.words, dtype=torch.int64, device=device)
        self._np = self.host.numpy()
        self._head = 0
        # (start, end, fence) in the order taken; fence None until `used_until`
        self._live: collections.deque[list[Any]] = collections.deque()
        self.waits = 0  # times `take` had to wait for a fence (tests check it stays 0)

    def take(self, blocks: Sequence[int], slots: Sequence[int], positions: Sequence[int]
             ) -> tuple[Any, Any]:
        """Write one launch's rows (blocks, then slots, then positions) and enqueue their copy
        on the current stream; (a handle for `used_until`, the device rows for the kernel)."""
        n = len(blocks)
        k = 3 * n + (3 * n) % 2  # even: every stretch starts on 16 bytes, as the kernel expects
        if k > self.words:
            raise ValueError(f"{n} blocks in one launch: the job rows hold {self.words // 3}")
        start = self._head if self._head + k <= self.words else 0
        self._reclaim(start, start + k)
        row = self._np[start:start + k]
        row[:n] = blocks
        row[n:2 * n] = slots  # host or device addresses: below 2**63
        row[2 * n:3 * n] = positions
        dev = self.dev[start:start + k]
        dev.copy_(self.host[start:start + k], non_blocking=True)
        entry = [start, start + k, None]
        self._live.append(entry)
        self._head = start + k
        return entry, dev

    def used_until(self, handles: Sequence[Any], fence: Fence) -> None:
        """The stretches of `handles` are free once `fence` has passed."""
        for h in handles:
            h[2] = fence

    def _reclaim(self, lo: int, hi: int) -> None:
        while self._live and self._live[0][2] is not None and self._live[0][2].done():
            self._live.popleft()
        for e in list(self._live):
            if e[0] < hi and lo < e[1]:
                if e[2] is not None and not e[2].done():
                    self.waits += 1
                    e[2].wait()
                self._live.remove(e)


class HostMover:
    """KV tensors in host memory: memmove, done before the call returns."""

    medium = "host"
    method = "memmove"

    def __init__(self, kv: PagedKV, slots: int, slot_bytes: int) -> None:
        import torch

        self.kv, self.slot_bytes = kv, slot_bytes
        self._buf = SharedHostBuffer(torch, slots * slot_bytes, pin=False)
        self.io = self._buf.tensor
        self.scratch_reason = self._buf.reason
        self._base = int(self.io.data_ptr())

    def ready_marker(self) -> Any:
        return None  # host KV is written synchronously by the model

    def _slot_ptrs(self, slots: Sequence[int]) -> list[int]:
        return [self._base + s * self.slot_bytes for s in slots]

    def gather(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        kv, val, size = self.kv.pieces(entries, self._slot_ptrs(slots))
        for d, s, n in zip(val.tolist(), kv.tolist(), size.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        return _Done()

    def scatter(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        return self.scatter_from(entries, self._slot_ptrs(slots), ready)

    def scatter_from(self, entries: Sequence[Entry], addrs: Sequence[int], ready: Any) -> Fence:
        kv, val, size = self.kv.pieces(entries, list(addrs))
        for d, s, n in zip(kv.tolist(), val.tolist(), size.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        return _Done()

    def register_host(self, ptr: int, nbytes: int) -> None:
        return None  # host KV: memmove reads any mapping

    def unregister_host(self, ptr: int, nbytes: int) -> None:
        return None

    def close(self) -> None:
        self.io = None
        self._buf.close()


# ------------------------------------------------------------------------------ CUDA batch copies
class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


# CUmemcpySrcAccessOrder STREAM: the source is read in stream order (it may still be written).
_SRC_ACCESS_ORDER_STREAM = 1
# cuMemcpyBatchAsync as introduced in CUDA 12.8: (dsts, srcs, sizes, count, attrs, attrIdxs,
# numAttrs, failIdx, stream). CUDA 13 headers name a _v2 without failIdx; asking the driver for the
# 12.8 version keeps this signature on every driver that has the call.
_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p)
_batch_fn: Any = None


def _batch_memcpy() -> Any:
    global _batch_fn
    if _batch_fn is None:
        lib = cuda_driver()
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        pfn, found = ctypes.c_void_p(), ctypes.c_int()
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), 12080, 0, ctypes.byref(found))
        if rc != 0 or not pfn.value:
            raise RuntimeError("the CUDA driver has no cuMemcpyBatchAsync (needs a driver for "
                               f"CUDA 12.8 or newer; cuGetProcAddress returned {rc})")
        _batch_fn = _BATCH_FN(pfn.value)
    return _batch_fn


METHODS = ("auto", "kernel", "dma")


class CudaMover:
    """KV tensors on a CUDA device: on a stream of our own, the pieces move by one Triton kernel
    launch (`kernel`, the default where Triton is installed) or one batched copy-engine call
    (`dma`); whole values between device and host scratch (`gpu` staged) always by copy
    engine."""

    def __init__(self, kv: PagedKV, slots: int, slot_bytes: int, medium: str,
                 method: str = "auto", programs: int = 32, device_io: bool = False) -> None:
        import torch

        self._torch = torch
        self.kv, self.slot_bytes, self.medium = kv, slot_bytes, medium
        self.device = kv.device
        self._copy = _batch_memcpy()
        self._kernel: Any = None
        self.programs = programs
        if method not in METHODS:
            raise ValueError(f"copy method {method!r}: expected one of {', '.join(METHODS)}")
        if method != "dma":
            try:
                from memkv_vllm.offload import triton_copy

                if kv_aligned(kv):
                    self._kernel = triton_copy
            except ImportError:
                pass
            if method == "kernel" and self._kernel is None:
                raise ValueError("copy method 'kernel' needs Triton and 8-byte aligned KV pages")
        self.method = "kernel" if self._kernel is not None else "dma"
        # Staging: values cross pinned host slots between the device slots and the transport.
        self.staged = medium == "gpu" and not device_io
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._buf = (SharedHostBuffer(torch, slots * slot_bytes, pin=True)
                         if medium == "host" or self.staged else None)
            self.host = self._buf.tensor if self._buf is not None else None
            self.dev = (torch.empty(slots * slot_bytes, dtype=torch.uint8, device=self.device)
                        if medium == "gpu" else None)
        self.io = self.host if self.host is not None else self.dev
        self.scratch_reason = self._buf.reason if self._buf is not None else "GPU scratch"
        self._attrs = _CUmemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self._host_base = int(self.host.data_ptr()) if self.host is not None else 0
        self._dev_base = int(self.dev.data_ptr()) if self.dev is not None else 0
        scratch_base = self._dev_base or self._host_base
        self._refs: list[Any] = []
        self._rows: Any = None
        if self._kernel is not None:
            bpv = kv.blocks_per_value
            with torch.cuda.device(self.device):
                self._rows = JobRows(torch, max(2, slots * bpv), self.device)
                for g, refs in enumerate(kv.groups):
                    self._refs.append(self._kernel.ref_table(
                        torch, [kv.base[r.tensor] for r in refs],
                        [kv.pitch[r.tensor] for r in refs], [r.nbytes for r in refs],
                        [int(o) for o in kv.ref_offsets(g)], self.device))
                # Compile both directions now, not in the first jobs, on a table that points
                # into scratch only (8 bytes back and forth), so no KV byte is touched.
                probe = self._kernel.ref_table(torch, [scratch_base], [8], [8], [0],
                                               self.device)
                with torch.cuda.stream(self.stream):
                    for to_kv in (False, True):
                        _, job = self._rows.take([0], [scratch_base + 8], [0])
                        self._kernel.copy_blocks(probe, 1, job, 1, to_kv, 1)
                self.stream.synchronize()

    def ready_marker(self) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def _batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        if len(sizes) == 0:
            return
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = self._copy(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                        ctypes.addressof(self._attrs), ctypes.byref(idx), 1, ctypes.byref(fail),
                        self.stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail.value}")

    def _kernel_copy(self, entries: Sequence[Entry], scratch: Sequence[int], to_kv: bool
                     ) -> list[Any]:
        """One launch per group of `entries` (values at `scratch`), on the current stream; the
        handles of the job rows it used."""
        by_group: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for e, ptr in zip(entries, scratch, strict=True):
            blocks, slots, pos = by_group.setdefault(e.group, ([], [], []))
            blocks.extend(e.block_ids)
            slots.extend([ptr] * len(e.block_ids))
            pos.extend(range(e.first_pos, e.first_pos + len(e.block_ids)))
        used = []
        for g, (blocks, slots, pos) in by_group.items():
            h, job = self._rows.take(blocks, slots, pos)
            used.append(h)
            self._kernel.copy_blocks(self._refs[g], len(self.kv.groups[g]), job, len(blocks),
                                     to_kv, self.programs)
        return used

    def _move(self, entries: Sequence[Entry], scratch: list[int], to_kv: bool) -> list[Any]:
        """KV <-> scratch for `entries`, on the mover's stream; the handles of the job rows it
        used (kernel only)."""
        if self._kernel is not None:
            with self._torch.cuda.stream(self.stream):
                return self._kernel_copy(entries, scratch, to_kv)
        kv, val, size = self.kv.pieces(entries, scratch)
        if to_kv:
            self._batch(kv, val, size)
        else:
            self._batch(val, kv, size)
        return []

    def _stage_ptrs(self, slots: Sequence[int]) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Scratch slot addresses (device for `gpu`), plus host/device address pairs of the
        staging copies (used only when `staged`)."""
        base = self._dev_base or self._host_base
        scratch = np.array([base + s * self.slot_bytes for s in slots], dtype=np.uint64)
        if not self.staged:
            return scratch.tolist(), scratch, scratch
        host = np.array([self._host_base + s * self.slot_bytes for s in slots], dtype=np.uint64)
        return scratch.tolist(), host, scratch

    def _sizes(self, entries: Sequence[Entry]) -> np.ndarray:
        return np.array([self.kv.value_bytes[e.group] for e in entries], dtype=np.uint64)

    def gather(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        scratch, host, dev = self._stage_ptrs(slots)
        with self._torch.cuda.device(self.device):
            self.stream.wait_event(ready)
            used = self._move(entries, scratch, False)
            if self.staged:
                self._batch(host, dev, self._sizes(entries))
            return self._fence(used)

    def scatter(self, entries: Sequence[Entry], slots: Sequence[int], ready: Any) -> Fence:
        scratch, host, dev = self._stage_ptrs(slots)
        with self._torch.cuda.device(self.device):
            self.stream.wait_event(ready)
            if self.staged:
                self._batch(dev, host, self._sizes(entries))
            return self._fence(self._move(entries, scratch, True))

    def scatter_from(self, entries: Sequence[Entry], addrs: Sequence[int], ready: Any) -> Fence:
        with self._torch.cuda.device(self.device):
            self.stream.wait_event(ready)
            return self._fence(self._move(entries, [int(a) for a in addrs], True))

    def register_host(self, ptr: int, nbytes: int) -> None:
        register_read_only(self._torch, ptr, nbytes)

    def unregister_host(self, ptr: int, nbytes: int) -> None:
        unregister(self._torch, ptr)

    def _fence(self, used: list[Any]) -> Fence:
        # blocking: whoever waits for it sleeps in the driver instead of spinning on a core
        done = self._torch.cuda.Event(blocking=True)
        done.record(self.stream)
        fence = _EventFence(done)
        if used:
            self._rows.used_until(used, fence)
        return fence

    def close(self) -> None:
        self.stream.synchronize()
        if self._buf is not None:
            self.host = self.io = None
            self._buf.close()


def kv_aligned(kv: PagedKV) -> bool:
    """Every piece of `kv` starts and ends on 8 bytes (what the copy kernel needs)."""
    sizes = [r.nbytes for refs in kv.groups for r in refs]
    return all(x % 8 == 0 for x in [*kv.base, *kv.pitch, *sizes])


def make_mover(kv: PagedKV, slots: int, slot_bytes: int, medium: str, method: str = "auto",
               programs: int = 32, device_io: bool = False) -> Mover:
    """The mover for `kv`'s device and the scratch `medium` (`auto` = host: whoever knows the
    transport resolves `auto` first, as direct mode does in `memkv_vllm.direct.scratch`).
    `device_io`: the transport reads and writes `gpu` scratch itself (no host staging). `method`
    and `programs` apply to CUDA KV only."""
    if medium not in MEDIUMS:
        raise ValueError(f"scratch medium {medium!r}: expected one of {', '.join(MEDIUMS)}")
    if kv.device.type == "cpu":
        if medium == "gpu":
            raise ValueError("scratch medium 'gpu' needs KV tensors on a CUDA device")
        return HostMover(kv, slots, slot_bytes)
    if kv.device.type != "cuda":
        raise ValueError(f"KV tensors on {kv.device}: only CUDA and host memory are supported")
    return CudaMover(kv, slots, slot_bytes, "host" if medium == "auto" else medium, method,
                     programs, device_io)
