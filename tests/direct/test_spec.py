"""MemKVOffloadingSpec through the installed vLLM's own classes (runs in each vLLM venv): specs
built as vLLM builds them, a worker over canonical host KV caches, the scheduler's manager, and
the OffloadingConnector's calls in its order, against a real memkv server."""

from __future__ import annotations

import pickle
import time
import uuid

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from test_tenants import KEY_A, tenant_server, tenant_stats  # noqa: E402
from vllm_specs import canonical_kv, make_spec  # noqa: E402

from memkv_vllm.core.config import ConfigError  # noqa: E402
from memkv_vllm.core.interface import LoadErrorListener, LoadErrorReporter  # noqa: E402
from memkv_vllm.direct.prefixes import PrefixMismatch  # noqa: E402
from memkv_vllm.vllm.compat import api  # noqa: E402

kvb = pytest.importorskip("vllm.v1.kv_offload.base")
BPC = 2


def engine() -> str:
    """A new engine id: its own prefix board."""
    return f"memkv-direct-test-{uuid.uuid4().hex[:12]}"


def extra(address: str, **kw: object) -> dict:
    return {"servers": [address], "memkv_num_threads": 1, "memkv_scratch_mb_per_thread": 1, **kw}


def ask(manager, key: bytes, timeout: float = 10.0):
    """lookup until it is not RETRY, ending each scheduler step as vLLM does."""
    ctx = kvb.ReqContext(req_id="r1")
    deadline = time.monotonic() + timeout
    while (v := manager.lookup(key, ctx)) is kvb.LookupResult.RETRY:
        assert time.monotonic() < deadline
        manager.on_schedule_end(api().schedule_end_context())
        time.sleep(0.01)
    return v


def finished(worker, job_id: int, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        done = worker.get_finished()
        if done:
            assert [r.job_id for r in done] == [job_id]
            return done[0]
        assert time.monotonic() < deadline, "job never finished"
        time.sleep(0.01)


def one_engine(address: str, seed: int) -> tuple[object, object, list]:
    """(worker, manager, KV tensors) of a new single-rank engine, started as vLLM starts one:
    the worker first, then the scheduler's manager (which adopts the worker's prefix)."""
    eid, ex = engine(), extra(address)
    kv, ts = canonical_kv(seed=seed)
    worker = make_spec(ex, engine_id=eid).get_worker(kv)
    return worker, make_spec(ex, engine_id=eid).get_manager(), ts


def keys(n: int) -> list[bytes]:
    return [kvb.make_offload_key(b"block-hash-%02d" % i, 0) for i in range(n)]


def test_store_then_load_through_vllms_classes(memkv_server) -> None:
    eid = engine()
    ex = extra(memkv_server.address)
    w_spec = make_spec(ex, engine_id=eid)
    kv, ts = canonical_kv(seed=1)
    worker = w_spec.get_worker(kv)
    assert w_spec.get_worker(kv) is worker  # vLLM asks once; the spec keeps it anyway
    manager = make_spec(ex, engine_id=eid).get_manager()  # adopts the worker's prefix
    ks = keys(2)
    assert ask(manager, ks[0]) is kvb.LookupResult.MISS
    out = manager.prepare_store(ks, kvb.ReqContext(req_id="r1"))
    assert list(out.keys_to_store) == ks and list(out.evicted_keys) == []
    store_spec = pickle.loads(pickle.dumps(out.store_spec))  # crosses to the workers by pickle
    gpu = kvb.GPULoadStoreSpec([4, 5, 6, 7], group_sizes=[4], block_indices=[0])
    assert worker.submit_store(1, gpu, store_spec) is True
    r = finished(worker, 1)
    assert r.success and r.transfer_size == 2 * BPC * 2 * 512 and r.transfer_time >= 0
    manager.complete_store(ks, kvb.ReqContext(req_id="r1"))
    assert manager.prepare_store(ks, kvb.ReqContext(req_id="r1")).keys_to_store == []

    # Another engine (new ids, new prefix board) reads them: same model, same namespace.
    worker2, manager2, ts2 = one_engine(memkv_server.address, seed=2)
    assert [ask(manager2, k) for k in ks] == [kvb.LookupResult.HIT] * 2
    load_spec = pickle.loads(pickle.dumps(manager2.prepare_load(ks, kvb.ReqContext(req_id="r"))))
    # The first block is already cached: the load starts one block into the first chunk.
    dst = kvb.GPULoadStoreSpec([11, 12, 13], group_sizes=[3], block_indices=[1])
    before = ts2[0][10].clone()
    assert worker2.submit_load(2, load_spec, dst) is True
    worker2.wait({2})
    assert finished(worker2, 2).success
    manager2.complete_load(ks, kvb.ReqContext(req_id="r"))
    for t, t2 in zip(ts, ts2, strict=True):
        assert torch.equal(t2[11:14], t[5:8])
    assert torch.equal(ts2[0][10], before)
    stats = manager2.get_stats()
    assert stats is not None and manager2.get_stats() is None  # deltas: nothing new since
    for w, m in ((worker, manager), (worker2, manager2)):
        w.shutdown()
        m.shutdown()


def test_a_failed_load_in_the_plain_configuration_is_reported_and_never_written(memkv_server):
    worker, manager, ts = one_engine(memkv_server.address, seed=3)
    assert isinstance(worker, LoadErrorReporter) and isinstance(manager, LoadErrorListener)
    spec = manager.prepare_load(keys(1), kvb.ReqContext(req_id="r"))  # nothing stored
    before = [t.clone() for t in ts]
    worker.submit_load(1, spec, kvb.GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]))
    assert finished(worker, 1).success is False  # vLLM stops: nothing can recompute
    assert worker.take_load_errors() == set()
    worker.recompute_failed_loads()  # what the recompute connector does
    worker.submit_load(2, spec, kvb.GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]))
    assert finished(worker, 2).success is True
    assert worker.take_load_errors() == {5, 6}
    assert worker.take_load_errors() == set()
    assert all(torch.equal(a, b) for a, b in zip(before, ts, strict=True))
    worker.shutdown()
    manager.shutdown()


