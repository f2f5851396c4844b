"""What the CPU-platform copy worker costs the engine step, next to the copy it moved off it.

Builds the worker the plugin installs on vLLM's CPU build over real CPU tensors shaped like a
model's KV cache (one int8 (blocks, page) tensor per layer, vLLM's own CanonicalKVCaches and
load/store specs) and a pool of the same pages, then stores and loads --blocks blocks per job,
--jobs times each. Per job it records the time `submit_store` / `submit_load` took on the calling
thread (what the engine step pays) and the copy time the worker reports in its TransferResult
(what its thread spends, off the step). Prints medians and the 10th-90th percentile spread, in
microseconds. Run it with a Python that has vLLM:

    .venv-vllm/bin/python benchmarks/cpu_copy_worker.py [--layers 2] [--page-kib 64] [--blocks 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.cpu_worker import ThreadedCopyWorker


class PoolRegion:
    """The part of vLLM's SharedOffloadRegion the worker uses: per-tensor views of one buffer."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.base = torch.zeros((rows, row_bytes), dtype=torch.int8)
        self.offset = 0

    def _view(self, nbytes: int) -> torch.Tensor:
        view = self.base[:, self.offset:self.offset + nbytes]
        self.offset += nbytes
        return view

    create_next_view = create_next_worker_view = _view

    def cleanup(self) -> None:
        pass


def _spread(v: list[float]) -> str:
    q = statistics.quantiles(v, n=10)
    return f"median {statistics.median(v):8.0f}   p10-p90 {q[0]:7.0f} - {q[-1]:7.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="KV tensors (one per layer)")
    ap.add_argument("--page-kib", type=int, default=64,
                    help="bytes of one block of one layer (the tiny model: 64 KiB)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per job")
    ap.add_argument("--jobs", type=int, default=300, help="store jobs and load jobs each")
    a = ap.parse_args()
    page, nblocks = a.page_kib << 10, 4 * a.blocks
    kv = [torch.randint(-128, 127, (nblocks, page), dtype=torch.int8) for _ in range(a.layers)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
                          for i in range(a.layers)]])
    worker: Any = api().offloading_worker_class(ThreadedCopyWorker)(
        caches, 1, PoolRegion(nblocks, page * a.layers))
    submit: dict[str, list[float]] = {"store": [], "load": []}
    copy: dict[str, list[float]] = {"store": [], "load": []}
    try:
        for j in range(2 * a.jobs):
            op = "store" if j % 2 == 0 else "load"
            first = (j * a.blocks) % nblocks
            blocks = list(range(first, first + a.blocks))
            gpu = GPULoadStoreSpec(blocks, group_sizes=[a.blocks], block_indices=[0])
            pool = CPULoadStoreSpec(blocks)
            tic = time.perf_counter()
            if op == "store":
                worker.submit_store(j, gpu, pool)
            else:
                worker.submit_load(j, pool, gpu)
            submit[op].append((time.perf_counter() - tic) * 1e6)
            worker.wait({j})
            [result] = worker.get_finished()
            assert result.success and result.transfer_size == a.blocks * a.layers * page
            copy[op].append(result.transfer_time * 1e6)
    finally:
        worker.shutdown()
    mib = a.blocks * a.layers * page / (1 << 20)
    print(f"{a.blocks} blocks x {a.layers} layers x {a.page_kib} KiB = {mib:.2f} MiB per job, "
          f"{a.jobs} jobs each way, us:")
    for op in ("store", "load"):
        print(f"  {op:5} submit (engine thread) {_spread(submit[op])}")
        print(f"  {op:5} copy (worker thread)   {_spread(copy[op])}")


if __name__ == "__main__":
    main()
