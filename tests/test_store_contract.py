"""The `Offloader` contract of interface.py, checked on `BlockStore` with a fake client and a
hand-driven clock: no server, no vLLM, no sleeps. (test_store.py runs it against a real server.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from fakes import FakeClient, FakeClock, RegisteringFakeClient, ShardedFakeClient

from memkv_vllm.core.interface import Lookup, Offloader, Status
from memkv_vllm.core.store import BlockStore, StoreOptions

ROW = 64


class Rig:
    """A store over a fake cluster, with one registered pool of rows."""

    def __init__(self, client: FakeClient | None = None, rows: int = 16, **opts) -> None:
        self.clock = FakeClock()
        self.client = client if client is not None else FakeClient()
        self.pool = np.zeros((rows, ROW), dtype=np.uint8)
        opts.setdefault("n_read_threads", 2)
        opts.setdefault("n_write_threads", 2)
        self.store = BlockStore(self.client, StoreOptions(**opts), clock=self.clock)
        self.base = self.pool.ctypes.data
        self.store.register_buffer(self.base, self.pool.nbytes, owner=self.pool)

    def ptrs(self, slots: list[int]) -> list[int]:
        return [self.base + s * ROW for s in slots]

    def put(self, job_id: int, keys: list[bytes], slots: list[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.pool[s] = np.frombuffer(k.ljust(ROW, b"."), dtype=np.uint8)
        self.store.submit_store(job_id, keys, self.ptrs(slots), [ROW] * len(keys))

    def get(self, job_id: int, keys: list[bytes], slots: list[int]) -> None:
        self.store.submit_load(job_id, keys, self.ptrs(slots), [ROW] * len(keys))

    def finish(self) -> list:
        assert self.store.drain(timeout=10)
        return self.store.poll()

    def decide(self, keys: list[bytes]) -> list[Lookup]:
        """Look up, flush one probe, look up again (the fake answers at once)."""
        first = [self.store.lookup(k) for k in keys]
        self.store.flush_lookups()
        return first + [self.store.lookup(k) for k in keys]


@pytest.fixture
def rig() -> Iterator[Rig]:
    made: list[Rig] = []

    def make(**kw) -> Rig:
        r = Rig(**kw)
        made.append(r)
        return r

    yield make  # type: ignore[misc]
    for r in made:
        r.store.close()


def test_block_store_implements_the_offloader_protocol() -> None:
    names = [n for n in dir(Offloader) if not n.startswith("_")]
    assert names and all(callable(getattr(BlockStore, n, None)) for n in names)


def test_verdicts_live_for_their_ttl_then_are_probed_again(rig) -> None:
    r = rig(hit_ttl_s=30.0, miss_ttl_s=1.0)
    r.client.data[b"a"] = b"x" * ROW
    assert r.decide([b"a", b"b"]) == [Lookup.PENDING] * 2 + [Lookup.HIT, Lookup.MISS]
    r.clock.advance(0.99)
    assert [r.store.lookup(k) for k in (b"a", b"b")] == [Lookup.HIT, Lookup.MISS]
    r.clock.advance(0.02)  # the MISS expired: another engine may have stored it meanwhile
    r.client.data[b"b"] = b"y" * ROW
    assert r.store.lookup(b"b") is Lookup.PENDING
    r.store.flush_lookups()
    assert r.store.lookup(b"b") is Lookup.HIT
    r.clock.advance(29.0)  # a's HIT (set at t0) expires at t0 + 30
    assert r.store.lookup(b"a") is Lookup.PENDING
    assert r.store.stats()["probes"] == 2


def test_an_unanswered_probe_is_a_miss_at_its_deadline(rig) -> None:
    r = rig(client=FakeClient(auto_answer=False), lookup_timeout_s=5.0)
    r.client.data[b"k"] = b"x" * ROW
    assert r.store.lookup(b"k") is Lookup.PENDING
    r.store.flush_lookups()
    r.clock.advance(4.999)
    assert r.store.lookup(b"k") is Lookup.PENDING and r.store.has_pending_lookups()
    r.clock.advance(0.002)
    assert r.store.lookup(b"k") is Lookup.MISS
    assert not r.store.has_pending_lookups()
    assert r.store.stats()["lookup_timeouts"] == 1
    r.client.probes[0].answer()  # a late answer changes nothing
    assert r.store.lookup(b"k") is Lookup.MISS


def test_a_silent_server_turns_only_its_own_keys_into_misses(rig) -> None:
    """One probe per server: the answering servers' verdicts come when they answer, the silent
    server's keys miss at the lookup deadline, and the batch is still counted as one probe."""
    r = rig(client=ShardedFakeClient(auto_answer=False), lookup_timeout_s=5.0)
    keys = [b"a1", b"b1", b"a2", b"c1"]
    for k in keys:
        r.client.data[k] = b"x" * ROW
    assert [r.store.lookup(k) for k in keys] == [Lookup.PENDING] * 4
    r.store.flush_lookups()
    by_first = {p.keys[0][:1]: p for p in r.client.probes}
    assert {k: p.keys for k, p in by_first.items()} == {
        b"a": [b"a1", b"a2"], b"b": [b"b1"], b"c": [b"c1"]}
    by_first[b"a"].answer()
    by_first[b"c"].answer()  # b's server is partitioned: its probe never answers
    assert [r.store.lookup(k) for k in keys] == [
        Lookup.HIT, Lookup.PENDING, Lookup.HIT, Lookup.HIT]
    r.clock.advance(5.001)
    assert r.store.lookup(b"b1") is Lookup.MISS
    st = r.store.stats()
    assert (st["probes"], st["probe_keys"], st["lookup_timeouts"]) == (1, 4, 1)


