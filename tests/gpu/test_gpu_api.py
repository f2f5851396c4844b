"""vLLM's OpenAI API server on the GPU with the memkv tier: it serves, its /metrics count memkv's
loads, and /dev/shm holds nothing of it after a SIGTERM or a SIGKILL.

The first server computes a prompt cold (its blocks go through the CPU pool to memkv) and is
stopped with SIGTERM; the second, a new process, takes the prefix from memkv, says so in its
Prometheus counters, and is killed with SIGKILL of its whole process group. /dev/shm is listed
before each server starts and after all its processes are gone.
"""

from __future__ import annotations

import signal
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from engines import PREFIX_TOKENS, PROMPT_BLOCKS, prompts, tier_config
from memkv_procs import MemKVServer
from vllm_procs import (
    SHM,
    complete,
    free_port,
    kill_group_left,
    mapped_shm_inodes,
    start_api_server,
    stop_group,
    wait_healthy,
)

pytestmark = pytest.mark.gpu

# What process pools' semaphores and queues leave after a SIGKILL of the group: Python's
# multiprocessing (vLLM's executor queues: psm_, sem.mp-) and loky's (joblib's process pools, which
# a library of the GPU host started: sem.loky-). Their resource trackers, which remove them on any
# other exit, are killed too (docs/tier.md). Nothing else may be left: no CPU pool file, nothing
# of memkv's.
QUEUES = ("psm_", "sem.mp-", "sem.loky-")


def cli_flags(engine_args: dict) -> list[str]:
    """vllm.LLM keyword arguments as the API server's flags."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def prometheus(base: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
    return total


def wait_metric(base: str, expected: float, name: str, **labels: str) -> None:
    """Stats reach the API server's front end once per engine step / logging interval."""
    deadline = time.monotonic() + 30
    while (got := prometheus(base, name, **labels)) != expected:
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, expected {expected}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tier(gpu_model, engine_args, tmp_path_factory):
    server = MemKVServer(memory="64M", lanes=1).start()
    prefix = f"gpu-api-{uuid.uuid4().hex[:8]}"
    yield {"server": server, "kv": tier_config(server.address, prefix), "model": gpu_model,
           "flags": cli_flags(engine_args), "work": tmp_path_factory.mktemp("gpu-api")}
    server.kill()


def serve_and_stop(tier: dict, name: str, stop: signal.Signals,
                   check: Callable[[str], None]) -> set[Path]:
    """Start an API server, `check(base)` it, stop it with `stop` (SIGKILL: its whole process
    group); returns what is new in /dev/shm once its processes are all gone."""
    before = set(SHM.iterdir())
    port = free_port()
    with (tier["work"] / f"{name}.log").open("w") as log:
        proc = start_api_server(tier["model"], port, tier["kv"], log, new_session=True,
                                extra=tier["flags"])
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base)
        check(base)
        stop_group(proc, stop)
    finally:
        kill_group_left(proc)
    return set(SHM.iterdir()) - before


def remove_unmapped_queues(left: set[Path]) -> None:
    """Removes the queues and semaphores in `left` that no live process maps, by inode (a
    semaphore is mapped under a temporary name by the process that creates it)."""
    in_use = mapped_shm_inodes()
    for p in left:
        if not p.name.startswith(QUEUES):
            continue
        try:
            ino = p.stat().st_ino
        except FileNotFoundError:
            continue
        if ino not in in_use:
            p.unlink(missing_ok=True)


def test_sigterm_leaves_nothing_in_dev_shm(tier) -> None:
    server, ids = tier["server"], prompts()[0]["ids"]

    def check(base: str) -> None:
        usage = complete(base, ids)
        assert usage["prompt_tokens"] == len(ids)
        deadline = time.monotonic() + 60
        while server.stats()["puts"] < PROMPT_BLOCKS:  # stores are asynchronous
            assert time.monotonic() < deadline, "the prompt's blocks did not reach memkv"
            time.sleep(0.2)

    left = serve_and_stop(tier, "sigterm", signal.SIGTERM, check)
    assert left == set(), f"left in /dev/shm after SIGTERM: {sorted(map(str, left))}"


def test_the_metrics_count_memkv_hits_and_sigkill_leaves_no_pool(tier) -> None:
    ids = prompts()[0]["ids"]

    def check(base: str) -> None:
        complete(base, ids)
        wait_metric(base, PREFIX_TOKENS, "vllm:external_prefix_cache_hits_total")
        wait_metric(base, PROMPT_BLOCKS, "vllm:kv_offload_memkv_blocks_total",
                    op="load", result="ok")

    left = serve_and_stop(tier, "sigkill", signal.SIGKILL, check)
    try:
        assert all(p.name.startswith(QUEUES) for p in left), (
            f"left in /dev/shm after SIGKILL: {sorted(map(str, left))}")
    finally:
        remove_unmapped_queues(left)
    assert tier["server"].stats()["hits"] >= PROMPT_BLOCKS

