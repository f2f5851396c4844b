"""memkv as SGLang HiCache's storage backend, against SGLang's real classes (host pools over
device pools on the CPU, the dynamic backend loader) and real memkv servers.

Runs in .venv-sglang (scripts/setup-sglang.sh); skipped, saying so, where SGLang is missing.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed in this venv: tests/hicache run in "
                    ".venv-sglang (bash scripts/setup-sglang.sh)")

import numpy as np  # noqa: E402
from sglang_pools import (  # noqa: E402
    backend,
    host_pool,
    names,
    page_bytes,
    pages,
    same,
    storage_config,
)

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def fast(**kw):  # noqa: ANN003, ANN201
    """Settings that make a dead or frozen server a miss within about a second."""
    return {"op_timeout_s": 1.0, "connect_timeout_s": 1.0, "lookup_timeout_s": 1.0, **kw}


@pytest.mark.parametrize(("kind", "layout"), [(k, lay) for k in ("mha", "mla") for lay in LAYOUTS]
                         + [("mha", "page_head")])
def test_set_exists_get_round_trip_through_a_real_host_pool(memkv_server, kind, layout):
    host = host_pool(kind, layout)
    b = backend(host, storage_config(kind == "mla", servers=memkv_server.address))
    keys = names(f"rt-{kind}-{layout}", 3)
    want = page_bytes(host, 1, 3)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, pages(host, 1, 3)) == [True] * 3
    assert b.batch_exists(keys) == 3
    host.kv_buffer.zero_()
    assert b.batch_get_v1(keys, pages(host, 5, 3)) == [True] * 3
    got = page_bytes(host, 5, 3)
    assert same(got, want)
    # Nothing else of the pool was written.
    assert not host.get_data_page(0).any() and not host.get_data_page(4 * host.page_size).any()
    stats = b.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    b.close()


@pytest.mark.parametrize(("kind", "layout"), [("mha", "layer_first"), ("mla", "layer_first"),
                                              ("mha", "page_first")])
def test_flat_pages_and_zero_copy_pages_are_the_same_values(memkv_server, kind, layout):
    """SGLang's copying path (flat data pages) and its zero-copy path read each other's pages,
    also for MHA layer_first, whose flat page orders the segments differently."""
    host = host_pool(kind, layout)
    b = backend(host, storage_config(kind == "mla", servers=memkv_server.address))
    flat_keys, v1_keys = names("flat", 2), names("v1", 2)
    want = page_bytes(host, 0, 2)
    assert b.batch_set(flat_keys, want)
    assert b.batch_set_v1(v1_keys, pages(host, 0, 2)) == [True, True]
    host.kv_buffer.zero_()
    assert b.batch_get_v1(flat_keys, pages(host, 2, 2)) == [True, True]
    assert same(page_bytes(host, 2, 2), want)
    dummies = [host.get_dummy_flat_data_page() for _ in v1_keys]
    got = b.batch_get(v1_keys, dummies)
    assert same(got, want)
    assert b.exists(flat_keys[0]) and b.get(names("never", 1)[0],
                                            host.get_dummy_flat_data_page()) is None
    b.close()


def test_partial_hits_are_the_run_of_leading_pages(memkv_server):
    host = host_pool("mha", "page_first")
    b = backend(host, storage_config(False, servers=memkv_server.address))
    keys = names("partial", 4)
    assert b.batch_set_v1(keys[:2], pages(host, 0, 2)) == [True, True]
    assert b.batch_set_v1(keys[3:], pages(host, 3, 1)) == [True]
    assert b.batch_exists(keys) == 2  # page 2 is missing: the run stops there
    assert b.batch_exists(keys[2:]) == 0
    assert b.batch_exists(keys[3:]) == 1
    before = host.get_data_page(10 * host.page_size).clone()
    assert b.batch_get_v1(keys, pages(host, 8, 4)) == [True, True, False, True]
    assert same([host.get_data_page(10 * host.page_size)], [before]), "a miss wrote memory"
    b.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_two_engines_share_pages(memkv_server, kind):
    """A second engine (its own host pool and backend, same model and layout) reads what the
    first stored, without storing anything itself."""
    a_host, b_host = host_pool(kind, "page_first"), host_pool(kind, "page_first")
    a = backend(a_host, storage_config(kind == "mla", servers=memkv_server.address))
    b = backend(b_host, storage_config(kind == "mla", servers=memkv_server.address))
    keys = names(f"shared-{kind}", 4)
    want = page_bytes(a_host, 0, 4)
    assert a.batch_set_v1(keys, pages(a_host, 0, 4)) == [True] * 4
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, pages(b_host, 4, 4)) == [True] * 4
    assert same(page_bytes(b_host, 4, 4), want)
    assert b.memkv_stats().get("store_jobs", 0) == 0
    a.close()
    b.close()


def test_two_namespaces_never_share(memkv_server):
    host_a, host_b = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    a = backend(host_a, storage_config(False, servers=memkv_server.address, namespace="team-a"))
    b = backend(host_b, storage_config(False, servers=memkv_server.address, namespace="team-b"))
    keys = names("tenant", 2)
    assert a.batch_set_v1(keys, pages(host_a, 0, 2)) == [True, True]
    assert b.batch_exists(keys) == 0
    before = page_bytes(host_b, 0, 2)
    assert b.batch_get_v1(keys, pages(host_b, 0, 2)) == [False, False]
    assert same(page_bytes(host_b, 0, 2), before)
    assert set(a.remote_keys(keys[0])).isdisjoint(b.remote_keys(keys[0]))
    a.close()
    b.close()


@pytest.mark.parametrize(("kind", "shared"), [("mla", True), ("mha", False)])
def test_tp_ranks_share_mla_pages_and_keep_mha_pages_apart(memkv_server, kind, shared):
    """MLA KV is the same on every TP rank (SGLang lets one rank write it): rank 1 of a TP-2
    engine reads rank 0's pages, also those of a TP-1 engine. MHA ranks hold different heads."""
    h0, h1 = host_pool(kind, "page_first"), host_pool(kind, "page_first")
    r0 = backend(h0, storage_config(kind == "mla", servers=memkv_server.address))
    r1 = backend(h1, storage_config(kind == "mla", tp_rank=1, tp_size=2,
                                    servers=memkv_server.address))
    keys = names(f"tp-{kind}", 2)
    assert r0.batch_set_v1(keys, pages(h0, 0, 2)) == [True, True]
    assert r1.batch_exists(keys) == (2 if shared else 0)
    r0.close()
    r1.close()


