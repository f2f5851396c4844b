"""How loads reach their blocks: the batches of one job whose values arrive together are written
by one scatter (a launch costs the host as much as a small batch's copy), each job's by its own,
and every block gets its own value's bytes. Host KV tensors over a store the test answers by
hand (gated_store.py): which batches arrive together is decided by the test, not by timing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gated_store import GatedStore, deliver
from helpers import entries
from layouts import LAYOUTS, block_bytes

from memkv_vllm.offload import KVOffloader, PagedKV


@pytest.fixture
def kv() -> PagedKV:
    return LAYOUTS["kv_per_layer"](32, "cpu")


@pytest.fixture
def store() -> GatedStore:
    return GatedStore()


@pytest.fixture
def off(kv: PagedKV, store: GatedStore) -> Iterator[KVOffloader]:
    slot = -(-kv.max_value_bytes // 4096) * 4096
    o = KVOffloader(kv, store, scratch_bytes=16 * slot, batch_values=2)  # type: ignore[arg-type]
    yield o
    o.close()


@pytest.fixture
def scatters(off: KVOffloader) -> list[int]:
    """The number of values in each scatter the offloader's mover was asked for."""
    sizes: list[int] = []
    scatter: Callable[..., Any] = off.mover.scatter

    def counted(entries: Any, slots: Any, ready: Any) -> Any:
        sizes.append(len(entries))
        return scatter(entries, slots, ready)

    off.mover.scatter = counted  # type: ignore[method-assign]
    return sizes


def stored(kv: PagedKV, store: GatedStore, prefix: bytes, blocks: list[int]) -> None:
    """Values `prefix/i` in the cluster holding the bytes blocks `blocks` have now."""
    for i, b in enumerate(blocks):
        store.client.data[prefix + b"/%d" % i] = b"".join(block_bytes(kv, 0, b))


def test_a_jobs_batches_that_arrive_together_are_scattered_at_once(kv, store, off, scatters):
    src = list(range(8))
    stored(kv, store, b"a", src)
    want = [block_bytes(kv, 0, b) for b in src]
    dst = list(range(16, 24))
    off.submit_load(1, entries(b"a", 0, dst))
    ios = store.in_flight()
    assert len(ios) == 4  # 8 values, 2 per batch
    deliver(off, store, ios[0].io_id)  # the first arrives alone
    store.answer_together([io.io_id for io in ios[1:]])  # the other three in one poll
    assert off.drain(10)
    [r] = off.poll()
    assert r.ok and not r.failed_block_ids
    assert scatters == [2, 6]
    assert [block_bytes(kv, 0, b) for b in dst] == want


def test_batches_of_two_jobs_arriving_together_get_a_scatter_each(kv, store, off, scatters):
    stored(kv, store, b"a", [0, 1])
    stored(kv, store, b"b", [2, 3])
    want = [block_bytes(kv, 0, b) for b in (0, 1, 2, 3)]
    off.submit_load(1, entries(b"a", 0, [16, 17]))
    off.submit_load(2, entries(b"b", 0, [18, 19]))
    store.answer_together([io.io_id for io in store.in_flight()])
    assert off.drain(10)
    assert sorted((r.job_id, r.ok) for r in off.poll()) == [(1, True), (2, True)]
    assert scatters == [2, 2]
    assert [block_bytes(kv, 0, b) for b in (16, 17, 18, 19)] == want


def test_only_the_values_that_arrived_are_scattered(kv, store, off, scatters):
    """A batch that failed joins no scatter; its blocks keep their bytes and are reported."""
    stored(kv, store, b"a", [0, 1, 2, 3])
    before = block_bytes(kv, 0, 19)
    off.submit_load(1, entries(b"a", 0, [16, 17, 18, 19]))
    first, second = store.in_flight()
    store.client.data.pop(b"a/3")  # evicted meanwhile: NOT_FOUND
    store.answer_together([first.io_id, second.io_id])
    assert off.drain(10)
    [r] = off.poll()
    assert not r.ok and r.failed_block_ids == (19,)
    assert scatters == [3]
    assert [block_bytes(kv, 0, b) for b in (16, 17, 18)] == [
        block_bytes(kv, 0, b) for b in (0, 1, 2)]
    assert block_bytes(kv, 0, 19) == before
