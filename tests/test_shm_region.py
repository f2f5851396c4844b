"""memkv_vllm.vllm.shm_region on real files, without vLLM: which name it unlinks, and when it
leaves one alone (tests/tier/test_shm_pool.py: the same with vLLM's real regions and specs)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from memkv_vllm.vllm.shm_region import drop_name, names_file


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A pool file as a worker created it, and the descriptor the scheduler opened it as."""
    path = tmp_path / "vllm_offload_e.mmap"
    path.write_bytes(b"kv")
    fd = os.open(path, os.O_RDWR)
    yield str(path), fd
    os.close(fd)


def test_the_joiner_unlinks_the_name_and_keeps_the_file(pool) -> None:
    path, fd = pool
    assert names_file(path, fd)
    assert drop_name(path, fd, creator=False)
    assert not os.path.exists(path) and not names_file(path, fd)
    assert os.pread(fd, 2, 0) == b"kv"  # the open file outlives its name
    assert not drop_name(path, fd, creator=False)  # idempotent


def test_the_creator_never_unlinks(pool) -> None:
    path, fd = pool
    assert not drop_name(path, fd, creator=True)  # workers not known to be done mapping
    assert os.path.exists(path)


def test_a_newer_file_under_the_same_name_is_left_alone(pool) -> None:
    path, fd = pool
    os.unlink(path)
    Path(path).write_bytes(b"")  # another engine with the same engine id
    assert not names_file(path, fd)
    assert not drop_name(path, fd, creator=False)
    assert os.path.exists(path)