def test_a_load_whose_job_cannot_be_read_is_reported_failed_even_when_recomputing(memkv_server):
    worker, manager, ts = one_engine(memkv_server.address, seed=6)
    worker.recompute_failed_loads()
    spec = manager.prepare_load(keys(1), kvb.ReqContext(req_id="r"))
    before = [t.clone() for t in ts]
    # Not a GPULoadStoreSpec: its blocks are unknown, so no one could recompute them, and a
    # success would have vLLM read KV that was never loaded.
    assert worker.submit_load(1, spec, spec) is True
    assert finished(worker, 1).success is False
    assert worker.take_load_errors() == set()
    assert all(torch.equal(a, b) for a, b in zip(before, ts, strict=True))
    worker.shutdown()
    manager.shutdown()


def test_a_rank_that_published_nothing_stops_startup_naming_it(memkv_server):
    eid = engine()
    ex = extra(memkv_server.address)
    kv, _ = canonical_kv(seed=4)
    worker = make_spec(ex, engine_id=eid, rank=0, tp_size=2).get_worker(kv)
    t0 = time.monotonic()
    with pytest.raises(PrefixMismatch, match=r"rank\(s\) \[1\].*rank 1: no entry"):
        make_spec({**ex, "memkv_prefix_wait_s": 0.3}, engine_id=eid, rank=0,
                  tp_size=2).get_manager()
    assert time.monotonic() - t0 < 5  # the wait is bounded by memkv_prefix_wait_s
    worker.shutdown()


def test_ranks_that_disagree_stop_startup(memkv_server):
    eid = engine()
    kv, _ = canonical_kv(seed=5)
    w0 = make_spec(extra(memkv_server.address), engine_id=eid, tp_size=2).get_worker(kv)
    w1 = make_spec(extra(memkv_server.address, memkv_spec_prefix="other"), engine_id=eid,
                   rank=1, tp_size=2).get_worker(kv)
    with pytest.raises(PrefixMismatch, match="disagree"):
        make_spec(extra(memkv_server.address), engine_id=eid, tp_size=2).get_manager()
    w0.shutdown()
    w1.shutdown()


