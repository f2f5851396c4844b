"""Conformance: the memkv tier keeps the promises vLLM's own secondary tiers keep.

Written from the contract vLLM documents for a secondary tier (`SecondaryTierManager` in
vllm/v1/kv_offload/tiering/base.py) and from what its fs and obj tiers do for their users, and
driven the way vLLM drives any tier: a real `TieringOffloadingManager` over a real CPU pool, the
tier created by `SecondaryTierFactory` (through a real `TieringOffloadingSpec` where this vLLM
builds specs from an `OffloadingConfig`), a real `memkv serve` behind it. Scheduler steps are
simulated with `on_schedule_end`, as vLLM's own tiering tests do.

Features that only newer vLLM has (tier media and locality, per-request load-tier filters, KV
events from tiers, cache-hit sources) are tested where the installed vLLM has them and skipped,
with the reason, where it does not.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import numpy as np
import pytest
from harness import ROW, Engine, okey, pattern
from specs import SpecEngine
from vllm.v1.kv_offload import base as kvb
from vllm.v1.kv_offload.base import LookupResult as LR
from vllm.v1.kv_offload.tiering import base as tb
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from memkv_vllm.vllm.tier import MemKVSecondaryTierManager

needs_media = pytest.mark.skipif(
    not hasattr(kvb, "Medium"), reason="tier media and load-tier filters exist from vLLM 0.27 on")
needs_locality = pytest.mark.skipif(
    not hasattr(kvb, "Locality"), reason="tier locality exists from vLLM 0.26 on")
needs_tier_events = pytest.mark.skipif(
    "take_events" not in vars(tb.SecondaryTierManager),
    reason="secondary tiers publish KV events from vLLM 0.26 on")


def _cfg(address: str, **kw: Any) -> dict[str, Any]:
    # A fresh prefix per test: tests share nothing through the server by accident.
    return {"type": "memkv", "servers": [address], "prefix": f"conf-{uuid.uuid4().hex[:8]}",
            **kw}


@pytest.fixture
def spec_engines():
    """Engines built by a real TieringOffloadingSpec; shut down after the test."""
    made: list[SpecEngine] = []

    def make(tier_config: dict[str, Any], **spec_kw: Any) -> SpecEngine:
        e = SpecEngine(tier_config, **spec_kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def _client(address: str):
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    return MemKVClient.from_config(load_config({"servers": [address]}))


def _fill(engine: Engine, offset: int = 0):
    return lambda i, slot: engine.pool.__setitem__(slot, pattern(offset + i))


def _ctx(engine: Engine, **kw: Any) -> Any:
    ctx = kvb.ReqContext(req_id=f"conf-{uuid.uuid4().hex[:8]}", **kw)
    engine.manager.on_new_request(ctx)
    return ctx


def _slots(spec: Any) -> list[int]:
    ids = getattr(spec, "chunk_ids", None)
    return [int(s) for s in (spec.block_ids if ids is None else ids)]


def _load_all(engine: Engine, keys: list[bytes], ctx: Any, timeout: float = 10.0) -> None:
    """Look keys up the way the scheduler does, step after step, until all are HIT."""
    engine.run_until(lambda: [engine.lookup(k, ctx) for k in keys] == [LR.HIT] * len(keys),
                     timeout)


def _rows(engine: Engine, keys: list[bytes], ctx: Any) -> list[np.ndarray]:
    spec = engine.manager.prepare_load(keys, ctx)
    rows = [engine.pool[s].copy() for s in _slots(spec)]
    engine.manager.complete_load(keys, ctx)
    return rows


def _harvest_hits(engine: Engine, keys: list[bytes], ctx: Any, timeout: float = 5.0) -> None:
    """After the probe for `keys` went out: look them up (without ending the step) until the tier
    has answered HIT for all; the manager then has their promotions queued for the next step."""
    deadline = time.monotonic() + timeout
    while engine.tier.store_stats().get("lookup_hit", 0) < len(keys):
        assert time.monotonic() < deadline, "probe not answered"
        for k in keys:
            engine.lookup(k, ctx)
        time.sleep(0.01)


def _store(engine: Engine, keys: list[bytes], offset: int = 0) -> None:
    engine.store(keys, _fill(engine, offset))
    engine.drain()


def _stored_remotely(address: str, rkeys: list[bytes]) -> list[bool]:
    from memkv_vllm.core.client import Status

    c = _client(address)
    try:
        return [Status.is_ok(s) for s in c.exists(rkeys)]
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# The job contract: every job reported exactly once; drain leaves every result available.


def test_every_job_is_reported_once_and_the_manager_ends_idle(memkv_server, engines) -> None:
    cfg = _cfg(memkv_server.address)
    a = engines(cfg)
    keys = [okey(10 + i) for i in range(5)]
    _store(a, keys)
    b = engines(cfg)
    ctx = _ctx(b)
    _load_all(b, keys[:3], ctx)
    # A duplicate or unknown job id would have tripped the manager's own assertions; a missing
    # one would leave the manager with work it can never finish.
    b.run_until(lambda: not b.manager.has_pending_work())
    assert not b.tier.has_pending_work()


def test_reset_cache_right_after_stores_waits_for_them(memkv_server, engines) -> None:
    a = engines(_cfg(memkv_server.address))
    keys = [okey(20 + i) for i in range(6)]
    a.store(keys, _fill(a))  # cascade jobs submitted, not yet finished
    a.manager.reset_cache()  # drains the tier, consumes every result, resets the pool
    assert not a.manager.has_pending_work()
    assert a.tier.store_stats()["store_blocks_ok"] == 6


def _load_into_a_hung_server(address: str, engines: Any, proxy: Any,
                             key: int) -> tuple[Engine, list[bytes], Any]:
    """Engine A stores a block; engine B finds it, then the server hangs (a frozen proxy: alive
    but silent) just as B's promotion of it is submitted, with a 0.5 s client op timeout."""
    cfg = _cfg(address)
    a = engines(cfg)
    keys = [okey(key)]
    _store(a, keys)
    p = proxy(address)
    b = engines({**cfg, "servers": [p.address], "op_timeout_s": 0.5})
    ctx = _ctx(b)
    assert b.lookup(keys[0], ctx) is LR.RETRY
    b.step()  # probe sent (through the still-working proxy)
    _harvest_hits(b, keys, ctx)
    p.freeze()  # the load request goes out and its answer never comes back
    b.step()  # submits the promotion
    assert b.tier.store_stats().get("load_jobs", 0) == 1
    return b, keys, ctx


