"""One Triton kernel launch moves every piece of a job's blocks between KV tensors and scratch.

Why a kernel: the pieces of a KV block are small (64 KiB per layer for a Llama-8B block, 18 KiB
for an MLA latent) and copy engines are slow at small descriptors (measured on an H200: ~35 GB/s
at 64 KiB and ~5 GB/s at 18 KiB host-to-device, against 54 GB/s for one large copy). A kernel reads
and writes any address the GPU reaches through unified addressing, pinned host memory included, so
one launch gathers device pages straight into host scratch (or device scratch) at the PCIe rate.

Why addresses are computed on the GPU: building one (src, dst, size) triple per piece on the host
took longer than moving a 16-block job (numpy, ~0.2-0.3 ms per job on the H200 host), so the host
sends one row per block (block id, slot address, position in the value) and the kernel combines
it with the group's ref table (base, pitch, bytes, offset in the value), uploaded once. The rows
travel through a ring of pinned memory (`movers.JobRows`): no allocation and no pinning per job.

Why `do_not_specialize`: Triton compiles a variant per "is 1 / divisible by 16" class of integer
arguments; the block and ref counts change from job to job, and a variant compiled in the middle
of a job costs a second of copy time. One variant per direction, compiled at start-up.

Requires 8-byte aligned addresses and sizes (KV pages are; `movers.kv_aligned` checks).
Imported only when a CUDA mover is built; the package works without Triton.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl

WORDS_PER_STEP = 1024  # 8 KiB per program per loop step


@triton.jit(do_not_specialize=["n_refs", "n_blocks"])
def _copy_blocks(refs, n_refs, job, n_blocks, TO_KV: tl.constexpr, WORDS: tl.constexpr):
    # refs: 4 rows of n_refs int64 (base, pitch, bytes, value offset). job: 3 rows of n_blocks
    # int64 (block id, slot address, position). Piece p = block p // n_refs, ref p % n_refs. A
    # persistent grid: a few programs walk all pieces, so the model keeps most SMs.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, WORDS)
    p = pid
    while p < n_blocks * n_refs:
        s = p // n_refs
        r = p % n_refs
        nbytes = tl.load(refs + 2 * n_refs + r)
        kv = tl.load(refs + r) + tl.load(job + s) * tl.load(refs + n_refs + r)
        val = tl.load(job + n_blocks + s) + tl.load(refs + 3 * n_refs + r) \
            + tl.load(job + 2 * n_blocks + s) * nbytes
        if TO_KV:
            src = val.to(tl.pointer_type(tl.int64))
            dst = kv.to(tl.pointer_type(tl.int64))
        else:
            src = kv.to(tl.pointer_type(tl.int64))
            dst = val.to(tl.pointer_type(tl.int64))
        words = nbytes // 8
        for start in range(0, words, WORDS):
            idx = start + offs
            mask = idx < words
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        p += step


def ref_table(torch: Any, bases: list[int], pitches: list[int], nbytes: list[int],
              offsets: list[int], device: Any) -> Any:
    """The device-resident ref table of one group."""
    t = np.array([bases, pitches, nbytes, offsets], dtype=np.uint64).view(np.int64)
    return torch.from_numpy(t.reshape(-1).copy()).to(device)


def copy_blocks(refs: Any, n_refs: int, job: Any, n_blocks: int, to_kv: bool,
                programs: int) -> None:
    """Enqueue the copy of `n_blocks` blocks of one group (rows in `job`, see `movers.JobRows`) on
    torch's current stream."""
    _copy_blocks[(min(programs, n_blocks * n_refs),)](refs, n_refs, job, n_blocks, TO_KV=to_kv,
                                                      WORDS=WORDS_PER_STEP)