def test_a_tenants_engine_works_inside_its_prefix_and_stops_outside_it(memkv_server_factory,
                                                                      tmp_path):
    """Against a server with tenants only the credentials change: a `memkv_spec_prefix` outside
    the tenant's namespace stops the worker at startup naming both; inside it the worker, the
    prefix board's cluster entries and the scheduler's manager all stay within the tenant's keys
    (the server answered nothing FORBIDDEN) and its blocks round-trip."""
    srv = tenant_server(memkv_server_factory, tmp_path)
    kv, _ = canonical_kv(seed=7)
    outside = extra(srv.address, auth_key=KEY_A, memkv_spec_prefix="b/")
    with pytest.raises(ConfigError) as e:
        make_spec(outside, engine_id=engine()).get_worker(kv)
    assert "'memkv_spec_prefix'" in str(e.value) and "b/mkD1" in str(e.value)
    assert "b'a/'" in str(e.value)
    eid, ex = engine(), extra(srv.address, auth_key=KEY_A, memkv_spec_prefix="a/")
    worker = make_spec(ex, engine_id=eid).get_worker(kv)
    manager = make_spec(ex, engine_id=eid).get_manager()
    ks = keys(2)
    assert ask(manager, ks[0]) is kvb.LookupResult.MISS
    out = manager.prepare_store(ks, kvb.ReqContext(req_id="r1"))
    gpu = kvb.GPULoadStoreSpec([4, 5, 6, 7], group_sizes=[4], block_indices=[0])
    assert worker.submit_store(1, gpu, out.store_spec) is True
    assert finished(worker, 1).success
    manager.complete_store(ks, kvb.ReqContext(req_id="r1"))
    st = tenant_stats(srv, KEY_A)["team-a"]
    assert st["puts"] >= 2 and st["forbidden"] == 0, st
    worker.shutdown()
    manager.shutdown()


def test_pipeline_parallelism_and_bad_keys_fail_at_startup(memkv_server):
    with pytest.raises(ValueError, match="pipeline parallelism"):
        make_spec(extra(memkv_server.address), engine_id=engine(), pp_size=2)
    with pytest.raises(ConfigError, match="memkv_scratch_medium"):
        make_spec(extra(memkv_server.address, memkv_scratch_medium="disk"),
                  engine_id=engine())


def test_metrics_are_declared_and_the_load_store_spec_is_concrete():
    from memkv_vllm.vllm.spec import MemKVLoadStoreSpec, MemKVOffloadingSpec

    defs = MemKVOffloadingSpec.build_metric_definitions({})
    assert "vllm:kv_offload_memkv_lookups" in defs
    s = MemKVLoadStoreSpec([(b"h", 0)])  # abstract medium() on 0.25 would refuse this
    assert s.medium() == "memkv" and s.chunks == ((b"h", 0),)


def test_hits_are_attributed_to_a_remote_store_where_vllm_asks():
    from memkv_vllm.vllm.spec import MemKVOffloadingManager

    if "get_load_source" not in vars(kvb.OffloadingManager):
        pytest.skip("this vLLM does not ask a manager where its hits came from (0.32+)")
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    source = MemKVOffloadingManager.get_load_source(None, b"k", kvb.ReqContext(req_id="r"))
    assert CacheHitSource(source) is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_stored_chunks_become_kv_events_when_the_engine_publishes_them():
    from memkv_vllm.core.backends import store_for
    from memkv_vllm.core.config import load_config
    from memkv_vllm.direct.manager import DirectManager
    from memkv_vllm.vllm.spec import MemKVOffloadingManager

    def manager(events: bool) -> MemKVOffloadingManager:
        logic = DirectManager(store_for(None, load_config({})), b"p", 1, api().split_offload_key)
        return MemKVOffloadingManager(logic, None, kv_events=events)

    ks, ctx = keys(2), kvb.ReqContext(req_id="r")
    for events in (True, False):
        m = manager(events)
        assert m.prepare_store(ks, ctx).keys_to_store == ks
        m.complete_store(ks, ctx)
        out = list(m.take_events())
        assert [list(e.keys) for e in out] == ([ks] if events else [])
        assert all(e.removed is False for e in out)
        # for a router: in the shared cluster, not in this engine (0.26 names media by string)
        storage = kvb.Medium.STORAGE if hasattr(kvb, "Medium") else "STORAGE"
        assert all(e.medium == storage for e in out)
        assert list(m.take_events()) == []  # each event once
        m.shutdown()
