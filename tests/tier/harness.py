"""Harness for the memkv tier, wired the way vLLM's own tiering tests wire tiers.

vLLM's tests/v1/kv_offload/tiering/test_tiering_offloading.py builds a real
CPUPrimaryTierOffloadingManager over a memoryview pool, real secondary tiers and a real
TieringOffloadingManager, then simulates scheduler steps with on_schedule_end(). We do the same,
with the memkv tier created through vLLM's SecondaryTierFactory (so registration and the kwargs
vLLM passes, e.g. backpressure_detector on 0.31+, are exercised) and a real memkv server behind it.

Also here: `FreezableProxy`, a real TCP forwarder in front of the server whose forwarding can be
paused, to make a live server look hung (probe deadlines, load timeouts) without mocks.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

import memkv_vllm  # noqa: E402
from memkv_vllm.vllm.compat import api  # noqa: E402

ROW = 8192  # bytes per pool row (one offloaded chunk, all workers); page-aligned like vLLM's


class ArrayRegion:
    """Stands in for SharedOffloadRegion: the primary tier only asks it for the pool view."""

    def __init__(self, num_chunks: int, row: int = ROW) -> None:
        self.arr = np.zeros((num_chunks, row), dtype=np.int8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.arr)

    def cleanup(self) -> None:
        pass


class SpecStandIn:
    """What a tier may read from the spec; not a vLLM spec, so the tier namespaces by prefix,
    value size and hash seed (real specs are covered by the end-to-end tests)."""

    extra_config: dict[str, Any] = {}


class Engine:
    """One simulated engine: primary pool + memkv tier + TieringOffloadingManager."""

    _req_ids = itertools.count()

    def __init__(self, tier_config: dict[str, Any], num_chunks: int = 16) -> None:
        self.region = ArrayRegion(num_chunks)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks, self.region)
        self.pool = self.region.arr
        self.tier = SecondaryTierFactory.create_secondary_tier(
            dict(tier_config), self.primary.get_kv_memoryview(), SpecStandIn()
        )
        self.manager = TieringOffloadingManager(self.primary, [self.tier])

    def ctx(self) -> ReqContext:
        return ReqContext(req_id=f"req-{next(self._req_ids)}")

    def step(self) -> None:
        self.manager.on_schedule_end(api().schedule_end_context())

    def store(self, keys: list[bytes], fill: Callable[[int, int], None]) -> None:
        """GPU->CPU store as the connector drives it: prepare, 'copy' into the slots, complete.
        complete_store cascades the rows to every secondary tier."""
        ctx = self.ctx()
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for i, slot in enumerate(api().pool_slots(out.store_spec)):
            fill(i, slot)
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)

    def lookup(self, key: bytes, ctx: ReqContext) -> Any:
        return self.manager.lookup(key, ctx)

    def run_until(self, cond: Callable[[], bool], timeout: float = 10.0) -> float:
        """Step until `cond()`; returns the seconds it took. Fails the test on timeout."""
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"condition not reached in {timeout}s")
            self.step()
            time.sleep(0.01)
        return time.monotonic() - t0

    def drain(self) -> None:
        """Wait for all tier jobs and let the manager consume their results."""
        self.tier.drain_jobs()
        self.run_until(lambda: not self.tier.has_pending_work())
        self.step()

    def shutdown(self) -> None:
        self.manager.shutdown()


def okey(i: int, group: int = 0) -> bytes:
    return api().make_offload_key(i.to_bytes(32, "big"), group)


def pattern(key_index: int) -> np.ndarray:
    """Deterministic, key-specific row content (so a wrong row is detected)."""
    rng = np.random.default_rng(key_index)
    return rng.integers(-128, 127, size=ROW, dtype=np.int8)


@pytest.fixture(autouse=True, scope="session")
def _vllm_ready() -> None:
    memkv_vllm.register()  # what vLLM's plugin loader does in every process
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        # EngineCore does this after building the scheduler; tiers read it lazily.
        from vllm.utils.hashing import sha256

        kv_cache_utils.init_none_hash(sha256)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(tier_config: dict[str, Any], num_chunks: int = 16) -> Engine:
        e = Engine({"type": "memkv", **tier_config}, num_chunks)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


class FreezableProxy:
    """TCP forwarder to a real server; `freeze()` holds all bytes in both directions."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._up = (host, int(port))
        self._ls = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._ls.getsockname()[1]}"
        self._frozen = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def _accept(self) -> None:
        self._ls.settimeout(0.2)
        while not self._stop.is_set():
            try:
                c, _ = self._ls.accept()
            except OSError:
                continue
            u = socket.create_connection(self._up)
            self._socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        while not self._stop.is_set():
            if self._frozen.is_set():
                time.sleep(0.01)
                continue
            r, _, _ = select.select([a, b], [], [], 0.05)
            for s in r:
                try:
                    data = s.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    a.close()
                    b.close()
                    return
                peers[s].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._ls.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def proxy() -> Iterator[Callable[[str], FreezableProxy]]:
    made: list[FreezableProxy] = []

    def make(upstream: str) -> FreezableProxy:
        p = FreezableProxy(upstream)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
