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
travel through a small ring of pinned tables (`JobTables`): no allocation and no pinning per job.

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


class JobTables:
    """A ring of `depth` job tables of up to `rows` blocks: pinned host rows the host writes,
    device rows the kernel reads, one asynchronous copy between them per launch. A table is
    written again only after the copy that read it has run (the fence of its last job)."""

    def __init__(self, torch: Any, rows: int, device: Any, depth: int = 8) -> None:
        cols = -(-3 * rows // 2) * 2  # 16-byte rows: the kernel sees aligned pointers
        self.host = torch.empty((depth, cols), dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty((depth, cols), dtype=torch.int64, device=device)
        self._np = self.host.numpy()
        self._host_rows = list(self.host)
        self._dev_rows = list(self.dev)
        self._fences: list[Any] = [None] * depth
        self._next = 0

    def fill(self, blocks: list[int], slots: list[int], positions: list[int]) -> tuple[int, Any]:
        """Write one job's rows into the next free table; (its index, its device rows)."""
        i = self._next
        self._next = (i + 1) % len(self._fences)
        fence = self._fences[i]
        if fence is not None:
            fence.wait()  # long done in practice: `depth` launches ago, on the same stream
            self._fences[i] = None
        n = len(blocks)
        row = self._np[i]
        row[:n] = blocks
        row[n:2 * n] = slots  # host or device addresses: below 2**63
        row[2 * n:3 * n] = positions
        self._dev_rows[i].copy_(self._host_rows[i], non_blocking=True)  # current stream
        return i, self._dev_rows[i]

    def used_until(self, tables: list[int], fence: Any) -> None:
        """`fence` passes once the launches that read `tables` have run."""
        for i in tables:
            self._fences[i] = fence


def copy_blocks(refs: Any, n_refs: int, job: Any, n_blocks: int, to_kv: bool,
                programs: int) -> None:
    """Enqueue the copy of `n_blocks` blocks of one group (rows in `job`, see `JobTables`) on
    torch's current stream."""
    _copy_blocks[(min(programs, n_blocks * n_refs),)](refs, n_refs, job, n_blocks, TO_KV=to_kv,
                                                      WORDS=WORDS_PER_STEP)
