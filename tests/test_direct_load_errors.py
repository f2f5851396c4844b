"""After a failed load, direct mode's manager stops answering HIT for the chunks that were loading.

In direct mode the workers load and the scheduler looks up, each through its own store, so a
load that fails on a worker leaves the scheduler's verdict cache saying HIT. The recompute
connector then calls the manager's `on_load_errors()` (`LoadErrorListener`,
memkv_vllm.connector); without it, the recomputed request's next lookup finds the same chunks,
loads them and fails again, for as long as the cached HIT lasts (tests/e2e/test_direct_faults.py
saw that loop with a frozen server).
Real server; the verdicts come from real probes.
"""

from __future__ import annotations

import time

from memkv_vllm.core.backends import store_for
from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import load_config
from memkv_vllm.core.interface import DirectOffloader, Lookup
from memkv_vllm.direct.manager import DirectManager

PREFIX = b"p" * 20


def split(key: bytes) -> tuple[bytes, int]:
    return key, 0


def settled(store: DirectOffloader, manager: DirectManager, key: bytes) -> Lookup:
    """The manager's answer for `key` once the store's probe came back."""
    deadline = time.monotonic() + 10
    while (v := manager.lookup(key, "req")) is Lookup.PENDING:
        assert time.monotonic() < deadline, "probe never answered"
        manager.on_schedule_end()
        time.sleep(0.01)
    return v


def test_on_load_errors_turns_the_loading_chunks_into_misses(memkv_server) -> None:
    cfg = load_config({"servers": memkv_server.address})
    client = MemKVClient.from_config(cfg)
    store = store_for(client, cfg, hit_ttl_s=60.0)
    manager = DirectManager(store, PREFIX, 1, split)
    try:
        loading, other = b"h" * 32, b"o" * 32
        client.put([manager.remote_keys(k)[0] for k in (loading, other)], [b"v" * 64] * 2)
        assert settled(store, manager, loading) is Lookup.HIT
        assert settled(store, manager, other) is Lookup.HIT
        manager.prepare_load([loading])

        manager.on_load_errors()
        manager.complete_load([loading])

        assert manager.lookup(loading, "req") is Lookup.MISS  # no reload of what just failed
        assert manager.lookup(other, "req") is Lookup.HIT  # not loading: untouched
    finally:
        store.close()
        client.close()