def test_reset_cache_during_a_load_that_times_out(memkv_server, engines, proxy) -> None:
    """Issue point 1: `drain_jobs()` must leave every result available when it returns, or vLLM's
    `reset_cache` (prefix-cache reset, sleep, weight update) fails on its `assert not
    self._jobs` (0.32) or leaves a load that completes into a reset pool (earlier versions)."""
    b, keys, ctx = _load_into_a_hung_server(memkv_server.address, engines, proxy, 30)
    b.manager.reset_cache()  # blocks until the load has timed out, then must be consistent
    assert not b.manager.has_pending_work()
    assert not b.tier.has_pending_work()
    # The failed key is a miss now (no re-promotion loop), and the pool is usable.
    assert b.lookup(keys[0], ctx) is LR.MISS


def test_a_timed_out_load_frees_its_slot_when_its_call_returned(memkv_server, engines,
                                                                 proxy) -> None:
    # The client writes nothing after a call returned, so nothing is held back for a late write.
    b, keys, ctx = _load_into_a_hung_server(memkv_server.address, engines, proxy, 35)
    waited = b.run_until(lambda: b.lookup(keys[0], ctx) is LR.MISS, timeout=5)
    assert waited < 3.0, waited
    assert b.tier.store_stats()["load_blocks_failed"] == 1