def test_probe_of_many_keys_is_one_batch_and_cancelled_keys_are_not_sent(rig) -> None:
    r = rig()
    for k in (b"a", b"b", b"c"):
        assert r.store.lookup(k) is Lookup.PENDING
    r.store.cancel_lookups([b"b", b"zz"])
    r.store.flush_lookups()
    assert [p.keys for p in r.client.probes] == [[b"a", b"c"]]
    assert r.store.stats()["lookups_cancelled"] == 1
    r.store.flush_lookups()  # nothing queued: no empty probe
    assert len(r.client.probes) == 1


def test_a_probe_that_raises_or_cannot_start_is_a_miss(rig) -> None:
    class Broken(FakeClient):
        def submit_exists(self, keys, lease_ms=0):
            raise ConnectionError("down")

    r = rig(client=Broken())
    assert r.decide([b"a"]) == [Lookup.PENDING, Lookup.MISS]
    assert r.store.stats()["lookup_errors"] == 1
    none = BlockStore(None, clock=FakeClock())
    try:
        none.lookup(b"a")
        none.flush_lookups()
        assert none.lookup(b"a") is Lookup.MISS
    finally:
        none.close()


def test_round_trip_moves_the_bytes_and_stored_keys_become_hits(rig) -> None:
    r = rig(blocks_per_op=2)
    keys = [b"k%d" % i for i in range(5)]
    r.put(1, keys, [0, 1, 2, 3, 4])
    [c] = r.finish()
    assert (c.job_id, c.is_load, c.ok, c.nbytes) == (1, False, True, 5 * ROW)
    assert set(c.ok_keys) == set(keys)
    assert [r.store.lookup(k) for k in keys] == [Lookup.HIT] * 5  # no probe needed
    r.get(2, keys, [10, 11, 12, 13, 14])
    [c] = r.finish()
    assert c.ok and c.is_load and c.ok_keys == tuple(keys)
    assert np.array_equal(r.pool[10:15], r.pool[0:5])
    # blocks_per_op: 3 puts (2+2+1) and 3 gets
    assert len(r.client.transfers) == 6


def test_keys_known_present_are_not_stored_again(rig) -> None:
    r = rig()
    r.put(1, [b"a"], [0])
    r.finish()
    r.put(2, [b"a", b"b"], [0, 1])
    [c] = r.finish()
    assert c.ok and set(c.ok_keys) == {b"a", b"b"} and c.nbytes == ROW
    assert r.client.transfers[-1] == ("put", [b"b"])
    assert r.store.stats()["store_blocks_skipped"] == 1


