"""vLLM's own secondary-tier tests, run against the memkv tier.

Follows vLLM's tests/v1/kv_offload/tiering/test_fs_tier.py and test_obj_tier.py (v0.32.0): the
same calls on the tier object (`submit_store`/`submit_load` with vLLM's own job descriptor,
`drain_jobs()` then `get_finished_jobs()`, a lookup completed by `on_schedule_end()`, events from
`take_events()`) and the same assertions, with a real `memkv serve` where vLLM's tests use a
directory or a mocked NIXL agent. What those tests assert of vLLM's own tiers is what vLLM's users
and reviewers expect of any tier:

* a store then a lookup hits; an unknown key misses; a load of an absent key fails its job;
* every job is reported once, by id, whatever the order; a job of zero keys succeeds;
* a slot outside the pool fails the job (nothing outside the pool is touched);
* bytes stored come back unchanged into other slots;
* a failed promotion makes the same request's next lookup a MISS (the livelock fix), while keys
  of the job that did load stay HIT (`successful_keys`), and a value that can never load (short
  file; here a value of the wrong length) is removed, so a fresh request misses too; a
  transient failure (here a server that stops answering) leaves the value in place;
* `locality` is validated like `Locality(value)`, forwarded by the factory and carried by the
  stored events; events only with both the tier's and the engine's flag, only for store jobs that
  succeeded, and they surface through the TieringOffloadingManager;
* a TP=2 writer and a TP=4 reader with vLLM's replicated layout (0.27+) share blocks.

Deliberate differences from the fs tier (docs/tier.md says why): the default locality is REMOTE,
not None; the events' medium is STORAGE as the fs tier's is, but the tier class's medium is CPU
(memkv keeps values in DRAM; request filters match it); a load that finds
a key gone announces it removed. Assertions on fs/NIXL internals (thread-pool queues, the C
extension, O_DIRECT, credentials) have no memkv counterpart and are not ported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
from harness import ArrayRegion, SpecStandIn, okey
from vllm.v1.kv_offload import base as kvb
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering import base as tb
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.tier import MemKVSecondaryTierManager

NUM_BLOCKS = 8
ROW = 4 * 4096  # bytes per pool row
CTX = ReqContext(req_id="test")

HAVE_CONFIG = hasattr(kvb, "OffloadingKVEventsConfig") and hasattr(kvb, "Locality")
needs_locality = pytest.mark.skipif(not hasattr(kvb, "Locality"),
                                    reason="tier locality exists from vLLM 0.26 on")
needs_tier_events = pytest.mark.skipif(
    "take_events" not in vars(tb.SecondaryTierManager),
    reason="secondary tiers publish KV events from vLLM 0.26 on")


def _offloading_config_fields() -> set[str]:
    """The fields of vLLM's OffloadingConfig; none before 0.26, which has no such class."""
    if importlib.util.find_spec("vllm.v1.kv_offload.config") is None:
        return set()
    from vllm.v1.kv_offload import config as oc

    return {f.name for f in dataclasses.fields(oc.OffloadingConfig)}


needs_replicated_layout = pytest.mark.skipif(
    "replicated_layout" not in _offloading_config_fields(),
    reason="replicated layouts (OffloadingConfig.replicated_layout) exist from vLLM 0.27 on")
needs_partial_results = pytest.mark.skipif(
    "successful_keys" not in {f.name for f in dataclasses.fields(tb.JobResult)},
    reason="JobResult.successful_keys exists from vLLM 0.28 on")

_JOB_CLS = getattr(tb, "TransferJob", None) or tb.JobMetadata
_SLOTS = "chunk_ids" if "chunk_ids" in {f.name for f in dataclasses.fields(_JOB_CLS)} \
    else "block_ids"


