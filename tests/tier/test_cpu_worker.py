"""The CPU-platform copy worker against an independent reference of vLLM's block mapping.

The end-to-end tests run one KV group with one block per chunk; this covers what they do not:
blocks_per_chunk > 1, partial first chunks (a load that starts mid-chunk), several KV groups,
refs shorter than the padded page, several tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from memkv_vllm.compat import api
from memkv_vllm.cpu_worker import SyncCopyWorker

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
    worker_cls = api().offloading_worker_class(SyncCopyWorker)
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
    [res] = worker.get_finished()
    assert res.success and res.transfer_size == 256 + 192
    assert np.array_equal(kv[0][9].numpy(), _pool_slice(region, 0, 4, 2, 256))
    assert np.array_equal(kv[1][9].numpy(), _pool_slice(region, 1, 4, 2, 192))
