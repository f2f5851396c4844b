"""Waiting for jobs, jumping them ahead, and giving them up (`KVOffloader.wait`, `prioritize`,
`abandon`), with host KV tensors over a store the test answers by hand (gated_store.py): which
values are queued, on the network or arrived is decided by the test, not by timing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from gated_store import GatedStore, deliver
from helpers import entries
from layouts import LAYOUTS, all_bytes, block_bytes

from memkv_vllm.offload import Entry, JobResult, KVOffloader, PagedKV

MARK = 0xEE  # what the caller writes into blocks it took back


@pytest.fixture
def kv() -> PagedKV:
    return LAYOUTS["kv_per_layer"](16, "cpu")


@pytest.fixture
def store() -> GatedStore:
    return GatedStore()


@pytest.fixture
def make(kv: PagedKV, store: GatedStore) -> Iterator[Callable[..., KVOffloader]]:
    """Offloaders over `store` with `slots` scratch slots, closed after the test (its values
    still on the network fail first, so that close need not wait for them)."""
    made: list[KVOffloader] = []

    def build(slots: int, batch_values: int = 1) -> KVOffloader:
        slot = -(-kv.max_value_bytes // 4096) * 4096
        made.append(KVOffloader(kv, store, scratch_bytes=slots * slot,  # type: ignore[arg-type]
                                batch_values=batch_values))
        return made[-1]

    yield build
    for off in made:
        while io := store.in_flight():  # queued values go out as others are answered
            deliver(off, store, io[0].io_id, ok=False)
        off.close()
    assert store.closed  # the offloader owns its store


@pytest.fixture
def one_slot(make: Callable[..., KVOffloader]) -> KVOffloader:
    """One value on the network at a time: everything else waits in the queues."""
    return make(slots=1)


def keep(kv: PagedKV, key: bytes, block: int, store: GatedStore) -> None:
    """Put `block`'s bytes into the cluster as `key` (what a store of it would have left)."""
    store.client.data[key] = b"".join(block_bytes(kv, 0, block))


def reuse(kv: PagedKV, blocks: list[int]) -> None:
    """The caller gives the blocks to someone else, who writes them."""
    for t in kv.tensors:
        for b in blocks:  # one at a time: indexing by a list would fill a copy
            t[b].view(torch.uint8).fill_(MARK)


def reused(kv: PagedKV, blocks: list[int]) -> bool:
    return all(bool((t[blocks].view(torch.uint8) == MARK).all()) for t in kv.tensors)


def in_flight_keys(store: GatedStore) -> list[bytes]:
    return [k for io in store.in_flight() for k in io.keys]


@pytest.mark.parametrize("load", [True, False], ids=["load", "store"])
def test_giving_up_a_job_whose_values_all_wait_for_a_slot_answers_it_at_once(
        kv, store, one_slot, load):
    """Every value of job 2 is still queued behind job 1's: `abandon` fails them all and the job
    finishes there and then (this raised "cannot notify on un-acquired lock" into the caller)."""
    off = one_slot
    before = all_bytes(kv)
    off.submit_load(1, [Entry(b"first", 0, (1,))])  # takes the only slot
    (off.submit_load if load else off.submit_store)(2, entries(b"q", 0, [4, 5]))
    assert in_flight_keys(store) == [b"first"]
    assert not off.wait([2], timeout=0)
    off.abandon([2])
    (r,) = off.poll()
    assert (r.job_id, r.is_load, r.ok, r.ok_keys) == (2, load, False, ())
    assert sorted(r.failed_block_ids) == [4, 5] and r.nbytes == 0
    assert off.wait([2], timeout=0)  # finished: nothing of it touches a block any more
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    (r1,) = off.poll()
    assert r1.job_id == 1 and r1.failed_block_ids == (1,)  # "first" is not in the cluster
    assert store.in_flight() == [] and not off.has_pending_jobs()
    assert all_bytes(kv) == before and b"q/0" not in store.client.data


def test_a_waiter_wakes_when_the_store_it_waits_for_is_given_up(kv, store, one_slot):
    """s/0 is copied out and on the network, s/1 queued. Giving the store up means nothing reads
    its blocks any more: a thread blocked in `wait` on it returns, with no other progress (no
    answer from the store) to wake it."""
    off = one_slot
    off.submit_store(2, entries(b"s", 0, [4, 5]))
    assert in_flight_keys(store) == [b"s/0"] and not off.wait([2], timeout=0)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(off.wait([2], timeout=60)),
                              daemon=True)
    waiter.start()
    off.abandon([2])
    waiter.join(30)
    assert woke == [True]
    assert off.poll() == []  # s/0 is still on its way
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    (r,) = off.poll()
    assert (r.job_id, r.ok_keys, r.failed_block_ids) == (2, (b"s/0",), (5,))