def make_spec(enable_kv_cache_events: bool = False, *, tp_size: int = 1, rank: int = 0,
              replicated_layout: bool = False) -> Any:
    """vLLM's test spec: an object with a real OffloadingConfig (0.26+) and events config."""
    if not HAVE_CONFIG:
        return SpecStandIn()
    from vllm.v1.kv_offload import config as oc

    def build(cls: type, **values: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    class Spec:
        pass

    spec = Spec()
    spec.config = build(  # type: ignore[attr-defined]
        oc.OffloadingConfig, groups=(), worker_kv_bytes_per_block=0,
        enable_kv_cache_events=enable_kv_cache_events, extra_config={},
        engine_id="test-engine",
        model=build(oc.OffloadingModelConfig, name="test-model", dtype="float32"),
        cache=build(oc.OffloadingCacheConfig, tokens_per_hash=16, blocks_per_chunk=1),
        parallel=build(oc.OffloadingParallelConfig, rank=rank, world_size=tp_size,
                       tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
                       data_parallel_index=0, data_parallel_size=1,
                       data_parallel_rank_local=None, is_parallelism_agnostic=False),
        replicated_layout=replicated_layout)
    spec.blocks_per_chunk = 1  # type: ignore[attr-defined]
    spec.replicated_layout = replicated_layout  # type: ignore[attr-defined]
    spec.kv_events_config = kvb.OffloadingKVEventsConfig(  # type: ignore[attr-defined]
        enable_kv_cache_events=enable_kv_cache_events, self_describing_kv_events=False)
    return spec


def make_job(job_id: int, keys: list[bytes], slots: list[int] | None = None,
             is_promotion: bool = False) -> Any:
    if slots is None:
        slots = list(range(len(keys)))
    return _JOB_CLS(job_id=job_id, keys=keys, is_promotion=is_promotion, req_context=CTX,
                    **{_SLOTS: np.array(slots, dtype=np.int64)})


def drain(tier: Any) -> list[Any]:
    """vLLM's helper: block until all in-flight jobs finish, then collect results."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_and_wait(tier: Any, keys: list[bytes], ctx: ReqContext = CTX,
                    timeout: float = 5.0) -> list[Any]:
    """A full asynchronous lookup cycle: ask, end the step, ask again until answered."""
    results = [tier.lookup(k, ctx) for k in keys]
    deadline = time.monotonic() + timeout
    while LookupResult.RETRY in results:
        assert time.monotonic() < deadline, "lookup not answered"
        tier.on_schedule_end(api().schedule_end_context())
        time.sleep(0.01)
        results = [tier.lookup(k, ctx) for k in keys]
    return results


@pytest.fixture
def make_tier(memkv_server):
    made: list[tuple[MemKVSecondaryTierManager, ArrayRegion]] = []
    prefix = f"suite-{uuid.uuid4().hex[:8]}"

    def make(num_blocks: int = NUM_BLOCKS, spec: Any = None,
             **kw: Any) -> tuple[MemKVSecondaryTierManager, np.ndarray]:
        region = ArrayRegion(num_blocks, ROW)
        kw.setdefault("servers", [memkv_server.address])
        tier = MemKVSecondaryTierManager(
            offloading_spec=spec if spec is not None else make_spec(),
            primary_kv_view=memoryview(region.arr), tier_type="memkv",
            prefix=prefix, n_read_threads=4, n_write_threads=4, **kw)
        made.append((tier, region))
        return tier, region.arr

    yield make
    for tier, _ in made:
        tier.shutdown()


@pytest.fixture
def memkv_tier(make_tier):
    return make_tier()


def _client(address: str):
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    return MemKVClient.from_config(load_config({"servers": [address]}))


def _overwrite_short(address: str, rkey: bytes) -> None:
    """The memkv counterpart of the fs tests' truncated block file: a value too short to load."""
    c = _client(address)
    try:
        c.put([rkey], [np.ones(10, dtype=np.int8)])
    finally:
        c.close()


def _present(address: str, rkey: bytes) -> bool:
    from memkv_vllm.core.client import Status

    c = _client(address)
    try:
        return bool(Status.is_ok(c.exists([rkey])[0]))
    finally:
        c.close()


def _random_rows(arr: np.ndarray, seed: int = 0) -> None:
    arr[:] = np.random.default_rng(seed).integers(-128, 127, size=arr.shape, dtype=np.int8)


# ---------------------------------------------------------------------------------------------
# test_fs_tier.py / test_obj_tier.py: basics


def test_lookup_empty_tier(memkv_tier):
    tier, _ = memkv_tier
    assert lookup_and_wait(tier, [okey(1), okey(2)]) == [LookupResult.MISS, LookupResult.MISS]


def test_store_then_lookup_succeeds(memkv_tier, memkv_server):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    results = drain(tier)
    assert len(results) == 1 and results[0].success and results[0].job_id == 1
    assert lookup_and_wait(tier, [okey(1)]) == [LookupResult.HIT]
    assert _present(memkv_server.address, tier.remote_key(okey(1)))


def test_lookup_unrelated_key_misses(memkv_tier):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    drain(tier)
    assert lookup_and_wait(tier, [okey(999)]) == [LookupResult.MISS]


def test_store_then_load_roundtrip(memkv_tier, memkv_server):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1), okey(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, [okey(1), okey(2)]) == [LookupResult.HIT] * 2
    tier.submit_load(make_job(2, [okey(1), okey(2)], [2, 3], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    # A successful load leaves the values where they are.
    assert all(_present(memkv_server.address, tier.remote_key(k)) for k in (okey(1), okey(2)))
    assert lookup_and_wait(tier, [okey(1), okey(2)]) == [LookupResult.HIT] * 2


@needs_locality
@pytest.mark.parametrize("locality", ["local", ""])
def test_invalid_locality_raises_at_construction(make_tier, locality):
    with pytest.raises(ValueError, match="Locality"):
        make_tier(locality=locality)


@needs_locality
def test_factory_forwards_locality_to_the_tier(memkv_server):
    region = ArrayRegion(4, ROW)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "memkv", "servers": [memkv_server.address], "n_read_threads": 1,
         "n_write_threads": 1, "locality": "LOCAL"},
        memoryview(region.arr), make_spec())
    try:
        assert isinstance(tier, MemKVSecondaryTierManager)
        assert tier.locality is kvb.Locality.LOCAL
    finally:
        tier.shutdown()


