"""The scheduler-side logic of direct mode against a real memkv server: lookups across TP ranks
with leases, cached verdicts on an injected clock, loads that renew leases, store selection."""

from __future__ import annotations

import time

import pytest

from memkv_vllm.core.backends import store_for
from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import load_config
from memkv_vllm.core.interface import Lookup
from memkv_vllm.direct.keys import key_under
from memkv_vllm.direct.manager import DirectManager

PREFIX = b"mkD1" + bytes(range(16))


def split(key: bytes) -> tuple[bytes, int]:  # vLLM's OffloadKey: hash | group (u32 BE)
    return key[:-4], int.from_bytes(key[-4:], "big")


def chunk(i: int, group: int = 0) -> bytes:
    return b"hash-%04d" % i + group.to_bytes(4, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(address: str, tp: int = 1, clock: Clock | None = None, **opts: object
         ) -> tuple[DirectManager, MemKVClient]:
    cfg = load_config({"servers": [address], "lease_ms": 10_000})
    client = MemKVClient.from_config(cfg)
    clock = clock or Clock()
    store = store_for(client, cfg, n_read_threads=1, n_write_threads=1, clock=clock, **opts)
    return DirectManager(store, PREFIX, tp, split, clock=clock), client


def put_chunk(client: MemKVClient, key: bytes, ranks: range) -> None:
    h, g = split(key)
    keys = [key_under(PREFIX, h, g, r) for r in ranks]
    assert client.put(keys, [b"v" * 64] * len(keys)) == [0] * len(keys)


def settle(m: DirectManager, key: bytes, timeout: float = 10.0) -> Lookup:
    """Ask until the probe answered (what vLLM does, one scheduler step at a time)."""
    deadline = time.monotonic() + timeout
    while True:
        v = m.lookup(key, "req")
        if v is not Lookup.PENDING:
            return v
        assert time.monotonic() < deadline, "probe never answered"
        m.on_schedule_end()
        m.store.wait_any(0.01)


def test_a_chunk_is_a_hit_only_when_every_rank_holds_it_and_hits_are_leased(memkv_server):
    m, client = make(memkv_server.address, tp=2)
    put_chunk(client, chunk(1), range(2))
    put_chunk(client, chunk(2), range(1))  # rank 1's value is missing
    before = memkv_server.stats()["leases_granted"]
    assert m.lookup(chunk(1), "req") is Lookup.PENDING
    assert m.lookup(chunk(2), "req") is Lookup.PENDING
    m.on_schedule_end()  # one probe for this step's keys
    assert settle(m, chunk(1)) is Lookup.HIT
    assert settle(m, chunk(2)) is Lookup.MISS
    assert memkv_server.stats()["leases_granted"] - before == 3  # every value found is leased
    m.shutdown()


def test_verdicts_are_cached_for_their_ttl(memkv_server):
    clock = Clock()
    m, client = make(memkv_server.address, clock=clock, miss_ttl_s=30.0, hit_ttl_s=30.0)
    assert settle(m, chunk(7)) is Lookup.MISS
    put_chunk(client, chunk(7), range(1))
    clock.now += 29.0
    assert m.lookup(chunk(7), "req") is Lookup.MISS  # still the cached verdict: no probe
    clock.now += 2.0
    assert m.lookup(chunk(7), "req") is Lookup.PENDING  # expired: asked again
    m.on_schedule_end()
    assert settle(m, chunk(7)) is Lookup.HIT
    m.shutdown()


def test_prepare_load_renews_the_leases_and_keeps_the_engine_stepping(memkv_server):
    m, client = make(memkv_server.address, tp=2)
    keys = [chunk(1), chunk(1, group=1)]
    for k in keys:
        put_chunk(client, k, range(2))
    before = memkv_server.stats()["leases_granted"]
    assert m.prepare_load(keys) == [split(k) for k in keys]  # in the order of the keys
    assert m.has_pending_work()
    deadline = time.monotonic() + 10
    while memkv_server.stats()["leases_granted"] - before < 4:
        assert time.monotonic() < deadline, "prepare_load leased nothing"
        time.sleep(0.05)
    m.complete_load(keys)
    m.on_schedule_end()
    assert not m.has_pending_work()
    m.shutdown()


def test_prepare_store_skips_what_is_stored_or_being_stored_and_keeps_order(memkv_server):
    m, client = make(memkv_server.address)
    put_chunk(client, chunk(3), range(1))
    assert settle(m, chunk(3)) is Lookup.HIT
    assert m.prepare_store([chunk(5), chunk(3), chunk(4)]) == [chunk(5), chunk(4)]
    assert m.prepare_store([chunk(4), chunk(6)]) == [chunk(6)]  # 4 is being stored
    assert m.store_details([chunk(6)]) == [split(chunk(6))]
    m.complete_store([chunk(5), chunk(4)])
    assert m.stored_events == [[chunk(5), chunk(4)]]
    assert m.prepare_store([chunk(4), chunk(5)]) == []  # stored by this engine just now
    m.reset_cache()  # vLLM dropped every job: nothing is in flight any more
    assert m.prepare_store([chunk(6)]) == [chunk(6)]
    m.shutdown()


def test_an_unreachable_cluster_is_a_miss(memkv_server):
    m, _ = make(memkv_server.address)
    memkv_server.kill()
    assert settle(m, chunk(1)) is Lookup.MISS
    m.prepare_load([chunk(1)])  # renewing leases fails quietly; the load itself will fail
    m.shutdown()


def test_tp_size_must_be_positive():
    with pytest.raises(ValueError):
        DirectManager(store_for(None, load_config({})), PREFIX, 0, split)


def test_a_value_the_lease_renewal_does_not_find_turns_into_a_miss(memkv_server):
    m, client = make(memkv_server.address, hit_ttl_s=30.0)
    put_chunk(client, chunk(8), range(1))
    assert settle(m, chunk(8)) is Lookup.HIT
    h, g = split(chunk(8))
    client.delete([key_under(PREFIX, h, g, 0)])  # gone between lookup and load
    assert m.lookup(chunk(8), "req") is Lookup.HIT  # the cached verdict does not know yet
    m.prepare_load([chunk(8)])
    deadline = time.monotonic() + 10
    while m.lookup(chunk(8), "req") is Lookup.HIT:  # the renewal's answer arrives
        assert time.monotonic() < deadline, "the lost value is still a hit"
        m.on_schedule_end()
        time.sleep(0.01)
    assert m.lookup(chunk(8), "req") is Lookup.MISS  # the next request recomputes instead
    m.complete_load([chunk(8)])
    m.shutdown()
