"""The memkv tier under a real TieringOffloadingManager, against a real memkv server."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from harness import ROW, okey, pattern
from test_tenants import KEY_A, KEY_B, tenant_server
from tls_certs import Pki
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

import memkv_vllm
from memkv_vllm.core.config import ConfigError
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.metrics import METRICS
from memkv_vllm.vllm.tier import MemKVSecondaryTierManager

LR = api().LookupResult


def _cfg(address: str, **kw) -> dict:
    # A fresh prefix per test: tests share nothing through the server by accident.
    return {"servers": [address], "prefix": f"test-{uuid.uuid4().hex[:8]}", **kw}


def _client(address: str):
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    return MemKVClient.from_config(load_config({"servers": [address]}))


def _fill(engine):
    return lambda i, slot: engine.pool.__setitem__(slot, pattern(i))


def _harvest_hits(b, keys, ctx, n: int, timeout: float = 5.0) -> None:
    """Call lookups (without ending the step) until the tier has answered `n` probe hits; the
    manager then has the promotions queued for the next step."""
    t0 = time.monotonic()
    while b.tier.store_stats().get("lookup_hit", 0) < n:
        assert time.monotonic() - t0 < timeout, "probe not answered"
        for k in keys:
            b.lookup(k, ctx)
        time.sleep(0.01)


def _load_into_primary(b, keys, ctx, timeout=10.0) -> float:
    """Look keys up the way the scheduler does each step until all are HIT in B's CPU pool."""
    return b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.HIT] * len(keys), timeout)


def _rows_of(b, keys, ctx) -> list[np.ndarray]:
    slots = api().pool_slots(b.manager.prepare_load(keys, ctx))
    rows = [b.pool[s].copy() for s in slots]
    b.manager.complete_load(keys, ctx)
    return rows


def test_register_is_idempotent_and_names_the_tier() -> None:
    memkv_vllm.register()
    memkv_vllm.register()
    assert SecondaryTierFactory.get_tier_class({"type": "memkv"}) is MemKVSecondaryTierManager


def test_register_without_vllm_does_nothing() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"  # makes `import vllm...` fail
            "import memkv_vllm; memkv_vllm.register(); memkv_vllm.register(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_blocks_stored_by_one_engine_are_loaded_by_another(memkv_server, engines) -> None:
    cfg = _cfg(memkv_server.address)
    a = engines(cfg)
    keys = [okey(i) for i in range(6)]
    a.store(keys, _fill(a))
    a.drain()
    assert a.tier.store_stats()["store_blocks_ok"] == 6

    b = engines(cfg)  # a new engine: empty CPU pool, same model/layout/prefix
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    # Unknown to B until a probe answers: the request is deferred, not failed.
    assert b.lookup(keys[0], ctx) is LR.RETRY
    _load_into_primary(b, keys, ctx)
    rows = _rows_of(b, keys, ctx)
    for i, row in enumerate(rows):
        assert np.array_equal(row, pattern(i)), f"row {i} differs after the round trip"
    st = b.tier.store_stats()
    assert st["load_blocks_ok"] == 6 and st["load_bytes"] == 6 * ROW
    # One batched exists probe and one load job for the whole prefix, not one per key.
    assert st["probes"] == 1 and st["load_jobs"] == 1


def test_unknown_keys_miss_after_one_probe(memkv_server, engines) -> None:
    b = engines(_cfg(memkv_server.address))
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    keys = [okey(100 + i) for i in range(3)]
    assert [b.lookup(k, ctx) for k in keys] == [LR.RETRY] * 3  # pending
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.MISS] * 3, timeout=5)
    assert b.tier.store_stats()["probes"] == 1


def test_same_blocks_under_another_prefix_are_invisible(memkv_server, engines) -> None:
    a = engines(_cfg(memkv_server.address))
    keys = [okey(7)]
    a.store(keys, _fill(a))
    a.drain()
    b = engines(_cfg(memkv_server.address))  # another prefix = another namespace
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    b.run_until(lambda: b.lookup(keys[0], ctx) is LR.MISS, timeout=5)


