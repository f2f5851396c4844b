"""Remote keys of direct mode: one binary key per (KV block, TP rank).

Why binary: a direct-mode key is computed for every block of every request on the scheduling path
and sent with every transfer; a fixed-size binary key is shorter than tier mode's path names
(keys.py) and needs no formatting. Why a digest: a value is only usable by an engine whose KV bytes
for the same block hash would be identical, so every input that changes those bytes is folded into
the digest: model, weights fingerprint (a new checkpoint under the same name never restores the old
one's KV), dtype, TP size, block size, KV layout, hash algorithm and seed, and the operator's
`memkv_spec_prefix`. The TP rank is outside the digest because each rank holds its own slice of
every block: the ranks share the namespace and differ only in the rank field.

Key = spec prefix | b"mkD1" | digest (16 bytes) | rank (u16, big-endian) | group (u32, big-endian)
| block hash. The spec prefix (`memkv_spec_prefix` as UTF-8, usually empty) leads the key as it
is, so that a tenant of a server with tenants (whose keys must start with its prefix) names its
namespace there; it is in the digest too.
No vLLM imports: the spec reads the fields from vLLM and passes them here.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import attrs

from memkv_vllm.core.keys import canonical_json

_MAGIC = b"mkD1"  # never the first bytes of a tier-mode key (those are readable path names)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _str_or_bytes(v: str | bytes) -> str:
    return v.hex() if isinstance(v, bytes) else v


@attrs.frozen
class DirectKeyLayout:
    """The namespace of one engine configuration; `key()` names one block of one rank."""

    model: str
    weights: str  # weights_fingerprint()
    dtype: str  # the KV cache dtype
    tp_size: int
    block_size: int  # tokens per stored value
    kv_layout: str  # anything that changes a block's bytes: backend layout, value layout version
    hash_algo: str
    hash_seed: str | bytes = attrs.field(converter=_str_or_bytes)  # e.g. vLLM's NONE_HASH
    spec_prefix: str = ""
    digest: bytes = attrs.field(init=False)

    @digest.default
    def _digest(self) -> bytes:
        fields = {a.name: getattr(self, a.name) for a in attrs.fields(type(self))
                  if a.name != "digest"}
        return hashlib.sha256(canonical_json(fields).encode()).digest()[:16]

    @property
    def prefix(self) -> bytes:
        """The bytes every key of this namespace starts with (what ranks compare at startup)."""
        return self.spec_prefix.encode() + _MAGIC + self.digest

    def key(self, block_hash: bytes, group: int, rank: int) -> bytes:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside TP size {self.tp_size}")
        return key_under(self.prefix, block_hash, group, rank)


def key_under(prefix: bytes, block_hash: bytes, group: int, rank: int) -> bytes:
    """The key of one block of one rank in the namespace whose `prefix` is given (what the
    scheduler, which only adopts the workers' prefix, computes)."""
    return prefix + rank.to_bytes(2, "big") + group.to_bytes(4, "big") + block_hash


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """What identifies the weights behind `model`.

    * a hub commit (`revision` as 40 hex digits, or a path inside a hub cache snapshot
      `.../snapshots/<commit>/`): `hub:<commit>` — free;
    * any other local directory: `sha256:<hex>` over every file's relative path, size and
      content (reads the whole checkpoint once: about a second per GB);
    * anything else raises ValueError: a name alone cannot tell two checkpoints apart.
    """
    if revision and _COMMIT.match(revision):
        return f"hub:{revision}"
    path = Path(model)
    if path.is_dir():
        parts = path.resolve().parts
        for i, p in enumerate(parts[:-1]):
            if p == "snapshots" and _COMMIT.match(parts[i + 1]):
                return f"hub:{parts[i + 1]}"
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = f.relative_to(path).as_posix()
            if any(part.startswith(".") for part in Path(rel).parts):
                continue  # caches and lock files of tools, not weights
            h.update(f"{rel}\0{os.path.getsize(f)}\0".encode())
            fd = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    fd.update(chunk)
            h.update(fd.digest())
        return f"sha256:{h.hexdigest()}"
    raise ValueError(f"cannot fingerprint the weights of {model!r}: give a local directory or a "
                     f"40-digit hub commit as revision")