def test_a_load_given_up_on_the_network_never_writes_its_blocks(kv, store, make):
    off = make(slots=2)
    for i, b in enumerate((1, 2)):
        keep(kv, b"v%d" % i, b, store)
    off.submit_load(7, [Entry(b"v0", 0, (9,)), Entry(b"v1", 0, (10,))])
    assert in_flight_keys(store) == [b"v0", b"v1"]
    assert not off.wait([7], timeout=0)
    off.abandon([7])
    assert off.poll() == []  # its values are still on the network
    reuse(kv, [9, 10])
    for io in store.in_flight():
        deliver(off, store, io.io_id)
    (r,) = off.poll()
    assert (r.job_id, r.ok, r.ok_keys, sorted(r.failed_block_ids)) == (7, False, (), [9, 10])
    assert reused(kv, [9, 10])


def test_a_job_given_up_in_part_fails_what_had_not_arrived(kv, store, one_slot):
    """One value of each job is on the network, the rest queued. The load writes nothing once
    given up; the store no longer reads its blocks, and what it had sent still lands."""
    off = one_slot
    for i, b in enumerate((1, 2, 3)):
        keep(kv, b"v%d" % i, b, store)
    off.submit_load(1, [Entry(b"v%d" % i, 0, (8 + i,)) for i in range(3)])
    assert not off.wait([1], timeout=0)
    off.abandon([1])
    assert off.poll() == [] and not off.wait([1], timeout=0)  # v0 may still arrive
    reuse(kv, [8, 9, 10])
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    (r,) = off.poll()
    assert (r.ok, r.ok_keys, sorted(r.failed_block_ids)) == (False, (), [8, 9, 10])
    assert reused(kv, [8, 9, 10])

    want = b"".join(block_bytes(kv, 0, 4))
    off.submit_store(2, entries(b"s", 0, [4, 5, 6]))
    assert in_flight_keys(store) == [b"s/0"]
    off.abandon([2])
    assert off.wait([2], timeout=0)  # s/0 is copied out; nothing else will be read
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    (r,) = off.poll()
    assert (r.ok, r.ok_keys, sorted(r.failed_block_ids)) == (False, (b"s/0",), [5, 6])
    assert set(store.client.data) == {b"v0", b"v1", b"v2", b"s/0"}
    assert store.client.data[b"s/0"] == want


def test_prioritized_jobs_go_next_loads_still_before_stores(kv, store, one_slot):
    off = one_slot
    off.submit_load(1, entries(b"a", 0, [1, 2]))  # a/0 on the network, a/1 queued
    off.submit_load(2, entries(b"b", 0, [3]))
    off.submit_load(3, entries(b"c", 0, [4]))
    off.submit_store(4, entries(b"d", 0, [5]))
    off.submit_store(5, entries(b"e", 0, [6]))
    off.prioritize([5, 3, 99])  # 99: unknown, ignored
    order = []
    while store.in_flight():
        (io,) = store.in_flight()
        order += io.keys
        deliver(off, store, io.io_id)
    assert order == [b"a/0", b"c/0", b"a/1", b"b/0", b"e/0", b"d/0"]
    assert sorted(r.job_id for r in off.poll()) == [1, 2, 3, 4, 5]


def test_a_wait_that_times_out_gives_nothing_up(kv, store, one_slot):
    off = one_slot
    keep(kv, b"v", 1, store)
    off.submit_load(1, [Entry(b"v", 0, (9,))])
    assert not off.wait([1], timeout=0.05)
    assert not off.wait([1, 404], timeout=0)  # unknown ids do not help
    assert off.poll() == []
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    assert off.wait([1, 404], timeout=0)
    (r,) = off.poll()
    assert isinstance(r, JobResult) and r.ok and r.ok_keys == (b"v",)
    assert block_bytes(kv, 0, 9) == block_bytes(kv, 0, 1)


def test_giving_up_finished_or_unknown_jobs_changes_nothing(kv, store, one_slot):
    off = one_slot
    off.submit_store(1, entries(b"s", 0, [2]))
    (io,) = store.in_flight()
    deliver(off, store, io.io_id)
    off.prioritize([1, 2])
    off.abandon([1, 2])
    (r,) = off.poll()
    assert r.job_id == 1 and r.ok and off.poll() == []