def test_shutdown_lets_vllm_unmap_the_pool(memkv_server, spec_engines, caplog) -> None:
    """vLLM closes the CPU pool's mapping after the tiers shut down; a tier still holding an
    export of the pool makes that fail (and keeps the memory mapped)."""
    a = spec_engines(_cfg(memkv_server.address))
    _store(a, [okey(36)])
    caplog.clear()
    a.shutdown()
    assert "Failed to close mmap_obj" not in caplog.text


# ---------------------------------------------------------------------------------------------
# Medium, locality and per-request load-tier filters (issue point 2 and the locality of point 5).


def _stored_then_filtered(address: str, engines: Any, matcher: dict[str, str],
                          first: int) -> tuple[Engine, list[bytes], Any]:
    """Engine A stores two blocks; engine B gets a request whose kv_load_tiers filter is
    `matcher` (as vLLM's scheduler parses it from kv_transfer_params)."""
    cfg = _cfg(address)
    a = engines(cfg)
    keys = [okey(first + i) for i in range(2)]
    _store(a, keys)
    b = engines(cfg)
    tier_filter = kvb.TierFilter(matchers=(kvb.TierMatcher(
        medium=kvb.Medium(matcher["medium"]) if "medium" in matcher else None,
        locality=kvb.Locality(matcher["locality"]) if "locality" in matcher else None),))
    return b, keys, _ctx(b, load_tier_filter=tier_filter)


@needs_media
def test_the_tier_declares_its_medium_and_locality(memkv_server, engines) -> None:
    e = engines(_cfg(memkv_server.address))
    # memkv keeps values in (remote) DRAM: medium CPU, locality REMOTE unless configured.
    assert type(e.tier).medium is kvb.Medium.CPU
    assert e.tier.locality is kvb.Locality.REMOTE


@needs_media
@pytest.mark.parametrize("matcher", [{"medium": "STORAGE"}, {"locality": "LOCAL"},
                                     {"medium": "CPU", "locality": "LOCAL"}])
def test_a_load_tier_filter_that_excludes_memkv_is_honoured(memkv_server, engines,
                                                            matcher) -> None:
    b, keys, ctx = _stored_then_filtered(memkv_server.address, engines, matcher, 40)
    for _ in range(5):
        assert [b.lookup(k, ctx) for k in keys] == [LR.MISS, LR.MISS]
        b.step()
    st = b.tier.store_stats()
    assert st.get("probes", 0) == 0 and st.get("load_jobs", 0) == 0  # memkv was never asked


@needs_media
@pytest.mark.parametrize("matcher", [{"medium": "CPU"}, {"locality": "REMOTE"},
                                     {"medium": "CPU", "locality": "REMOTE"}])
def test_a_load_tier_filter_that_names_memkv_loads_from_it(memkv_server, engines,
                                                           matcher) -> None:
    b, keys, ctx = _stored_then_filtered(memkv_server.address, engines, matcher, 50)
    _load_all(b, keys, ctx)
    assert [np.array_equal(r, pattern(i)) for i, r in enumerate(_rows(b, keys, ctx))] == [True] * 2


@pytest.mark.skipif(not hasattr(tb.SecondaryTierManager, "cache_hit_source"),
                    reason="hit provenance (CacheHitSource) exists from vLLM 0.32 on")
def test_hits_from_memkv_are_attributed_to_it(memkv_server, engines) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    cfg = _cfg(memkv_server.address)
    a = engines(cfg)
    keys = [okey(60)]
    _store(a, keys)
    b = engines(cfg)
    # A remote store's blocks: vLLM's class for them (not HOST, which the CPU medium would give:
    # this engine's own pool), and what vLLM's own tier tests expect of a tier it does not ship.
    assert MemKVSecondaryTierManager.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
    ctx = _ctx(b)
    _load_all(b, keys, ctx)
    assert b.manager.get_load_source(keys[0], ctx) is CacheHitSource.EXTERNAL_UNSPECIFIED


@needs_locality
@pytest.mark.parametrize("value", ["local", "Remote", "nearby", ""])
def test_a_locality_vllm_does_not_know_is_refused(memkv_server, engines, value) -> None:
    # vLLM's fs and obj tiers take `Locality(value)`: exactly "LOCAL" or "REMOTE".
    with pytest.raises(ValueError, match="(?i)locality"):
        engines(_cfg(memkv_server.address, locality=value))