def test_stores_past_the_backlog_are_shed_and_loads_never(rig) -> None:
    r = rig(max_store_backlog_bytes=2 * ROW)
    r.client.data[b"old"] = b"o" * ROW
    r.client.gate = threading.Event()  # transfers hang: the backlog stays full
    r.put(1, [b"a", b"b"], [0, 1])  # exactly the cap: accepted
    assert r.store.stats()["store_backlog_bytes"] == 2 * ROW
    r.put(2, [b"c"], [2])  # over the cap: shed at once, nothing sent
    [shed] = r.store.poll()
    assert shed.job_id == 2 and shed.shed and not shed.ok and shed.ok_keys == ()
    r.get(3, [b"old"], [5])  # a full store backlog never sheds a load
    r.client.gate.set()
    done = {c.job_id: c for c in r.finish()}
    assert done[1].ok and done[3].ok and bytes(r.pool[5]) == b"o" * ROW
    st = r.store.stats()
    assert st["store_backlog_bytes"] == 0
    assert (st["store_jobs_shed"], st["store_blocks_shed"]) == (1, 1)
    assert ("put", [b"c"]) not in r.client.transfers


def test_failed_load_keys_are_reported_and_stay_misses(rig) -> None:
    r = rig(failed_load_miss_ttl_s=30.0)
    r.client.data[b"a"] = b"a" * ROW
    r.client.data[b"c"] = b"c" * ROW
    r.client.fail[b"c"] = Status.CORRUPT
    r.get(1, [b"a", b"gone", b"c"], [0, 1, 2])
    [c] = r.finish()
    assert not c.ok and c.ok_keys == (b"a",) and c.nbytes == ROW
    assert c.gone_keys == (b"gone",)  # CORRUPT is not proof the value is gone
    assert bytes(r.pool[0]) == b"a" * ROW
    assert not r.pool[1].any() and not r.pool[2].any()  # failed keys leave memory unwritten
    r.clock.advance(29.9)
    assert r.store.lookup(b"gone") is Lookup.MISS and r.store.lookup(b"c") is Lookup.MISS
    r.clock.advance(0.2)
    assert r.store.lookup(b"c") is Lookup.PENDING
    st = r.store.stats()
    assert (st["load_blocks_ok"], st["load_blocks_failed"]) == (1, 2)


def test_a_client_that_raises_fails_the_keys_of_that_call_only(rig) -> None:
    r = rig()
    r.client.raise_on_transfer = True
    r.put(1, [b"a"], [0])
    r.get(2, [b"a"], [1])
    done = {c.job_id: c for c in r.finish()}
    assert not done[1].ok and not done[2].ok and done[1].ok_keys == ()
    r.client.raise_on_transfer = False
    r.put(3, [b"a"], [0])  # the pools survived
    [c] = r.finish()
    assert c.ok


@pytest.mark.parametrize("status", [Status.TIMEOUT, Status.UNAVAILABLE])
def test_a_timed_out_load_completes_as_soon_as_its_call_returned(rig, status) -> None:
    # The client writes nothing once a call returned (BlockClient), timed out or not, so the
    # job's memory is the caller's again at once: drain then poll returns every job.
    r = rig()
    r.client.data[b"a"] = b"a" * ROW
    r.client.fail[b"a"] = status
    r.client.during_call = lambda n: r.clock.advance(30.0)  # ran into the op deadline
    r.get(1, [b"a"], [0])
    assert r.store.drain(timeout=5)
    [c] = r.store.poll()
    assert c.job_id == 1 and not c.ok and c.gone_keys == ()
    assert not r.pool[0].any() and not r.store.has_pending_jobs()
    assert r.store.lookup(b"a") is Lookup.MISS  # not promoted again for a while


