"""The CPU-platform copy worker with real CPU tensors and vLLM's own spec classes.

Its block mapping against an independent reference: the end-to-end tests run one KV group with one
block per chunk; this covers what they do not: blocks_per_chunk > 1, partial first chunks (a load
that starts mid-chunk), several KV groups, refs shorter than the padded page, several tensors.
Its threading against vLLM's worker contract: submit never waits for a copy, each job is reported
once and only once it is copied, wait() returns exactly when the jobs named are copied, a
malformed job fails at submit with nothing queued, shutdown stops the thread with jobs queued.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from memkv_vllm.vllm import cpu_worker
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.cpu_worker import ThreadedCopyWorker

BPC = 4  # blocks per chunk
PAGES = [256, 192]  # padded page size of each KV tensor
NUM_BLOCKS, NUM_CHUNKS = 24, 8


class Region:
    """The part of SharedOffloadRegion the worker uses: per-tensor views of one pool buffer."""

    def __init__(self) -> None:
        self.row = sum(PAGES) * BPC
        self.base = torch.zeros((NUM_CHUNKS, self.row), dtype=torch.int8)
        self.offset = 0
        self.cleaned = False

    def _view(self, nbytes: int) -> torch.Tensor:
        v = self.base[:, self.offset:self.offset + nbytes]
        self.offset += nbytes
        return v

    create_next_view = create_next_worker_view = _view

    def cleanup(self) -> None:
        self.cleaned = True


def _setup():
    g = torch.Generator().manual_seed(0)
    kv = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g) for p in PAGES]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=p)
                 for t, p in zip(kv, PAGES, strict=True)],
        # group 0 uses both tensors; group 1 only the second, with an un-padded size < page
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=256),
                          CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=192)],
                         [CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=150)]],
    )
    region = Region()
    worker_cls = api().offloading_worker_class(ThreadedCopyWorker)
    return kv, caches, region, worker_cls(caches, BPC, region)


def _pool_slice(region: Region, t_idx: int, chunk: int, pos: int, size: int) -> np.ndarray:
    start = sum(PAGES[:t_idx]) * BPC + pos * PAGES[t_idx]
    return region.base[chunk, start:start + size].numpy()


def _expected_pairs(caches, dev_ids, pool_ids, group_sizes, block_indices):
    """(tensor, gpu block, chunk, position in chunk, bytes) for every copied page, by indexing."""
    out, d_off, c_off = [], 0, 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        skip = first % BPC
        for i in range(n):
            sub = skip + i
            for ref in caches.group_data_refs[g]:
                out.append((ref.tensor_idx, dev_ids[d_off + i], pool_ids[c_off + sub // BPC],
                            sub % BPC, ref.page_size_bytes))
        d_off += n
        c_off += -(-(n + skip) // BPC)
    return out


def test_store_then_load_follows_vllms_block_mapping() -> None:
    kv, caches, region, worker = _setup()
    # group 0: 6 blocks from logical block 0 (2 chunks); group 1: 5 blocks from logical 3
    # (starts 3 blocks into its first chunk -> 2 chunks)
    dev_ids = [3, 7, 1, 12, 5, 9, 20, 2, 15, 11, 8]
    sizes, firsts = [6, 5], [0, 3]
    pool_ids = [5, 0, 2, 7]
    gpu = GPULoadStoreSpec(dev_ids, group_sizes=sizes, block_indices=firsts)
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(pool_ids))
    worker.wait({1})
    [res] = worker.get_finished()
    pairs = _expected_pairs(caches, dev_ids, pool_ids, sizes, firsts)
    assert res.job_id == 1 and res.success and res.transfer_size == sum(p[4] for p in pairs)
    for t, blk, chunk, pos, size in pairs:
        assert np.array_equal(_pool_slice(region, t, chunk, pos, size), kv[t][blk, :size].numpy())

    # Load the same chunks back into other (zeroed) blocks, then compare page by page.
    for t in kv:
        t.zero_()
    back_ids = [0, 4, 6, 10, 13, 14, 16, 17, 18, 19, 21]
    assert worker.submit_load(2, CPULoadStoreSpec(pool_ids),
                              GPULoadStoreSpec(back_ids, group_sizes=sizes, block_indices=firsts))
    worker.wait({2})
    [res] = worker.get_finished()
    assert res.success and res.transfer_size == sum(p[4] for p in pairs)
    for t, blk, chunk, pos, size in _expected_pairs(caches, back_ids, pool_ids, sizes, firsts):
        assert np.array_equal(kv[t][blk, :size].numpy(), _pool_slice(region, t, chunk, pos, size))
    worker.shutdown()
    assert region.cleaned


def test_partial_load_copies_only_the_tail_of_the_first_chunk() -> None:
    kv, caches, region, worker = _setup()
    region.base.copy_(torch.randint(-128, 127, region.base.shape, dtype=torch.int8))
    # One group-0 block at logical index 6: position 2 of its chunk; group 1 absent.
    dst = [9]
    worker.submit_load(3, CPULoadStoreSpec([4]),
                       GPULoadStoreSpec(dst, group_sizes=[1, 0], block_indices=[6, 0]))
    worker.wait({3})
    [res] = worker.get_finished()
    assert res.success and res.transfer_size == 256 + 192
    assert np.array_equal(kv[0][9].numpy(), _pool_slice(region, 0, 4, 2, 256))
    assert np.array_equal(kv[1][9].numpy(), _pool_slice(region, 1, 4, 2, 192))
    worker.shutdown()


class Gate:
    """Stands in for the worker's memmove: copies like it, but the copy thread stops before the
    copy of a chosen destination range until the test opens the gate."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.reached = threading.Event()
        self.open = threading.Event()
        self._memmove = cpu_worker._memmove

    def __call__(self, dst: int, src: int, n: int) -> int:
        if self.lo <= dst < self.hi and not self.open.is_set():
            self.reached.set()
            assert self.open.wait(30), "the test never opened the gate"
        return self._memmove(dst, src, n)