@needs_locality
@pytest.mark.parametrize("value", ["LOCAL", "REMOTE"])
def test_a_valid_locality_is_the_tiers_locality(memkv_server, engines, value) -> None:
    e = engines(_cfg(memkv_server.address, locality=value))
    assert e.tier.locality is kvb.Locality(value)


# ---------------------------------------------------------------------------------------------
# KV events (issue point 3).


def _tier_events(engine: Engine) -> list[Any]:
    return [ev for ev in engine.manager.take_events() if ev.locality is not None]


@needs_tier_events
def test_blocks_stored_in_memkv_are_announced(memkv_server, spec_engines, caplog) -> None:
    cfg = _cfg(memkv_server.address, enable_kv_events=True)
    a = spec_engines(cfg, kv_events=True)
    assert "enable_kv_events" not in caplog.text  # a known key, not "ignored"
    keys = [okey(70 + i) for i in range(3)]
    _store(a, keys)
    events = _tier_events(a)
    stored = [k for ev in events if not ev.removed for k in ev.keys]
    assert sorted(stored) == sorted(keys)
    # STORAGE, not the CPU of the engine's own pool (docs/tier.md); 0.26 names media by string
    medium = kvb.Medium.STORAGE if hasattr(kvb, "Medium") else "STORAGE"
    for ev in events:
        assert ev.medium == medium and ev.locality is kvb.Locality.REMOTE
        assert getattr(ev, "ownership", "memkv") == "memkv"  # 0.32+: which tier announced it
    assert list(a.manager.take_events()) == []  # each event once


@needs_tier_events
def test_a_block_that_left_the_cluster_is_announced_as_removed(memkv_server,
                                                               spec_engines) -> None:
    cfg = _cfg(memkv_server.address, enable_kv_events=True)
    a = spec_engines(cfg, kv_events=True)
    keys = [okey(80 + i) for i in range(3)]
    _store(a, keys)
    b = spec_engines(cfg, kv_events=True)
    ctx = _ctx(b)
    for k in keys:
        assert b.lookup(k, ctx) is LR.RETRY
    b.step()  # probe sent
    _harvest_hits(b, keys, ctx)
    c = _client(memkv_server.address)
    try:  # evicted (or deleted by another engine) between the lookup and the load
        c.delete([b.tier.remote_key(keys[2])])
    finally:
        c.close()
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.HIT, LR.HIT, LR.MISS])
    removed = [k for ev in _tier_events(b) if ev.removed for k in ev.keys]
    assert removed == [keys[2]]


@needs_tier_events
def test_no_events_when_vllm_has_kv_events_off(memkv_server, spec_engines) -> None:
    a = spec_engines(_cfg(memkv_server.address, enable_kv_events=True), kv_events=False)
    _store(a, [okey(90)])
    assert _tier_events(a) == []


@needs_tier_events
def test_no_events_unless_the_tier_asks_for_them(memkv_server, spec_engines) -> None:
    a = spec_engines(_cfg(memkv_server.address), kv_events=True)
    _store(a, [okey(91)])
    assert _tier_events(a) == []


# ---------------------------------------------------------------------------------------------
# Sharing across parallel layouts (issue point 4).


def _has_canonical_layout() -> bool:
    try:
        from vllm.v1.kv_offload import config as oc
    except ImportError:
        return False
    return "canonical_layout" in {f.name for f in dataclasses.fields(oc.OffloadingConfig)}


@pytest.mark.skipif(not _has_canonical_layout(), reason="vLLM's canonical layout is 0.28+")
def test_a_portable_layout_is_shared_across_tp_sizes(memkv_server, spec_engines) -> None:
    """The canonical layout: vLLM certifies each layer's page as topology-free."""
    cfg = _cfg(memkv_server.address)
    a = spec_engines(cfg, tp_size=2, agnostic=True, canonical=True)
    keys = [okey(100 + i) for i in range(3)]
    _store(a, keys)
    b = spec_engines(cfg, tp_size=4, agnostic=True, canonical=True)
    ctx = _ctx(b)
    _load_all(b, keys, ctx)
    assert [np.array_equal(r, pattern(i)) for i, r in enumerate(_rows(b, keys, ctx))] == [True] * 3