def test_unanswered_probe_becomes_a_miss_at_the_deadline(memkv_server, engines, proxy) -> None:
    p = proxy(memkv_server.address)
    b = engines(_cfg(p.address, lookup_timeout_s=0.5, op_timeout_s=3.0))
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    p.freeze()  # the server is alive but nothing gets through: a hung cluster
    key = okey(200)
    assert b.lookup(key, ctx) is LR.RETRY
    t0 = time.monotonic()
    b.run_until(lambda: b.lookup(key, ctx) is LR.MISS, timeout=5)
    waited = time.monotonic() - t0
    assert 0.4 <= waited < 2.0, waited
    assert b.tier.store_stats()["lookup_timeouts"] == 1


def test_evicted_between_lookup_and_load_frees_slots_and_stays_a_miss(memkv_server,
                                                                      engines) -> None:
    cfg = _cfg(memkv_server.address)
    a = engines(cfg)
    keys = [okey(300 + i) for i in range(4)]
    a.store(keys, _fill(a))
    a.drain()

    b = engines(cfg)
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    for k in keys:
        assert b.lookup(k, ctx) is LR.RETRY
    b.step()  # probe sent
    _harvest_hits(b, keys, ctx, 4)
    # ... and the values vanish before the load runs (eviction, another engine's delete).
    c = _client(memkv_server.address)
    try:
        c.delete([b.tier.remote_key(k) for k in keys[2:]])
    finally:
        c.close()
    # Keys 0,1 load; 2,3 fail: their slots are freed and they read as misses from now on.
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.HIT, LR.HIT, LR.MISS, LR.MISS])
    loads = b.tier.store_stats()["load_jobs"]
    for _ in range(20):  # no re-promotion loop for the failed keys
        assert [b.lookup(k, ctx) for k in keys[2:]] == [LR.MISS, LR.MISS]
        b.step()
    assert b.tier.store_stats()["load_jobs"] == loads
    rows = _rows_of(b, keys[:2], ctx)
    assert all(np.array_equal(r, pattern(i)) for i, r in enumerate(rows))


def test_stores_beyond_the_backlog_are_shed_and_loads_never(memkv_server, engines) -> None:
    cfg = _cfg(memkv_server.address)
    cap_mb = 1.5 * ROW / (1 << 20)  # room for one row, not two
    a = engines({**cfg, "max_store_backlog_mb": cap_mb})
    a.store([okey(500), okey(501)], _fill(a))  # one job of two rows: over the cap -> shed
    a.store([okey(502)], _fill(a))  # one row: fits (content pattern(0): first of its job)
    a.drain()
    st = a.tier.store_stats()
    assert st["store_blocks_shed"] == 2 and st["store_jobs_shed"] == 1
    assert st["store_blocks_ok"] == 1

    b = engines({**cfg, "max_store_backlog_mb": cap_mb})
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    miss, hit = [okey(500), okey(501)], [okey(502)]
    b.run_until(lambda: [b.lookup(k, ctx) for k in miss] == [LR.MISS, LR.MISS], timeout=5)
    _load_into_primary(b, hit, ctx)  # loads are not subject to the store backlog
    assert np.array_equal(_rows_of(b, hit, ctx)[0], pattern(0))


def test_server_down_is_a_miss_and_a_failed_store_never_an_error(memkv_server, engines) -> None:
    cfg = _cfg(memkv_server.address, op_timeout_s=2.0)
    a = engines(cfg)
    memkv_server.kill()
    keys = [okey(600), okey(601)]
    a.store(keys, _fill(a))
    a.drain()  # the cascade job completes (failed) instead of hanging
    assert a.tier.store_stats()["store_blocks_failed"] == 2
    ctx = a.ctx()
    a.manager.on_new_request(ctx)
    other = okey(602)
    assert a.lookup(other, ctx) is LR.RETRY
    a.run_until(lambda: a.lookup(other, ctx) is LR.MISS, timeout=5)


def test_metrics_are_declared_and_reported(memkv_server, engines) -> None:
    cfg = _cfg(memkv_server.address)
    defs = api().tiering_spec_class().build_metric_definitions(
        {"secondary_tiers": [{"type": "memkv", **cfg}]})
    for m in METRICS.values():
        assert m.name in defs and tuple(defs[m.name].labelnames) == m.labels

    a = engines(cfg)
    keys = [okey(700), okey(701)]
    a.store(keys, _fill(a))
    a.drain()
    b = engines(cfg)
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    _load_into_primary(b, keys, ctx)
    reduced: dict = {}
    for eng in (a, b):
        stats = eng.manager.get_stats()
        assert stats is not None
        for name, label_values in stats.data["data"].items():
            if name.startswith("vllm:kv_offload_memkv_"):
                assert name in defs
                for lv, v in label_values.items():
                    assert len(lv) == len(defs[name].labelnames)
                    reduced[(name, lv)] = reduced.get((name, lv), 0) + v
    blocks = METRICS["blocks"].name
    assert reduced[(blocks, ("store", "ok"))] == 2
    assert reduced[(blocks, ("load", "ok"))] == 2
    assert reduced[(METRICS["bytes"].name, ("load",))] == 2 * ROW
    assert reduced[(METRICS["lookups"].name, ("hit",))] >= 2
    # Counters are deltas: a second call without new activity reports no new blocks.
    again = b.tier.get_stats()
    assert again is None or blocks not in again.data["data"]


