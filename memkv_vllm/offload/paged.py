"""Where the bytes of one KV block live, and where they go inside one remote value.

Paged KV caches come in many shapes (one tensor per layer with K and V, K and V apart, one latent
per layer as in MLA, one cross-layer tensor, several KV-cache groups), but every one is a set of
tensors whose leading dimension is the block id. So a cache is described as tensors plus, per
group, the refs (tensor, bytes of one block) that make up that group's block, the form vLLM's
CanonicalKVCaches already has. A value holds `blocks_per_value` consecutive blocks of one group,
laid out ref-major: for each ref in order, its bytes of sub-block 0, 1, ... (no padding).

Only addresses are computed here (numpy, vectorised); moving the bytes is movers.py's job.
`block_addresses` and `chunks_spanned` are the block arithmetic every copier of paged KV shares
(this offloader, and the CPU-platform worker of vLLM's pool: memkv_vllm.vllm.cpu_worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np


def chunks_spanned(first_index: int, n_blocks: int, blocks_per_chunk: int) -> int:
    """How many chunks of `blocks_per_chunk` blocks hold `n_blocks` consecutive blocks whose first
    has index `first_index` in its group's sequence of blocks (a chunk holds the blocks of indices
    k * blocks_per_chunk .. (k + 1) * blocks_per_chunk - 1, so the first chunk may be partial)."""
    skip = first_index % blocks_per_chunk
    return -(-(n_blocks + skip) // blocks_per_chunk)


def block_addresses(base: int, pitch: int, rows: Any, first: int = 0, count: int | None = None,
                    per_row: int = 1, sub_pitch: int = 0) -> np.ndarray:
    """Addresses (uint64) of `count` consecutive blocks, from block `first` on, of the rows `rows`
    of a tensor at `base` whose rows lie `pitch` bytes apart, each row holding `per_row` blocks
    `sub_pitch` bytes apart: block s lies in row rows[s // per_row], (s % per_row) * sub_pitch
    bytes in. A paged KV tensor holds one block per row (block id = row); vLLM's CPU pool one
    chunk per row. `count` defaults to every block of `rows` after `first`; rows must be >= 0."""
    rows = np.asarray(rows, dtype=np.uint64)
    n = len(rows) * per_row - first if count is None else count
    sub = np.arange(first, first + n, dtype=np.uint64)
    per = np.uint64(per_row)
    return (np.uint64(base) + rows[sub // per] * np.uint64(pitch)
            + (sub % per) * np.uint64(sub_pitch))


@attrs.frozen
class KVRef:
    """`nbytes` leading bytes of every block of tensor number `tensor` (vLLM's
    CanonicalKVCacheRef: a page may be padded, only the unpadded bytes are stored)."""

    tensor: int
    nbytes: int


@attrs.frozen
class Entry:
    """One value of a job: `key` holds group `group`'s blocks `block_ids`, which are sub-blocks
    `first_pos`, `first_pos + 1`, ... of the value (a partial value starts after `first_pos`
    sub-blocks; a store leaves the skipped part of the value unspecified)."""

    key: bytes
    group: int
    block_ids: tuple[int, ...]
    first_pos: int = 0


class PagedKV:
    """The geometry of a paged KV cache: tensors (CUDA or host, any dtype, block id leading) and
    the refs of each KV-cache group. Holds the tensors, so they outlive every transfer."""

    def __init__(self, tensors: Sequence[Any], groups: Sequence[Sequence[KVRef]] | None = None,
                 blocks_per_value: int = 1) -> None:
        if not tensors:
            raise ValueError("no KV tensors")
        if blocks_per_value < 1:
            raise ValueError(f"blocks_per_value={blocks_per_value}")
        self.tensors = list(tensors)
        devices = {str(t.device) for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors on several devices: {sorted(devices)}")
        self.device = self.tensors[0].device
        self.blocks_per_value = blocks_per_value
        self.num_blocks = [int(t.shape[0]) for t in self.tensors]
        self.pitch = [int(t.stride(0)) * t.element_size() for t in self.tensors]
        self.base = [int(t.data_ptr()) for t in self.tensors]
        if groups is None:  # one group: every tensor's whole block
            groups = [[KVRef(i, self._block_bytes(i)) for i in range(len(self.tensors))]]
        self.groups = [list(g) for g in groups]
        for g, refs in enumerate(self.groups):
            if not refs:
                raise ValueError(f"group {g} has no refs")
            for r in refs:
                if not 0 <= r.tensor < len(self.tensors):
                    raise ValueError(f"group {g}: no tensor {r.tensor}")
                if not 0 < r.nbytes <= self.pitch[r.tensor]:
                    raise ValueError(f"group {g}: {r.nbytes} bytes per block in tensor "
                                     f"{r.tensor}, whose block pitch is {self.pitch[r.tensor]}")
        # Per group: the block ids every one of its tensors has (`check` runs per entry on the
        # submitting thread: one bound per group, not one per ref, which cost a 16-value job of
        # a 32-layer model 80 us on a 2-vCPU box).
        self._group_blocks = [min(self.num_blocks[r.tensor] for r in refs) for refs in self.groups]
        # Per group: each ref's offset inside a value, and the value's length.
        self._ref_offsets = []
        self.value_bytes = []
        for refs in self.groups:
            sizes = np.array([r.nbytes for r in refs], dtype=np.uint64)
            offs = np.concatenate([[0], np.cumsum(sizes * blocks_per_value)[:-1]]).astype(np.uint64)
            self._ref_offsets.append(offs)
            self.value_bytes.append(int(sizes.sum()) * blocks_per_value)

    def _block_bytes(self, i: int) -> int:
        t = self.tensors[i]
        if t.shape[0] == 0 or not t[0].is_contiguous():
            raise ValueError(f"tensor {i}: one block is not contiguous; pass refs explicitly")
        return int(t[0].numel()) * t.element_size()

    def ref_offsets(self, group: int) -> list[int]:
        """Where each ref of `group` starts inside a value."""
        return [int(o) for o in self._ref_offsets[group]]

    @property
    def max_value_bytes(self) -> int:
        return max(self.value_bytes)

    def check(self, entry: Entry) -> None:
        """ValueError for an entry that does not fit this cache (a caller's programming error)."""
        if not 0 <= entry.group < len(self.groups):
            raise ValueError(f"entry {entry.key!r}: no group {entry.group}")
        n = len(entry.block_ids)
        if n == 0 or entry.first_pos < 0 or entry.first_pos + n > self.blocks_per_value:
            raise ValueError(f"entry {entry.key!r}: {n} blocks from position {entry.first_pos} "
                             f"do not fit a value of {self.blocks_per_value}")
        if min(entry.block_ids) < 0 or max(entry.block_ids) >= self._group_blocks[entry.group]:
            short = min(self.groups[entry.group], key=lambda r: self.num_blocks[r.tensor]).tensor
            raise ValueError(f"entry {entry.key!r}: block id out of range for tensor "
                             f"{short} ({self.num_blocks[short]} blocks)")

    def pieces(self, entries: Sequence[Entry], slot_ptrs: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kv addresses, value addresses, sizes) of every contiguous piece of `entries`, whose
        values lie at `slot_ptrs`. One piece per (entry block, ref)."""
        kv, val, size = [], [], []
        by_group: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_group.setdefault(e.group, []).append(i)
        for g, idx in by_group.items():
            blk = np.concatenate([np.asarray(entries[i].block_ids, dtype=np.uint64) for i in idx])
            pos = np.concatenate([np.arange(entries[i].first_pos,
                                            entries[i].first_pos + len(entries[i].block_ids),
                                            dtype=np.uint64) for i in idx])
            slot = np.concatenate([np.full(len(entries[i].block_ids), slot_ptrs[i],
                                           dtype=np.uint64) for i in idx])
            for r, off in zip(self.groups[g], self._ref_offsets[g], strict=True):
                nb = np.uint64(r.nbytes)
                kv.append(block_addresses(self.base[r.tensor], self.pitch[r.tensor], blk))
                val.append(slot + off + pos * nb)
                size.append(np.full(len(blk), nb, dtype=np.uint64))
        return np.concatenate(kv), np.concatenate(val), np.concatenate(size)