@pytest.mark.parametrize(("writer_agnostic", "reader"), [
    (False, {"tp_size": 4}), (False, {"tp_size": 4, "agnostic": True}),
    (True, {"tp_size": 4, "agnostic": True}), (True, {"tp_size": 1, "agnostic": True}),
    (True, {"tp_size": 2, "agnostic": True, "dtype": "bfloat16"})])
def test_layouts_whose_bytes_differ_never_share(memkv_server, spec_engines, writer_agnostic,
                                                reader) -> None:
    # A TP=2 writer of the direct layout: its rows hold the ranks' areas one after the other,
    # which a reader of another TP size would misread, also where vLLM calls the layout
    # parallelism-agnostic (tests/e2e/test_tp_e2e.py shows it on a real engine); and any dtype
    # change changes the bytes.
    cfg = _cfg(memkv_server.address)
    a = spec_engines(cfg, tp_size=2, agnostic=writer_agnostic)
    keys = [okey(110 + i) for i in range(2)]
    _store(a, keys)
    b = spec_engines(cfg, **reader)
    ctx = _ctx(b)
    b.run_until(lambda: [b.lookup(k, ctx) for k in keys] == [LR.MISS, LR.MISS])


# ---------------------------------------------------------------------------------------------
# Bad values and early calls (issue point 5).


def test_a_wrong_length_value_found_at_load_is_deleted(memkv_server, engines) -> None:
    """vLLM's fs tier deletes a block file that reads short; a memkv value of the wrong length is
    as unusable for every engine and must not stay on the server."""
    cfg = _cfg(memkv_server.address)
    b = engines(cfg)
    key = okey(120)
    rkey = b.tier.remote_key(key)
    c = _client(memkv_server.address)
    try:
        c.put([rkey], [np.ones(ROW // 2, dtype=np.int8)])  # another writer's wrong-size value
    finally:
        c.close()
    ctx = _ctx(b)
    b.run_until(lambda: b.lookup(key, ctx) is LR.MISS)  # HIT, load fails, then MISS
    assert b.tier.store_stats()["load_blocks_failed"] == 1
    deadline = time.monotonic() + 5
    while _stored_remotely(memkv_server.address, [rkey]) != [False]:
        assert time.monotonic() < deadline, "the wrong-length value is still on the server"
        b.step()
        time.sleep(0.01)


def test_the_tier_works_before_vllm_initialises_none_hash(memkv_server, engines,
                                                          monkeypatch) -> None:
    """vLLM builds the tiers before it initialises NONE_HASH (the block-hash chain's seed); its
    own tiers store and load from the first call, so must this one."""
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", None)
    cfg = _cfg(memkv_server.address)
    a = engines(cfg)
    keys = [okey(130 + i) for i in range(2)]
    _store(a, keys)
    assert a.tier.store_stats().get("store_blocks_ok", 0) == 2
    b = engines(cfg)
    ctx = _ctx(b)
    _load_all(b, keys, ctx)
    assert [np.array_equal(r, pattern(i)) for i, r in enumerate(_rows(b, keys, ctx))] == [True] * 2


def test_the_factory_builds_the_tier_with_the_documented_keys(memkv_server) -> None:
    # Every key of docs/tier.md's table is accepted by the constructor vLLM's factory calls.
    from harness import ArrayRegion, SpecStandIn

    region = ArrayRegion(4)
    tier = SecondaryTierFactory.create_secondary_tier(
        _cfg(memkv_server.address, n_read_threads=2, n_write_threads=2, blocks_per_op=4,
             max_store_backlog_mb=16, lookup_timeout_s=2),
        memoryview(region.arr), SpecStandIn())
    try:
        assert isinstance(tier, MemKVSecondaryTierManager)
    finally:
        tier.shutdown()
