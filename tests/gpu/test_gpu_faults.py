"""A GPU engine in direct mode through the recompute connector, when its memkv server dies or
freezes: it lives and answers exactly as the engine that computed the prompts cold.

Engine A (tests/e2e/direct_fault_engine.py) serves the prompts cold and stores their blocks in
one server. Engine B, a new process, serves them again: one whose values it loads (the control),
one while the server is frozen (SIGSTOP) and one while it is killed (SIGKILL), each at the moment
B's worker starts the loads, after the scheduler's lookups found the values (the hook in
tests/e2e/fault_connector.py), then one after the server's death. The frozen and killed loads
must reach vLLM as load errors of every block, once: vLLM's kv_load_failure_policy "recompute"
recovered them.
"""

from __future__ import annotations

import os
import signal

import pytest
from engines import BLOCK, PROMPT_BLOCKS
from fault_procs import run_fault_engine
from memkv_procs import MemKVServer

pytestmark = pytest.mark.gpu

PREFIX_TOKENS = PROMPT_BLOCKS * BLOCK  # direct_fault_engine.py's 600-token prompts: 4 full blocks
# case -> prompt seeds. After the freeze, B's client leaves the server alone for a backoff and
# its lookups miss: the killed case tries spare prompts until its loads start.
PROMPTS = {"hit": [2], "frozen": [3], "killed": list(range(4, 12)), "dead": [12]}
N_VALUES = sum(len(s) for s in PROMPTS.values()) * PROMPT_BLOCKS
FAULTS = {"frozen": "SIGSTOP", "killed": "SIGKILL"}


@pytest.fixture(scope="module")
def cluster(gpu_model, engine_args, tmp_path_factory):
    server = MemKVServer(memory="64M", lanes=1).start()
    work = tmp_path_factory.mktemp("gpu-faults")
    try:
        cases = [{"name": n, "seeds": s} for n, s in PROMPTS.items()]
        a = run_fault_engine(gpu_model, server.address, work, "a", cases, llm_args=engine_args,
                             final_items=N_VALUES)
        assert server.stats()["items"] == N_VALUES
        cold = {r["seed"]: r for runs in a["cases"].values() for r in runs}
        assert all(r["num_cached_tokens"] == 0 for r in cold.values())
        cases = [{"name": n, "seeds": s, "fault": FAULTS.get(n)} for n, s in PROMPTS.items()]
        assert server.proc is not None and server.alive(), server.log()
        b = run_fault_engine(gpu_model, server.address, work, "b", cases,
                             server_pid=server.proc.pid, llm_args=engine_args)
        yield {"server": server, "cold": cold, "b": b["cases"]}
    finally:
        if server.alive():
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()


def same_as_cold(result: dict, cluster: dict) -> None:
    cold = cluster["cold"][result["seed"]]
    assert result["tokens"] == cold["tokens"]
    assert result["logprobs"] == cold["logprobs"]


def test_values_that_are_there_are_loaded(cluster) -> None:
    (b,) = cluster["b"]["hit"]
    assert b["num_cached_tokens"] == PREFIX_TOKENS, cluster["server"].log()[-3000:]
    assert b["load_errors"] == []
    same_as_cold(b, cluster)


@pytest.mark.parametrize("case", ["frozen", "killed"])
def test_a_load_that_fails_after_its_lookup_is_recomputed(cluster, case) -> None:
    runs = cluster["b"][case]
    for b in runs:
        same_as_cold(b, cluster)
    assert runs[-1]["fired"], "the fault hook never saw this case's loads start"
    assert [len(e) for e in runs[-1]["load_errors"]] == [PROMPT_BLOCKS]


def test_after_the_server_died_the_engine_recomputes(cluster) -> None:
    assert not cluster["server"].alive()
    (b,) = cluster["b"]["dead"]
    assert b["num_cached_tokens"] == 0 and b["load_errors"] == []
    same_as_cold(b, cluster)
