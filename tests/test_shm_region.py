"""memkv_vllm.vllm.shm_region on real files: which name it unlinks, and when it leaves one alone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from memkv_vllm.vllm.shm_region import drop_name_after_last_mapping, forget_dropped_name


class Region:
    """The attributes of vLLM's SharedOffloadRegion that the helpers read: name, fd, creator."""

    def __init__(self, path: Path, creator: bool) -> None:
        self.mmap_path = str(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if creator else 0)
        self.fd: int | None = os.open(path, flags, 0o600)
        self._creator = creator


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Region, Region]]:
    path = tmp_path / "vllm_offload_e.mmap"
    worker = Region(path, creator=True)
    scheduler = Region(path, creator=False)
    yield worker, scheduler
    for r in (worker, scheduler):
        os.close(r.fd)  # type: ignore[arg-type]


def test_the_joiner_unlinks_the_name_and_the_creator_then_leaves_it_alone(pair) -> None:
    worker, scheduler = pair
    os.write(worker.fd, b"kv")
    assert drop_name_after_last_mapping(scheduler)
    assert not os.path.exists(scheduler.mmap_path)
    assert os.pread(scheduler.fd, 2, 0) == b"kv"  # the open file outlives its name
    forget_dropped_name(worker)
    assert worker._creator is False  # cleanup() will not try to unlink the name again
    assert not drop_name_after_last_mapping(scheduler)  # idempotent


def test_the_creator_never_unlinks(pair) -> None:
    worker, _ = pair
    assert not drop_name_after_last_mapping(worker)  # workers not known to be done mapping
    assert os.path.exists(worker.mmap_path)


def test_a_newer_file_under_the_same_name_is_left_alone(pair) -> None:
    worker, scheduler = pair
    os.unlink(scheduler.mmap_path)
    Path(scheduler.mmap_path).write_bytes(b"")  # another engine with the same engine id
    assert not drop_name_after_last_mapping(scheduler)
    assert os.path.exists(scheduler.mmap_path)
    forget_dropped_name(worker)
    assert worker._creator is False  # its cleanup() must not remove the newer engine's file


def test_the_creator_keeps_its_name_while_nobody_dropped_it(pair) -> None:
    worker, _ = pair
    forget_dropped_name(worker)
    assert worker._creator is True  # vLLM's own cleanup still removes it


def test_objects_without_the_region_attributes_are_ignored() -> None:
    assert not drop_name_after_last_mapping(None)
    forget_dropped_name(object())