def test_other_model_dtype_or_page_size_never_share(memkv_server):
    host = host_pool("mha", "page_first")
    a = backend(host, storage_config(False, servers=memkv_server.address))
    keys = names("digest", 1)
    assert a.batch_set_v1(keys, pages(host, 0, 1)) == [True]
    other_model = backend(host_pool("mha", "page_first"),
                          storage_config(False, model="org/other", servers=memkv_server.address))
    other_page = backend(host_pool("mha", "page_first", page_size=32),
                         storage_config(False, servers=memkv_server.address))
    other_layout = backend(host_pool("mha", "page_first_direct"),
                           storage_config(False, servers=memkv_server.address))
    for o in (other_model, other_page, other_layout):
        assert o.batch_exists(keys) == 0
        o.close()
    a.close()


def test_evicted_pages_are_misses(memkv_server_factory):
    """The server evicts the oldest pages to make room: they answer as misses, in exists and in
    get, and the get writes nothing; the newest pages are still there."""
    srv = memkv_server_factory(memory="16M", lanes=1)
    host = host_pool("mha", "page_first", page_size=64, heads=8, head_dim=64, tokens=1024)
    b = backend(host, storage_config(False, servers=srv.address))
    per_batch = 16  # 16 pages of 512 KiB: 8 MiB a batch
    batches = [names(f"evict-{i}", per_batch) for i in range(5)]
    for keys in batches:
        assert b.batch_set_v1(keys, pages(host, 0, per_batch)) == [True] * per_batch
    fresh = backend(host_pool("mha", "page_first", page_size=64, heads=8, head_dim=64,
                              tokens=1024), storage_config(False, servers=srv.address))
    assert fresh.batch_exists(batches[0]) == 0
    assert fresh.batch_exists(batches[-1]) == per_batch
    # The first engine still believes its pages are there: its get finds out and misses.
    host.kv_buffer.zero_()
    assert b.batch_get_v1(batches[0][:2], pages(host, 2, 2)) == [False, False]
    assert not host.kv_buffer.any()
    assert b.batch_exists(batches[0]) == 0
    b.close()
    fresh.close()