def test_failed_load_of_an_absent_key(memkv_tier):
    tier, _ = memkv_tier
    tier.submit_load(make_job(1, [okey(99)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success


def test_multiple_jobs_tracked_independently(memkv_tier):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    tier.submit_store(make_job(2, [okey(2)], [1]))
    results = drain(tier)
    assert {r.job_id for r in results} == {1, 2} and len(results) == 2
    assert all(r.success for r in results)
    assert lookup_and_wait(tier, [okey(1), okey(2)]) == [LookupResult.HIT] * 2


def test_multi_block_job_partial_failure(memkv_tier):
    """A load job where one key is missing yields a single failed JobResult."""
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(10), okey(11)], [0, 1]))
    assert all(r.success for r in drain(tier))
    tier.submit_load(make_job(2, [okey(10), okey(11), okey(99)], [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].job_id == 2 and not results[0].success


def test_shutdown_with_jobs_in_flight(memkv_tier):
    """Shutdown with jobs queued ends all their I/O before it returns (vLLM unmaps the pool next):
    the store's harvester thread, which stops only once no operation is in flight, is gone.
    Unlike the fs tier, queued stores are finished first rather than dropped."""
    tier, _ = memkv_tier

    def harvesters() -> int:
        return sum(t.name == "memkv-harvest" for t in threading.enumerate())

    before = harvesters()
    for i in range(10):
        tier.submit_store(make_job(i, [okey(i)], [i % 4]))
    tier.shutdown()
    assert harvesters() == before - 1


def test_shutdown_idempotent(memkv_tier):
    tier, _ = memkv_tier
    tier.shutdown()
    tier.shutdown()


def test_partial_block_lookup(memkv_tier):
    tier, _ = memkv_tier
    keys = [okey(i) for i in range(4)]
    tier.submit_store(make_job(1, keys[:2], [0, 1]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, keys) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
def test_store_load_data_integrity(memkv_tier, batch_size):
    """Bytes written by a store come back unchanged by a load, into other slots, for batches of
    any size including the empty one."""
    tier, pool = memkv_tier
    _random_rows(pool)
    keys = [okey(i) for i in range(batch_size)]
    expected = pool[:batch_size].copy()
    tier.submit_store(make_job(1, keys, list(range(batch_size))))
    results = drain(tier)
    assert len(results) == 1 and results[0].success

    pool[:] = 0
    load_slots = list(range(NUM_BLOCKS - batch_size, NUM_BLOCKS))
    tier.submit_load(make_job(2, keys, load_slots, is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    for i, slot in enumerate(load_slots):
        assert np.array_equal(pool[slot], expected[i]), f"slot {slot} differs"


def test_out_of_bounds_slot_fails_the_job(memkv_tier):
    tier, pool = memkv_tier
    oob = pool.shape[0]  # one past the last row
    tier.submit_store(make_job(1, [okey(1)], [oob]))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    tier.submit_load(make_job(2, [okey(1)], [oob], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success


# ---------------------------------------------------------------------------------------------
# Failed loads: the re-promotion livelock, partial success, corrupt and transient failures


def test_failed_load_corrects_verdict_and_removes_the_bad_value(memkv_tier, memkv_server):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="livelock-req")
    assert lookup_and_wait(tier, [okey(1)], ctx=ctx) == [LookupResult.HIT]

    # A successful promotion touches neither the verdict nor the value.
    tier.submit_load(make_job(2, [okey(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.lookup(okey(1), ctx) == LookupResult.HIT

    rkey = tier.remote_key(okey(1))
    _overwrite_short(memkv_server.address, rkey)
    tier.submit_load(make_job(3, [okey(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success

    # The same request now misses without a new probe; the unusable value is gone, so a fresh
    # request misses too.
    assert tier.lookup(okey(1), ctx) == LookupResult.MISS
    deadline = time.monotonic() + 5
    while _present(memkv_server.address, rkey):
        assert time.monotonic() < deadline, "the wrong-length value is still on the server"
        time.sleep(0.01)
    fresh = ReqContext(req_id="fresh-after-short-read")
    assert lookup_and_wait(tier, [okey(1)], ctx=fresh) == [LookupResult.MISS]


@needs_partial_results
def test_batched_partial_load_failure_keeps_loaded_blocks(memkv_tier, memkv_server):
    """The keys of a failed load job that did load are reported in successful_keys and stay
    HIT; only the failed one becomes a MISS."""
    tier, _ = memkv_tier
    keys = [okey(1), okey(2), okey(3)]
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-req")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3

    _overwrite_short(memkv_server.address, tier.remote_key(okey(3)))
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tuple(results[0].successful_keys) == (okey(1), okey(2))
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.HIT,
                                                   LookupResult.MISS]
    fresh = ReqContext(req_id="fresh-batch-req")
    assert lookup_and_wait(tier, keys, ctx=fresh) == [LookupResult.HIT, LookupResult.HIT,
                                                      LookupResult.MISS]


@needs_partial_results
def test_batched_load_whose_first_block_fails_marks_the_whole_batch(memkv_tier, memkv_server):
    """Nothing loaded: no successful_keys (None, as vLLM's tiers report it) and every key of
    the job misses for the request. Here the other keys are absent."""
    tier, _ = memkv_tier
    keys = [okey(1), okey(2), okey(3)]
    tier.submit_store(make_job(1, keys[:1], [0]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-first-fail")
    _overwrite_short(memkv_server.address, tier.remote_key(okey(1)))
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert results[0].successful_keys is None
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3


def test_transient_load_failure_leaves_the_value(make_tier, memkv_server, proxy):
    """A server that stops answering fails the load (op timeout) but must not cost the value."""
    p = proxy(memkv_server.address)
    tier, _ = make_tier(servers=[p.address], op_timeout_s=1.0)
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    p.freeze()
    tier.submit_load(make_job(2, [okey(1)], [1], is_promotion=True))
    results = drain(tier)
    p.thaw()
    assert len(results) == 1 and not results[0].success
    assert _present(memkv_server.address, tier.remote_key(okey(1)))


# ---------------------------------------------------------------------------------------------
# KV events


@pytest.fixture
def events_tier(make_tier):
    tier, _ = make_tier(spec=make_spec(enable_kv_cache_events=True), enable_kv_events=True,
                        locality="LOCAL")
    return tier


@needs_tier_events
def test_successful_store_emits_stored_event(events_tier):
    tier = events_tier
    keys = [okey(1), okey(2)]
    tier.submit_store(make_job(1, keys, [0, 1]))
    assert all(r.success for r in drain(tier))
    events = list(tier.take_events())
    assert len(events) == 1
    assert list(events[0].keys) == keys
    medium = getattr(kvb, "Medium", None)
    assert events[0].medium == (medium.STORAGE if medium is not None else "STORAGE")
    if hasattr(events[0], "locality"):
        assert events[0].locality is kvb.Locality.LOCAL
    assert not events[0].removed
    assert list(tier.take_events()) == []  # take_events drains the buffer


@needs_tier_events
@pytest.mark.skipif(not hasattr(kvb, "Medium"), reason="events carry a locality from 0.27 on")
@pytest.mark.parametrize(("locality", "expected"), [(None, "REMOTE"), ("REMOTE", "REMOTE"),
                                                    ("LOCAL", "LOCAL")])
def test_store_event_uses_configured_locality(make_tier, locality, expected):
    tier, _ = make_tier(spec=make_spec(enable_kv_cache_events=True), enable_kv_events=True,
                        **({} if locality is None else {"locality": locality}))
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    events = list(tier.take_events())
    assert len(events) == 1 and events[0].locality is kvb.Locality[expected]


@needs_tier_events
def test_load_job_emits_no_event(events_tier):
    tier = events_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    list(tier.take_events())
    tier.submit_load(make_job(2, [okey(1)], [1], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert list(tier.take_events()) == []


@needs_tier_events
def test_mixed_job_results_emit_event_only_for_successful_job(events_tier):
    tier = events_tier
    tier.submit_store(make_job(1, [okey(1)], [NUM_BLOCKS]))  # outside the pool: fails
    tier.submit_store(make_job(2, [okey(2)], [1]))
    results = {r.job_id: r for r in drain(tier)}
    assert len(results) == 2 and not results[1].success and results[2].success
    events = list(tier.take_events())
    assert len(events) == 1 and list(events[0].keys) == [okey(2)]


@needs_tier_events
def test_events_disabled_by_default(memkv_tier):
    tier, _ = memkv_tier
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    assert list(tier.take_events()) == []


@needs_tier_events
def test_events_require_global_kv_events_flag(make_tier):
    tier, _ = make_tier(spec=make_spec(enable_kv_cache_events=False), enable_kv_events=True)
    tier.submit_store(make_job(1, [okey(1)], [0]))
    assert all(r.success for r in drain(tier))
    assert list(tier.take_events()) == []


@needs_tier_events
def test_cascade_store_emits_event_through_tiering_manager(memkv_server):
    """GPU->CPU->memkv: the tier's stored event comes out of the manager's take_events()."""
    region = ArrayRegion(4, ROW)
    primary = CPUPrimaryTierOffloadingManager(4, region)
    tier = MemKVSecondaryTierManager(
        offloading_spec=make_spec(enable_kv_cache_events=True),
        primary_kv_view=primary.get_kv_memoryview(), tier_type="memkv",
        servers=[memkv_server.address], prefix=f"suite-{uuid.uuid4().hex[:8]}",
        enable_kv_events=True)
    manager = TieringOffloadingManager(primary, [tier])
    try:
        keys = [okey(1), okey(2)]
        manager.on_new_request(CTX)
        assert manager.prepare_store(keys, CTX) is not None
        manager.complete_store(keys, CTX)  # cascades to the memkv tier
        tier_events: list[Any] = []
        deadline = time.monotonic() + 5.0
        while not tier_events:
            assert time.monotonic() < deadline, "no event from the memkv tier"
            manager.on_schedule_end(api().schedule_end_context())
            tier_events += [e for e in manager.take_events()
                            if getattr(e, "locality", None) is kvb.Locality.REMOTE]
            time.sleep(0.01)
        assert len(tier_events) == 1
        assert set(tier_events[0].keys) == set(keys) and not tier_events[0].removed
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------------------------
# Sharing across TP sizes


@needs_replicated_layout
def test_cross_tp_round_trip(make_tier):
    """A TP=2 writer and a TP=4 reader with vLLM's replicated layout share keys and bytes.
    (vLLM 0.26 has parallelism-agnostic layouts but no replicated one: sharing across TP sizes
    through `is_parallelism_agnostic`, on every version, is test_conformance.py's.)"""
    writer, wpool = make_tier(num_blocks=4, spec=make_spec(tp_size=2, replicated_layout=True))
    _random_rows(wpool, seed=7)
    expected = wpool[0].copy()
    writer.submit_store(make_job(1, [okey(7)], [0]))
    assert all(r.success for r in drain(writer))

    reader, rpool = make_tier(num_blocks=4,
                              spec=make_spec(tp_size=4, rank=3, replicated_layout=True))
    assert reader.remote_key(okey(7)) == writer.remote_key(okey(7))
    assert lookup_and_wait(reader, [okey(7)]) == [LookupResult.HIT]
    reader.submit_load(make_job(2, [okey(7)], [1], is_promotion=True))
    assert all(r.success for r in drain(reader))
    assert np.array_equal(rpool[1], expected)
