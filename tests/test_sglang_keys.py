"""Units of the SGLang backend that need no SGLang (memkv_vllm.sglang.pages / keys): a page's
segments and their keys. The backend against SGLang's real pools is tests/hicache."""

from __future__ import annotations

import types

import numpy as np
import pytest

from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.sglang.keys import PageKeys, namespace_fields, page_hash
from memkv_vllm.sglang.pages import PageGeometry, leading_hits, page_runs


class FakePool:
    """A host pool's page accessor: `segs` segments of `seg` bytes per page, pages back to back
    (a unit stand-in; tests/hicache use SGLang's own pools)."""

    def __init__(self, layout: str, segs: int, seg: int = 64, page_size: int = 4) -> None:
        self.layout, self.page_size, self.segs, self.seg = layout, page_size, segs, seg
        self.kv_buffer = np.zeros(1)
        self.dtype, self.layer_num = "torch.bfloat16", segs

    def get_page_buffer_meta(self, indices: np.ndarray) -> tuple[list[int], list[int]]:
        starts = list(indices)[:: self.page_size]
        ptrs = [1000 + int(i) * self.segs * self.seg + s * self.seg for i in starts
                for s in range(self.segs)]
        return ptrs, [self.seg] * len(ptrs)


def test_page_names_map_to_their_digest_or_a_hash_of_the_name() -> None:
    h = "ab" * 32
    assert page_hash(h) == bytes.fromhex(h)
    assert page_hash("test_1") != page_hash("test_2")
    assert len(page_hash("test_1")) == 32
    # A non-hex name never lands on the digest its bytes would spell as hex.
    assert page_hash("test") != bytes.fromhex(b"test".hex())


def test_mha_layer_first_flat_pages_hold_every_k_then_every_v() -> None:
    g = PageGeometry.of(FakePool("layer_first", 6), is_mla=False)
    assert g.flat_order == (0, 2, 4, 1, 3, 5)  # accessor: K0 V0 K1 V1 K2 V2
    ptrs, sizes = g.flat_ranges(0)
    assert ptrs == [0, 192, 64, 256, 128, 320] and sizes == [64] * 6
    mla = PageGeometry.of(FakePool("layer_first", 6), is_mla=True)
    assert mla.flat_order == tuple(range(6))
    assert PageGeometry.of(FakePool("page_first", 2), is_mla=False).flat_order == (0, 1)


def test_ranges_are_the_accessors_and_a_changed_pool_is_refused() -> None:
    pool = FakePool("page_first", 2)
    g = PageGeometry.of(pool, is_mla=False)
    ptrs, sizes = g.ranges(pool, np.arange(4, 12), 2)
    assert ptrs == [1000 + 4 * 128, 1000 + 4 * 128 + 64, 1000 + 8 * 128, 1000 + 8 * 128 + 64]
    with pytest.raises(ValueError, match="ranges for 3 pages"):
        g.ranges(pool, np.arange(4, 12), 3)


@pytest.mark.parametrize("layout", ["page_unified", "page_first_kv_split", ""])
def test_pools_without_whole_segment_pages_are_refused(layout: str) -> None:
    with pytest.raises(ValueError, match="not supported"):
        PageGeometry.of(FakePool(layout, 2), is_mla=False)
    no_buffer = FakePool("page_first", 2)
    no_buffer.kv_buffer = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no KV buffer"):
        PageGeometry.of(no_buffer, is_mla=False)


def test_runs_of_pages() -> None:
    assert page_runs([True, True, True, False, True, True], 2) == [True, False, True]
    assert leading_hits([True, False, True]) == 1 and leading_hits([True, True]) == 2


def _cfg(is_mla: bool, tp_rank: int = 0, tp_size: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(is_mla_model=is_mla, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0,
                                 pp_size=1, attn_cp_rank=0, attn_cp_size=1, dcp_size=1,
                                 dcp_rank=0)


def _keys(cfg: types.SimpleNamespace, namespace: str = "default", segs: int = 2) -> list[bytes]:
    pool = FakePool("page_first", segs)
    fields, rank = namespace_fields(cfg, pool, PageGeometry.of(pool, cfg.is_mla_model), namespace)
    return PageKeys(KeyLayout("memkv", "org/m", fields, rank), segs).of("cd" * 32)


def test_mla_pages_are_shared_by_every_tp_rank_and_size_mha_pages_by_none() -> None:
    assert _keys(_cfg(True, 0, 1)) == _keys(_cfg(True, 3, 8))
    assert _keys(_cfg(False, 0, 2)) != _keys(_cfg(False, 1, 2))
    assert _keys(_cfg(False, 0, 1)) != _keys(_cfg(False, 0, 2))


def test_the_namespace_and_the_geometry_are_in_every_key() -> None:
    base = _keys(_cfg(False))
    assert len(base) == 2 and len(set(base)) == 2
    assert set(base).isdisjoint(_keys(_cfg(False), namespace="team-b"))
    assert set(base).isdisjoint(_keys(_cfg(False), segs=4))
