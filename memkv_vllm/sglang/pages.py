"""Where one SGLang page lies in a host KV pool, and how its bytes map to memkv values.

A page is read from the pool's own zero-copy accessor, `get_page_buffer_meta(indices)`, the
one SGLang's zero-copy storage backends use: a list of (address, length) ranges, "segments",
per page. Each segment is one memkv value, so pages move straight between the pool and the
cluster, never through a copy:

* MHA page_first, page_first_direct, page_head: the page's K and its V (2 segments);
* MHA layer_first: K and V of each layer (2 per layer, K and V alternating);
* MLA page_first, page_first_direct: the page (1); MLA layer_first: one per layer.

SGLang's generic (copying) get/set path moves a "flat data page" instead
(`get_data_page(flat=True)`): the same segments back to back, in the accessor's order except
for MHA layer_first, whose flat page holds every layer's K, then every layer's V.
`PageGeometry.flat_order` says which segment each chunk of a flat page is.

Nothing here imports SGLang: the pool is only asked for the public attributes named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

# Layouts whose pages the accessor describes as whole segments (page_unified, page_first_kv_split
# and the logical-only pools of hybrid models have no such description, or carry side buffers).
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@attrs.frozen
class PageGeometry:
    """The segments of every page of one host pool."""

    layout: str
    page_size: int  # tokens per page
    segment_sizes: tuple[int, ...]  # bytes of each segment, in the accessor's order
    flat_order: tuple[int, ...]  # flat_order[i]: the segment that is chunk i of a flat page

    @property
    def segments(self) -> int:
        return len(self.segment_sizes)

    @property
    def page_bytes(self) -> int:
        return sum(self.segment_sizes)

    @classmethod
    def of(cls, host: Any, is_mla: bool) -> PageGeometry:
        """The geometry of `host`'s pages (asked for its first page). ValueError for a pool
        whose pages are not whole segments of its buffers."""
        layout = str(getattr(host, "layout", ""))
        if layout not in LAYOUTS:
            raise ValueError(f"memkv: SGLang host pool layout {layout!r} is not supported "
                             f"(supported: {', '.join(LAYOUTS)})")
        if getattr(host, "kv_buffer", None) is None:
            raise ValueError("memkv: the SGLang host pool has no KV buffer of its own (a "
                             "logical-only pool of a hybrid model); not supported")
        page_size = int(host.page_size)
        _, sizes = host.get_page_buffer_meta(np.arange(page_size))
        sizes = tuple(int(s) for s in sizes)
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"memkv: the host pool describes a page as segments {sizes}")
        n = len(sizes)
        if layout == "layer_first" and not is_mla and n % 2 == 0:
            # Accessor: K0 V0 K1 V1 ...; flat page: K0 K1 ... V0 V1 ...
            half = n // 2
            order = tuple(2 * i for i in range(half)) + tuple(2 * i + 1 for i in range(half))
        else:
            order = tuple(range(n))
        return cls(layout, page_size, sizes, order)

    def ranges(self, host: Any, host_indices: Any, pages: int
               ) -> tuple[list[int], list[int]]:
        """(addresses, lengths) of the segments of `pages` pages at `host_indices` (token
        indices, `page_size` per page), page after page. ValueError if the pool answers for
        another number of segments or other lengths than this geometry's."""
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self.segments or len(sizes) != len(ptrs):
            raise ValueError(f"memkv: host pool gave {len(ptrs)} ranges for {pages} pages of "
                             f"{self.segments} segments")
        if any(int(s) != self.segment_sizes[i % self.segments] for i, s in enumerate(sizes)):
            raise ValueError("memkv: host pool segment lengths changed")
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def flat_ranges(self, base: int) -> tuple[list[int], list[int]]:
        """(addresses, lengths) of a flat page at `base`, in segment order."""
        starts = [0] * self.segments
        offset = 0
        for seg in self.flat_order:
            starts[seg] = offset
            offset += self.segment_sizes[seg]
        return [base + s for s in starts], list(self.segment_sizes)


def page_runs(ok: Sequence[bool], segments: int) -> list[bool]:
    """Per page: True when every one of its `segments` consecutive entries of `ok` is."""
    return [all(ok[i:i + segments]) for i in range(0, len(ok), segments)]


def leading_hits(pages_ok: Sequence[bool]) -> int:
    """The length of the run of True at the start of `pages_ok`."""
    for i, hit in enumerate(pages_ok):
        if not hit:
            return i
    return len(pages_ok)
