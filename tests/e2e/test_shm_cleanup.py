"""A stopped or killed API server with the memkv tier leaves its CPU pool nowhere in /dev/shm.

vLLM's TieringOffloadingSpec backs the CPU pool with /dev/shm/vllm_offload_<id>.mmap (the engine
id; vLLM 0.25: the instance id) and,
left to itself, removes it only on a clean shutdown of the worker that created it (a SIGTERM of
the API server left it, a SIGKILL always does). The plugin's MemKVTieringOffloadingSpec unlinks
the name once every process has mapped the pool (memkv_vllm/vllm/shm_region.py): these tests start
the real API server with that spec, the tier and a real memkv server, check that the pool is
mapped but already nameless while it serves, stop it with SIGTERM or SIGKILL of its whole
process group, and list /dev/shm.

vLLM's own executor queues (psm_* shared memory, sem.mp-* semaphores) are not the tier's: Python's
resource tracker removes them on SIGTERM, which is asserted; a SIGKILL of the group kills the
tracker too and leaves them (docs/tier.md); the test removes what its engine left in any case.
"""

from __future__ import annotations

import importlib.metadata
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from memkv_procs import MemKVServer  # noqa: E402
from tier_engine import kv_transfer_config, prompt_text  # noqa: E402
from vllm_procs import (  # noqa: E402
    DELETED,
    complete,
    executor_queues,
    free_port,
    group_pids,
    kill_group_left,
    remove_orphaned_queues,
    shm_mappings,
    start_api_server,
    stop_group,
    wait_healthy,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server() -> Iterator[MemKVServer]:
    if not any(e.name == "memkv_tier"
               for e in importlib.metadata.entry_points(group="vllm.general_plugins")):
        pytest.fail("the memkv_tier vLLM plugin entry point is not installed in this venv")
    s = MemKVServer(memory="64M", lanes=1).start()
    yield s
    s.kill()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL of the process group"])
def test_the_cpu_pool_leaves_nothing_in_dev_shm(server, model, tmp_path, stop) -> None:
    engine_id = f"memkv-shm-{uuid.uuid4().hex[:12]}"
    kv = {**kv_transfer_config(server.address, engine_id, 64 << 20), "engine_id": engine_id}
    pool = ""
    port = free_port()
    before = server.stats()["puts"]
    queues_before = executor_queues()
    with (tmp_path / "api.log").open("w") as log:
        proc = start_api_server(model, port, kv, log, new_session=True)
    mapped: set[str] = set()
    left: list[str] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base)
        complete(base, prompt_text(300))  # the pool is in use: blocks go through it to memkv
        mapped = shm_mappings(group_pids(proc.pid))
        pools = {m.removesuffix(DELETED) for m in mapped
                 if Path(m.removesuffix(DELETED)).name.startswith("vllm_offload_")}
        assert len(pools) == 1, sorted(mapped)
        pool = pools.pop()
        # Serving: the pool is mapped, and its name is already gone (so no exit path can leak it).
        assert pool + DELETED in mapped, sorted(mapped)
        assert not Path(pool).exists()
        deadline = time.monotonic() + 60
        while server.stats()["puts"] == before:  # stores are asynchronous
            assert time.monotonic() < deadline, "no block reached memkv through the nameless pool"
            time.sleep(0.2)
        stop_group(proc, signal.SIGTERM if stop == "SIGTERM" else signal.SIGKILL)
    finally:
        kill_group_left(proc)
        # What this engine leaves (its pool's name, and the named files its processes mapped)
        # is listed, then removed whatever the outcome: the test must not leak it either.
        named = {m for m in mapped if not m.endswith(DELETED)} | ({pool} if pool else set())
        left = sorted(p for p in named if Path(p).exists())
        for p in left:
            Path(p).unlink(missing_ok=True)
        # The executor queues its killed processes left (a SIGKILL of the group) are this
        # test's too; other engines' are not.
        remove_orphaned_queues(queues_before, time.time())
    assert pool not in left, "the CPU pool was left in /dev/shm"
    if stop == "SIGTERM":
        assert left == [], f"left in /dev/shm after SIGTERM: {left}"
    else:
        # vLLM's executor queues, which nothing survives to remove after a SIGKILL of the group.
        assert all(Path(p).name.startswith(("psm_", "sem.")) for p in left), left
