"""Remote key names for offloaded KV blocks.

Why a namespace at all: several engines share one memkv cluster, and a value is only usable by an
engine whose KV bytes would be identical. Like the names of vLLM's FileMapper, every key is
`<prefix>/<model>_<digest12>_r<rank>/<hhh>/<hh>_g<group>/<hash_hex>.bin`, where the digest
covers everything that changes the bytes behind a block hash (model, dtype, block geometry,
parallel layout, KV-cache groups, value size, hash algorithm and seed, vLLM layout generation).
Two configurations that differ in any of those cannot see each other's values; identical ones share.

This module has no vLLM imports: compat/ reads the fields from an offloading spec and splits
vLLM's OffloadKey into (block hash, group index).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import attrs

# memkv's wire protocol caps a key at 1024 bytes (MAX_KEY_LEN); keep names well below it.
MAX_KEY_BYTES = 480
# A model name longer than this is replaced by a readable tail plus a digest of the whole name.
_MAX_MODEL_CHARS = 96


def canonical_json(fields: Mapping[str, Any]) -> str:
    """`fields` as JSON that depends on nothing but their values (what namespace digests hash)."""
    # sort_keys + compact separators: the digest must not depend on dict order or whitespace.
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)


def config_digest(fields: Mapping[str, Any]) -> str:
    """12 hex chars of sha256 over the canonical JSON of `fields` (FileMapper's length)."""
    return hashlib.sha256(canonical_json(fields).encode()).hexdigest()[:12]


def safe_model_name(model: str) -> str:
    """The model name as one path segment: '/' becomes '_' as in FileMapper; long names are cut.

    The cut is safe because the full name is also inside the config digest.
    """
    name = model.replace("/", "_")
    if len(name) > _MAX_MODEL_CHARS:
        tail = name[-(_MAX_MODEL_CHARS - 13) :]
        name = f"{hashlib.sha256(name.encode()).hexdigest()[:12]}_{tail}"
    return name


@attrs.frozen
class KeyLayout:
    """Maps (block hash, KV-cache group) to a remote key under one configuration's namespace.

    `fields` must contain everything that changes the stored bytes; `model` is repeated there by
    `from_fields` so that a name cut by `safe_model_name` can never merge two models.
    """

    prefix: str
    model: str
    fields: Mapping[str, Any] = attrs.field(converter=lambda f: dict(f))
    rank: int = 0
    digest: str = attrs.field(init=False)
    namespace: str = attrs.field(init=False)

    @digest.default
    def _digest(self) -> str:
        return config_digest({**self.fields, "model_name": self.model})

    @namespace.default
    def _namespace(self) -> str:
        base = f"{safe_model_name(self.model)}_{self.digest}_r{self.rank}"
        prefix = self.prefix.strip("/")
        return f"{prefix}/{base}" if prefix else base

    @property
    def key_start(self) -> bytes:
        """What every key of this namespace starts with (what a tenant's prefix must start)."""
        return f"{self.namespace}/".encode()

    def key(self, block_hash: bytes, group_idx: int) -> bytes:
        """The remote key of one offloaded chunk (hash of its last token block + group index)."""
        h = block_hash.hex()
        name = f"{self.namespace}/{h[0:3]}/{h[3:5]}_g{group_idx}/{h}.bin".encode()
        if len(name) > MAX_KEY_BYTES:
            # Only a very long prefix can get here: fold the namespace into a digest.
            ns = hashlib.sha256(self.namespace.encode()).hexdigest()[:24]
            name = f"{ns}/{h[0:3]}/{h[3:5]}_g{group_idx}/{h}.bin".encode()
        return name

    def describe(self) -> str:
        return canonical_json({**self.fields, "model_name": self.model, "prefix": self.prefix})
