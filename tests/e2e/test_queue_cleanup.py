"""The e2e tests' removal of what a killed engine left in /dev/shm (vllm_procs.py) spares the
executor queues of every other process on the machine: another engine's semaphore, created and
in use while a test cleans up, must survive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_procs import SHM, executor_queues, remove_orphaned_queues

# What vLLM's executor does: a multiprocessing lock of the spawn context is a named POSIX
# semaphore, /dev/shm/sem.mp-*, which the spawned processes open by name.
HOLDER = ("import multiprocessing as mp, time; lock = mp.get_context('spawn').Lock(); "
          "print(lock._semlock.name, flush=True); time.sleep(120)")


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def hold_semaphore(procs: list[subprocess.Popen[str]]) -> tuple[subprocess.Popen[str], Path]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None
    sem = SHM / ("sem." + p.stdout.readline().strip().lstrip("/"))
    assert sem.exists()
    return p, sem


def test_only_the_semaphores_of_killed_processes_made_before_the_end_are_removed(holders):
    before = executor_queues()
    _, live = hold_semaphore(holders)  # another engine's, in use
    killed, orphan = hold_semaphore(holders)
    os.kill(killed.pid, signal.SIGKILL)  # its resource tracker cannot remove it now
    killed.wait()
    ended = time.time()
    time.sleep(0.05)
    late, newer = hold_semaphore(holders)  # made after the engine under test ended
    os.kill(late.pid, signal.SIGKILL)
    late.wait()
    try:
        remove_orphaned_queues(before, ended)
        assert live.exists(), "a live process's semaphore was removed"
        assert not orphan.exists()
        assert newer.exists()
    finally:
        for sem in (orphan, newer):
            sem.unlink(missing_ok=True)