def test_blocks_evicted_by_memory_pressure_read_as_misses(memkv_server_factory, engines) -> None:
    server = memkv_server_factory(memory="4M", lanes=1)
    cfg = _cfg(server.address)
    a = engines(cfg)
    keys = [okey(800 + i) for i in range(4)]
    a.store(keys, _fill(a))
    a.drain()
    assert server.stats()["items"] == 4
    # Other engines' traffic pushes the server past its memory: these blocks get evicted.
    c = _client(server.address)
    try:
        filler = np.ones(ROW, dtype=np.int8)
        for i in range(0, 2048, 64):
            c.put([f"filler/{j}".encode() for j in range(i, i + 64)], [filler] * 64)
    finally:
        c.close()
    assert server.stats()["evictions"] > 0
    b = engines(cfg)
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.MISS] * 4, timeout=5)
    assert b.tier.store_stats().get("load_jobs", 0) == 0  # nothing to promote: recompute


def test_tenants_share_blocks_within_and_never_across_and_a_foreign_prefix_stops_startup(
        memkv_server_factory, engines, tmp_path) -> None:
    """Against a server with tenants only the credentials change: engines of one tenant share
    blocks, an engine of another tenant with the same model and blocks gets no hit, and a tier
    `prefix` outside the tenant's namespace stops the engine at startup naming both."""
    srv = tenant_server(memkv_server_factory, tmp_path)
    with pytest.raises(ConfigError) as e:
        engines({"servers": [srv.address], "auth_key": KEY_A, "prefix": "memkv"})
    assert "b'memkv/" in str(e.value) and "b'a/'" in str(e.value), e.value
    a = engines({"servers": [srv.address], "auth_key": KEY_A, "prefix": "a"})
    keys = [okey(i) for i in range(4)]
    a.store(keys, _fill(a))
    a.drain()
    assert a.tier.store_stats()["store_blocks_ok"] == 4
    a2 = engines({"servers": [srv.address], "auth_key": KEY_A, "prefix": "a"})
    ctx = a2.ctx()
    a2.manager.on_new_request(ctx)
    _load_into_primary(a2, keys, ctx)
    assert all(np.array_equal(r, pattern(i)) for i, r in enumerate(_rows_of(a2, keys, ctx)))
    b = engines({"servers": [srv.address], "auth_key": KEY_B, "prefix": "b"})
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.MISS] * 4, timeout=5)


def test_engines_share_blocks_over_mutual_tls_set_in_the_tier_config(
        memkv_server_factory, engines, tmp_path) -> None:
    """The tier's `tls:` section reaches the client (docs/tls.md); an engine without the client
    certificate gets misses, never an error."""
    pki = Pki(tmp_path)
    server = memkv_server_factory(extra=pki.server_flags(client_ca=pki))
    cert, key = pki.issue("engine", "engine-a", sans=())
    cfg = _cfg(server.address, tls={"ca": str(pki.ca), "cert": str(cert), "key": str(key)})
    a = engines(cfg)
    keys = [okey(900 + i) for i in range(3)]
    a.store(keys, _fill(a))
    a.drain()
    assert a.tier.store_stats()["store_blocks_ok"] == 3
    b = engines(cfg)
    ctx = b.ctx()
    b.manager.on_new_request(ctx)
    _load_into_primary(b, keys, ctx)
    for i, row in enumerate(_rows_of(b, keys, ctx)):
        assert np.array_equal(row, pattern(i))
    stranger = engines({**cfg, "tls": {"ca": str(pki.ca)}})
    ctx = stranger.ctx()
    stranger.manager.on_new_request(ctx)
    stranger.run_until(lambda: stranger.lookup(keys[0], ctx) is LR.MISS, timeout=5)
