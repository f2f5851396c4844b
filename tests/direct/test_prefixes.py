"""Key prefixes at startup: the scheduler adopts what every worker rank published, and stops
startup naming the rank that published nothing or disagrees."""

from __future__ import annotations

import os

import pytest

from memkv_vllm.direct.prefixes import PrefixBoard, PrefixMismatch, adopt


def test_agreeing_ranks_are_adopted() -> None:
    assert adopt({0: b"p", 1: b"p", 2: b"p"}, 3) == b"p"


def test_a_rank_that_published_nothing_is_named() -> None:
    with pytest.raises(PrefixMismatch, match=r"rank\(s\) \[1, 3\] published no key prefix"):
        adopt({0: b"p", 2: b"p"}, 4)


def test_disagreeing_ranks_are_named() -> None:
    with pytest.raises(PrefixMismatch, match=r"rank 0: 70.*rank 2: 71"):
        adopt({0: b"p", 1: b"p", 2: b"q"}, 3)


def test_board_round_trip_removes_its_files(tmp_path) -> None:
    root = tmp_path / "board"
    workers = [PrefixBoard("engine-1", root) for _ in range(2)]
    for rank, w in enumerate(workers):
        w.publish(rank, b"\x01prefix")
    assert PrefixBoard("engine-2", root).read(2) == {0: None, 1: None}  # engines are separate
    assert PrefixBoard("engine-1", root).adopt(2) == b"\x01prefix"
    assert os.listdir(root) == []  # a later engine with the same id reads nothing stale
    with pytest.raises(PrefixMismatch, match=r"\[0, 1\]"):
        PrefixBoard("engine-1", root).adopt(2)


def test_board_refuses_a_directory_others_can_write(tmp_path) -> None:
    root = tmp_path / "board"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(PrefixMismatch, match="not private"):
        PrefixBoard("e", root).publish(0, b"p")