def test_a_corrupt_value_is_a_miss_and_is_removed(memkv_server):
    """A segment of the wrong length (what a torn or foreign write leaves) fails its page, leaves
    its memory alone, and is deleted so no engine tries it again."""
    host = host_pool("mha", "layer_first")
    b = backend(host, storage_config(False, servers=memkv_server.address))
    keys = names("corrupt", 3)
    assert b.batch_set_v1(keys, pages(host, 0, 3)) == [True] * 3
    bad = b.remote_keys(keys[1])[3]
    c = MemKVClient(MemKVConfig(servers=(memkv_server.address,)))
    assert c.put([bad], [np.ones(10, dtype=np.int8)]) == [Status.OK]
    want = page_bytes(host, 0, 3)
    host.kv_buffer.zero_()
    assert b.batch_get_v1(keys, pages(host, 4, 3)) == [True, False, True]
    got = page_bytes(host, 4, 3)
    assert same([got[0], got[2]], [want[0], want[2]])
    # Of the corrupt page only its good segments could have been written, never the bad one.
    assert not any(same([got[1]], [w]) for w in want)
    assert b.batch_exists(keys) == 1
    deadline = time.monotonic() + 10
    while Status.is_ok(c.exists([bad])[0]):
        assert time.monotonic() < deadline, "the corrupt value is still on the server"
        time.sleep(0.01)
    c.close()
    b.close()


def test_a_killed_server_is_a_miss_and_never_raises(memkv_server_factory):
    srv = memkv_server_factory()
    host = host_pool("mla", "page_first")
    b = backend(host, storage_config(True, **fast(servers=srv.address)))
    keys = names("killed", 3)
    assert b.batch_set_v1(keys, pages(host, 0, 3)) == [True] * 3
    srv.kill()
    fresh = backend(host_pool("mla", "page_first"), storage_config(True,
                                                                   **fast(servers=srv.address)))
    t0 = time.monotonic()
    assert fresh.batch_exists(keys) == 0
    assert fresh.batch_get_v1(keys, pages(host, 4, 3)) == [False] * 3
    assert b.batch_get_v1(keys, pages(host, 4, 3)) == [False] * 3
    assert b.batch_set_v1(names("after-kill", 2), pages(host, 0, 2)) == [False, False]
    assert b.batch_exists(keys) == 0
    assert time.monotonic() - t0 < 30
    b.close()
    fresh.close()


def test_a_server_that_answers_nothing_is_a_miss(memkv_server):
    host = host_pool("mha", "page_first")
    b = backend(host, storage_config(False, **fast(servers=memkv_server.address)))
    keys = names("frozen", 2)
    assert b.batch_set_v1(keys, pages(host, 0, 2)) == [True, True]
    probe = backend(host_pool("mha", "page_first"),
                    storage_config(False, **fast(servers=memkv_server.address)))
    with memkv_server.frozen():
        t0 = time.monotonic()
        assert probe.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, pages(host, 4, 2)) == [False, False]
        assert time.monotonic() - t0 < 15
    b.close()
    probe.close()


def test_servers_down_at_startup_are_misses():
    """A backend whose servers are not there at startup comes up; every page misses."""
    host = host_pool("mha", "page_first")
    b = backend(host, storage_config(False, **fast(servers="127.0.0.1:9")))
    assert b.batch_exists(names("none", 2)) == 0
    assert b.batch_set_v1(names("none", 2), pages(host, 0, 2)) == [False, False]
    b.close()


def test_a_bad_setting_fails_at_startup(memkv_server):
    host = host_pool("mha", "page_first")
    with pytest.raises(ValueError, match="op_timeout_s"):
        backend(host, storage_config(False, servers=memkv_server.address, op_timeout_s=-1))


def test_side_pools_of_hybrid_models_are_misses_never_errors(memkv_server):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    host = host_pool("mha", "page_first")
    b = backend(host, storage_config(False, servers=memkv_server.address))
    b.register_mem_host_pool_v2(host_pool("mha", "page_first"), PoolName.SWA)
    keys = names("hybrid", 2)
    swa = PoolTransfer(name=PoolName.SWA, host_indices=pages(host, 0, 2), keys=keys)
    assert b.batch_set_v2([swa]) == {"swa": [False, False]}
    assert b.batch_exists_v2(keys, [swa]).kv_hit_pages == 0
    assert b.batch_get_v2([swa]) == {"swa": [False, False]}
    b.close()


def test_concurrent_callers_each_get_their_own_answers(memkv_server):
    """SGLang's prefetch, backup and scheduler threads call one backend at once."""
    from concurrent.futures import ThreadPoolExecutor

    host = host_pool("mha", "page_first", tokens=512)
    b = backend(host, storage_config(False, servers=memkv_server.address))
    want = page_bytes(host, 0, 8)

    def worker(t: int) -> bool:
        ok = True
        for r in range(5):
            keys = names(f"conc-{t}-{r}", 2)
            ok &= b.batch_set_v1(keys, pages(host, 2 * t, 2)) == [True, True]
            ok &= b.batch_exists(keys) == 2
            ok &= b.batch_get_v1(keys, pages(host, 8 + 2 * t, 2)) == [True, True]
            ok &= same(page_bytes(host, 8 + 2 * t, 2), want[2 * t:2 * t + 2])
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))
    b.close()
