"""Key prefixes at startup: every worker publishes the prefix of its key namespace, the scheduler
adopts the one they agree on.

Why the workers decide: the namespace digest covers what only a worker knows for certain (the
weights it loaded, the KV tensors' layout and sizes), and the scheduler's keys must name exactly
the values the workers write. vLLM builds every worker's KV cache before the scheduler (EngineCore
initializes the KV caches, then constructs the Scheduler, whose connector asks the spec for its
manager), so by the time the manager is made every worker has published.

The channel is a per-user directory on the local file system, one file per (engine, rank). vLLM's
stock OffloadingConnector gives a spec no worker -> scheduler path at startup (its handshake
metadata goes to the connector, after the scheduler exists), so a connector that carries the
prefixes itself can call `adopt` with what it received instead. Workers on other hosts than the
scheduler (multi-node tensor parallelism) cannot reach this directory: startup then stops naming
the ranks that published nothing.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path


class PrefixMismatch(RuntimeError):
    """Ranks disagree on the key prefix, or a rank published none: the engine must not start."""


def adopt(published: Mapping[int, bytes | None], world_size: int) -> bytes:
    """The prefix every rank 0..world_size-1 published. Raises PrefixMismatch naming the ranks
    that published nothing or a prefix other than rank 0's (or the first rank that has one)."""
    missing = [r for r in range(world_size) if not published.get(r)]
    if missing:
        raise PrefixMismatch(
            f"memkv direct mode: worker rank(s) {missing} published no key prefix (a worker "
            f"failed to register its KV cache, or runs on another host than the scheduler)")
    ref_rank = 0
    ref = published[ref_rank]
    assert ref is not None
    bad = {r: published[r] for r in range(world_size) if published[r] != ref}
    if bad:
        shown = ", ".join(f"rank {r}: {p.hex() if p else None}" for r, p in sorted(bad.items()))
        raise PrefixMismatch(
            f"memkv direct mode: worker ranks disagree on the key prefix (rank {ref_rank}: "
            f"{ref.hex()}; {shown}); their KV bytes for one block differ (model files, dtype or "
            f"layout), so they cannot share a namespace")
    return ref


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"memkv-direct-{os.getuid()}"


class PrefixBoard:
    """The file channel of one engine (see the module doc)."""

    def __init__(self, engine_id: str, root: Path | None = None) -> None:
        self.root = root or default_root()
        self._stem = hashlib.sha256(engine_id.encode()).hexdigest()[:32]

    def _path(self, rank: int) -> Path:
        return self.root / f"{self._stem}.rank{rank}"

    def _ensure_root(self) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            # Another user could plant a prefix here and redirect our reads and writes.
            raise PrefixMismatch(f"memkv direct mode: {self.root} is not private to this user")

    def publish(self, rank: int, prefix: bytes) -> None:
        """Worker: record this rank's prefix (atomically: the scheduler never reads half)."""
        self._ensure_root()
        path = self._path(rank)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=path.name + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(prefix)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self, world_size: int) -> dict[int, bytes | None]:
        out: dict[int, bytes | None] = {}
        for r in range(world_size):
            try:
                out[r] = self._path(r).read_bytes()
            except FileNotFoundError:
                out[r] = None
        return out

    def adopt(self, world_size: int) -> bytes:
        """Scheduler: the agreed prefix (see `adopt`); the files are removed either way, so a
        later engine with the same id never reads a stale one."""
        try:
            return adopt(self.read(world_size), world_size)
        finally:
            for r in range(world_size):
                self._path(r).unlink(missing_ok=True)