def test_a_value_of_the_wrong_length_is_deleted_at_load(rig) -> None:
    r = rig()
    r.client.data[b"short"] = b"s" * (ROW // 2)  # written by a client with another layout
    r.client.data[b"ok"] = b"k" * ROW
    r.get(1, [b"short", b"ok"], [0, 1])
    [c] = r.finish()
    assert c.ok_keys == (b"ok",) and c.gone_keys == (b"short",) and not r.pool[0].any()
    r.store.close()  # the delete runs on a store thread; close waits for the threads
    assert ("delete", [b"short"]) in r.client.transfers
    assert b"short" not in r.client.data and b"ok" in r.client.data
    assert r.store.stats()["load_blocks_deleted"] == 1


def test_the_verdict_cache_is_bounded_oldest_first(rig) -> None:
    r = rig(max_verdicts=3)
    r.client.data.update({k: b"." * ROW for k in (b"a", b"b", b"c", b"d")})
    r.decide([b"a", b"b", b"c", b"d"])
    assert [r.store.lookup(k) for k in (b"b", b"c", b"d")] == [Lookup.HIT] * 3
    assert r.store.lookup(b"a") is Lookup.PENDING  # evicted: probed again


def test_every_job_completes_exactly_once(rig) -> None:
    r = rig(blocks_per_op=1, rows=64)
    r.client.data.update({b"x%d" % i: b"." * ROW for i in range(0, 20, 2)})
    for j in range(20):
        if j % 2:
            r.put(j, [b"y%d" % j], [j])
        else:
            r.get(j, [b"x%d" % j, b"x%d" % (j + 1)], [20 + 2 * j % 40, 21 + 2 * j % 40])
    seen = [c.job_id for c in r.finish()]
    seen += [c.job_id for c in r.store.poll()]
    assert sorted(seen) == list(range(20))
    assert not r.store.has_pending_jobs()


def test_empty_jobs_and_jobs_after_close_complete_without_io(rig) -> None:
    r = rig()
    r.get(1, [], [])
    [c] = r.finish()
    assert c.ok and c.ok_keys == ()
    r.store.close()
    r.put(2, [b"a"], [0])
    [c] = r.finish()
    assert not c.ok and r.client.transfers == []


def test_registration_guards_memory_and_is_forwarded(rig) -> None:
    client = RegisteringFakeClient()
    r = rig(client=client)
    assert client.calls == [("register", r.base)]
    with pytest.raises(ValueError, match="not inside a registered buffer"):
        r.store.submit_load(1, [b"a"], [r.base + r.pool.nbytes - 8], [ROW])
    with pytest.raises(ValueError, match="overlaps"):
        r.store.register_buffer(r.base + ROW, ROW)
    other = np.zeros(ROW, dtype=np.uint8)
    r.store.register_buffer(other.ctypes.data, ROW, owner=other)
    client.gate = threading.Event()
    r.put(1, [b"a"], [0])
    with pytest.raises(ValueError, match="uncompleted"):
        r.store.unregister_buffer(r.base)
    client.gate.set()
    r.finish()
    r.store.unregister_buffer(r.base)  # completion returned: now allowed
    with pytest.raises(ValueError, match="no buffer"):
        r.store.unregister_buffer(r.base)
    with pytest.raises(ValueError, match="not inside"):  # memory of an unregistered buffer
        r.get(2, [b"a"], [0])
    r.store.close()  # ends the remaining registration too
    assert client.calls[-1] == ("unregister", other.ctypes.data) and client.registered == {}


def test_a_registration_the_client_refuses_raises_and_is_not_kept(rig) -> None:
    class Refusing(RegisteringFakeClient):
        def register_buffer(self, ptr: int, nbytes: int) -> None:
            raise OSError("cannot pin memory")

    r = rig(client=RegisteringFakeClient())
    refusing = BlockStore(Refusing(), clock=FakeClock())
    try:
        with pytest.raises(OSError):
            refusing.register_buffer(r.base, ROW)
        with pytest.raises(ValueError, match="not inside"):
            refusing.submit_store(1, [b"a"], [r.base], [ROW])
    finally:
        refusing.close()
