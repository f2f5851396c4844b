"""The memkv keys of SGLang pages: one key per segment of a page (memkv_vllm.sglang.pages), under
a namespace (memkv_vllm.core.keys.KeyLayout) whose digest covers what changes a page's bytes.

SGLang names a page by the hex SHA-256 of its tokens chained to the page before (its
`get_hash_str`); the name says nothing about the model, the KV dtype or layout, the page size or
who may read it, and it has no tenant (sglang#37160). The namespace adds all of those: the model
and every field of `namespace_fields`, plus a `namespace` (tenant) chosen by the deployment, so
two tenants on one cluster never share a page, and two engines of one configuration do.

The TP rank is part of the key for MHA (each rank holds its own heads). MLA KV is the same on
every TP rank (SGLang marks it `is_mla_model` and lets one rank per DCP shard write): there the
rank is the DCP rank, 0 without DCP, so every rank of every TP size reads the same pages.
"""

from __future__ import annotations

import hashlib
import string
from typing import Any

import attrs

from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.sglang.pages import PageGeometry

# Bumped whenever the bytes stored for one page change for the same KV.
VALUE_LAYOUT = "sglang-segments-v1"
_HEX = frozenset(string.hexdigits)


def page_hash(key: str) -> bytes:
    """The bytes a page name stands for: its hex digest decoded, or, for a name that is not hex
    (tests, other key schemes), a SHA-256 of it (only a preimage could make the two meet)."""
    if key and len(key) % 2 == 0 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return hashlib.sha256(b"sglang-page-name:" + key.encode("utf-8", "surrogatepass")).digest()


def namespace_fields(cfg: Any, host: Any, geometry: PageGeometry, namespace: str
                     ) -> tuple[dict[str, Any], int]:
    """(digest fields, rank) of the pages `host` holds under the HiCacheStorageConfig `cfg`."""
    is_mla = bool(cfg.is_mla_model)
    fields: dict[str, Any] = {
        "stack": "sglang",
        "value_layout": VALUE_LAYOUT,
        "namespace": namespace,
        "kv": "mla" if is_mla else "mha",
        "layout": geometry.layout,
        "dtype": str(getattr(host, "dtype", "")),
        "page_size": geometry.page_size,
        "segment_bytes": list(geometry.segment_sizes),
        # Shape facts a pool may expose; each changes the bytes of a page.
        **{a: int(getattr(host, a)) for a in ("layer_num", "head_num", "head_dim", "v_head_dim",
                                             "kv_cache_dim", "kv_lora_rank", "qk_rope_head_dim")
           if isinstance(getattr(host, a, None), int)},
        # Pipeline stages hold different layers; context-parallel ranks disjoint slices.
        "pp": [int(cfg.pp_rank), int(cfg.pp_size)],
        "attn_cp": [int(cfg.attn_cp_rank), int(cfg.attn_cp_size)],
    }
    dcp_size = int(getattr(cfg, "dcp_size", 1) or 1)
    if is_mla:
        rank = int(getattr(cfg, "dcp_rank", 0) or 0)
        if dcp_size > 1:
            fields["dcp"] = [dcp_size, getattr(cfg, "logical_page_size", None)]
    else:
        rank = int(cfg.tp_rank)
        fields["tp_size"] = int(cfg.tp_size)  # which heads rank r holds
    return fields, rank


@attrs.frozen
class PageKeys:
    """Names the segments of pages under one namespace."""

    layout: KeyLayout
    segments: int

    def of(self, key: str) -> list[bytes]:
        """The memkv keys of page `key`'s segments, in segment order."""
        h = page_hash(key)
        return [self.layout.key(h, s) for s in range(self.segments)]

    def of_all(self, keys: list[str]) -> list[bytes]:
        return [k for key in keys for k in self.of(key)]