def _chunk_range(region: Region, chunk: int) -> tuple[int, int]:
    start = region.base.data_ptr() + chunk * region.base.stride(0)
    return start, start + region.row


def _store(worker, job_id: int, blocks: list[int], chunk: int) -> None:
    """One group-0 store of `blocks` (one chunk's worth) into pool chunk `chunk`."""
    assert worker.submit_store(job_id, GPULoadStoreSpec(blocks, group_sizes=[len(blocks), 0],
                                                        block_indices=[0, 0]),
                               CPULoadStoreSpec([chunk]))


def _stored(kv, region: Region, blocks: list[int], chunk: int) -> bool:
    return all(np.array_equal(_pool_slice(region, 0, chunk, pos, 256), kv[0][b].numpy())
               for pos, b in enumerate(blocks))


def test_submit_returns_before_the_copy_and_wait_returns_after_it(monkeypatch) -> None:
    kv, caches, region, worker = _setup()
    gate = Gate(*_chunk_range(region, 2))
    monkeypatch.setattr(cpu_worker, "_memmove", gate)
    _store(worker, 1, [0, 1, 2, 3], 1)
    _store(worker, 2, [4, 5, 6, 7], 2)  # held at the gate
    _store(worker, 3, [8, 9, 10, 11], 3)  # queued behind it
    assert gate.reached.wait(30)
    # Job 1 is copied and job 2 blocks the thread, while the engine thread goes on: submit
    # returned, and nothing is reported that was not copied.
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert _stored(kv, region, [0, 1, 2, 3], 1)
    assert not _stored(kv, region, [8, 9, 10, 11], 3)
    worker.wait({1, 99})  # finished and unknown ids do not block
    waiter = threading.Thread(target=worker.wait, args=({3},))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # job 3 is still queued
    assert worker.get_finished() == []
    gate.open.set()
    waiter.join(30)
    assert not waiter.is_alive()
    assert _stored(kv, region, [4, 5, 6, 7], 2) and _stored(kv, region, [8, 9, 10, 11], 3)
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
        (2, True, 4 * (256 + 192)), (3, True, 4 * (256 + 192))]
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in results)
    assert worker.get_finished() == []  # each job once
    worker.shutdown()


@pytest.mark.parametrize("case", ["groups", "block id", "pool slot", "too few", "too many"])
def test_a_malformed_job_fails_at_submit_and_queues_nothing(case: str) -> None:
    kv, caches, region, worker = _setup()
    gpu_args: dict = {"group_sizes": [4, 0], "block_indices": [0, 0]}
    blocks, chunks = [0, 1, 2, 3], [1]
    if case == "groups":
        gpu_args = {"group_sizes": [4], "block_indices": [0]}
    elif case == "block id":
        blocks = [0, 1, 2, NUM_BLOCKS]
    elif case == "pool slot":
        chunks = [NUM_CHUNKS]
    elif case == "too many":
        chunks = [1, 2]
    gpu = GPULoadStoreSpec(blocks, **gpu_args)
    if case == "too few":  # vLLM's constructor asserts the sizes; a spec arrives by pickle
        gpu.block_ids = gpu.block_ids[:3]
    with pytest.raises((ValueError, IndexError)):
        worker.submit_store(1, gpu, CPULoadStoreSpec(chunks))
    _store(worker, 2, [4, 5, 6, 7], 3)
    worker.wait({1, 2})
    assert [r.job_id for r in worker.get_finished()] == [2]
    assert not region.base[1].any()  # the malformed job wrote nothing
    worker.shutdown()


def test_shutdown_with_jobs_queued_finishes_the_copy_under_way_and_stops(monkeypatch) -> None:
    kv, caches, region, worker = _setup()
    gate = Gate(*_chunk_range(region, 1))
    monkeypatch.setattr(cpu_worker, "_memmove", gate)
    _store(worker, 1, [0, 1, 2, 3], 1)  # held at the gate
    _store(worker, 2, [4, 5, 6, 7], 2)
    _store(worker, 3, [8, 9, 10, 11], 3)
    assert gate.reached.wait(30)
    stopper = threading.Thread(target=worker.shutdown)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive() and not region.cleaned  # the pool stays mapped during a copy
    gate.open.set()
    stopper.join(30)
    assert not stopper.is_alive() and region.cleaned
    assert not any(t.name == "memkv-cpu-offload-copy" for t in threading.enumerate())
    assert _stored(kv, region, [0, 1, 2, 3], 1)  # the copy under way completed
    assert not region.base[2].any() and not region.base[3].any()  # queued ones were dropped
    worker.wait({2, 3})  # returns: nothing will copy them any more
    with pytest.raises(RuntimeError, match="after shutdown"):
        _store(worker, 4, [0, 1, 2, 3], 4)


def test_a_copy_that_raises_is_reported_failed_and_the_thread_goes_on(monkeypatch) -> None:
    kv, caches, region, worker = _setup()
    lo, hi = _chunk_range(region, 1)
    real = cpu_worker._memmove

    def memmove(dst: int, src: int, n: int) -> int:
        if lo <= dst < hi:
            raise OSError("injected")
        return real(dst, src, n)

    monkeypatch.setattr(cpu_worker, "_memmove", memmove)
    _store(worker, 1, [0, 1, 2, 3], 1)
    _store(worker, 2, [4, 5, 6, 7], 2)
    worker.wait({1, 2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False), (2, True)]
    assert _stored(kv, region, [4, 5, 6, 7], 2)
    worker.shutdown()
