"""The worker-side logic of direct mode: vLLM's job geometry over host KV tensors, through
KVOffloader, against a real memkv server. Loads that fail never write a block and never raise;
they are reported as vLLM's selected connector can bear."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from memkv_vllm.core.client import MemKVClient  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.store import BlockStore, StoreOptions  # noqa: E402
from memkv_vllm.direct.keys import key_under  # noqa: E402
from memkv_vllm.direct.worker import DirectWorker, Finished, job_entries  # noqa: E402
from memkv_vllm.offload import Entry, KVOffloader, KVRef, PagedKV  # noqa: E402

PREFIX = b"mkD1" + bytes(16)
BPC = 2  # GPU blocks per chunk


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def kv_cache(num_blocks: int = 16, seed: int = 0, device: str = "cpu") -> PagedKV:
    """Two layers of 64-byte pages; group 0 is both layers, group 1 half of layer 1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(0, 255, (num_blocks, 64), dtype=torch.uint8, generator=g).to(device)
          for _ in range(2)]
    return PagedKV(ts, [[KVRef(0, 64), KVRef(1, 64)], [KVRef(1, 32)]], blocks_per_value=BPC)


def worker(address: str, kv: PagedKV, op_timeout_s: float = 10.0, slots: int = 8,
           **kw: object) -> DirectWorker:
    client = MemKVClient.from_config(load_config({"servers": [address],
                                                  "op_timeout_s": op_timeout_s}))
    store = BlockStore(client.codes, StoreOptions(n_read_threads=2, n_write_threads=2))
    off = KVOffloader(kv, store, medium="host", scratch_bytes=slots * 4096)
    return DirectWorker(off, PREFIX, rank=1, blocks_per_chunk=BPC, **kw)  # type: ignore[arg-type]


def finish(w: DirectWorker, job_id: int, timeout: float = 30.0) -> Finished:
    """The job's one answer; no other answer may exist."""
    assert w.offloader.drain(timeout)
    done = w.get_finished()
    assert [f.job_id for f in done] == [job_id]
    return done[0]


def block(kv: PagedKV, t: int, b: int) -> bytes:
    return kv.tensors[t][b].cpu().numpy().tobytes()


def test_job_geometry_follows_vllms_mapping() -> None:
    chunks = [(b"h%d" % i, g) for i, g in enumerate([0, 0, 3])]
    # Group 0: 3 blocks starting at logical index 1 (skip 1): chunks 0 (pos 1) and 1 (pos 0, 1).
    # Group 1 (key group 3): 2 blocks from index 4: one whole chunk.
    e = job_entries([10, 11, 12, 20, 21], [3, 2], [1, 4], chunks, BPC, PREFIX, 1)
    assert e == [Entry(key_under(PREFIX, b"h0", 0, 1), 0, (10,), first_pos=1),
                 Entry(key_under(PREFIX, b"h1", 0, 1), 0, (11, 12), first_pos=0),
                 Entry(key_under(PREFIX, b"h2", 3, 1), 1, (20, 21), first_pos=0)]
    with pytest.raises(ValueError):
        job_entries([10, 11], [2], [0], chunks, BPC, PREFIX, 1)  # more chunks than blocks use
    with pytest.raises(ValueError):
        job_entries([10], [2], [0], chunks[:1], BPC, PREFIX, 1)  # fewer blocks than named


@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_elsewhere_is_byte_exact_including_a_partial_first_chunk(memkv_server,
                                                                                 device):
    src, dst = kv_cache(seed=1, device=device), kv_cache(seed=2, device=device)
    ws, wd = worker(memkv_server.address, src), worker(memkv_server.address, dst)
    chunks = [(b"a", 0), (b"b", 0), (b"c", 1)]
    ws.submit_store(1, [2, 3, 4, 5, 6, 7], [4, 2], [0, 0], chunks)
    f = finish(ws, 1)
    assert f.success and f.nbytes == 2 * 256 + 64  # two group-0 values, one group-1 value
    # Load into other blocks, the first chunk of group 0 only from position 1 (its first block
    # is already in the destination's prefix cache).
    untouched = block(dst, 0, 9)
    wd.submit_load(2, [9 + 1, 11, 12, 13, 14], [3, 2], [1, 0], chunks)
    assert finish(wd, 2).success
    assert block(dst, 0, 9) == untouched
    assert [block(dst, t, b) for t in (0, 1) for b in (10, 11, 12)] == [
        block(src, t, b) for t in (0, 1) for b in (3, 4, 5)]
    assert [block(dst, 1, b)[:32] for b in (13, 14)] == [block(src, 1, b)[:32] for b in (6, 7)]
    assert wd.take_failed_block_ids() == set()
    ws.shutdown()
    wd.shutdown()


def test_a_chunk_covered_in_part_is_never_stored(memkv_server):
    w = worker(memkv_server.address, kv_cache())
    w.submit_store(1, [2, 3, 4], [3], [1], [(b"x", 0), (b"y", 0)])  # x would lack position 0
    assert finish(w, 1).success
    stats = memkv_server.stats()
    assert stats["puts"] == 1 and stats["items"] == 1
    w.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_load_writes_nothing_and_is_reported_as_the_route_allows(memkv_server, device):
    kv = kv_cache(device=device)
    w = worker(memkv_server.address, kv)
    before = [block(kv, t, b) for t in (0, 1) for b in range(16)]
    w.submit_load(1, [4, 5], [2], [0], [(b"absent", 0)])
    assert finish(w, 1).success is False  # stock connector: no way to recompute
    w.recompute_failed_loads = True  # a connector that reports load errors to vLLM
    w.submit_load(2, [6, 7], [2], [0], [(b"absent", 0)])
    assert finish(w, 2).success is True
    assert w.take_failed_block_ids() == {6, 7}
    assert w.take_failed_block_ids() == set()  # each failure is reported once
    assert [block(kv, t, b) for t in (0, 1) for b in range(16)] == before
    w.shutdown()


def test_a_malformed_job_is_answered_once_and_never_raises(memkv_server):
    w = worker(memkv_server.address, kv_cache())
    w.recompute_failed_loads = True
    w.submit_load(1, [4, 5], [2], [0], [])  # no chunk for its blocks
    w.submit_store(2, [99, 100], [2], [0], [(b"x", 0)])  # block ids out of range
    done = w.get_finished()
    assert sorted(f.job_id for f in done) == [1, 2] and all(f.success for f in done)
    assert w.take_failed_block_ids() == {4, 5}
    assert w.get_finished() == []
    w.shutdown()


def test_wait_gives_up_a_load_stuck_on_a_frozen_server_and_it_never_writes(memkv_server):
    src = kv_cache(seed=3)
    ws = worker(memkv_server.address, src)
    ws.submit_store(1, [0, 1], [2], [0], [(b"f", 0)])
    assert finish(ws, 1).success
    ws.shutdown()
    kv = kv_cache(seed=4)
    w = worker(memkv_server.address, kv, op_timeout_s=3.0, wait_timeout_s=0.3)
    w.recompute_failed_loads = True
    before = [block(kv, t, b) for t in (0, 1) for b in (8, 9)]
    with memkv_server.frozen():
        w.submit_load(2, [8, 9], [2], [0], [(b"f", 0)])
        t0 = time.monotonic()
        w.wait({2})  # jumps the queue, then gives up after wait_timeout_s
        assert time.monotonic() - t0 < 2.0
    f = finish(w, 2)  # the value may still arrive: it must not be written any more
    assert f.success and w.take_failed_block_ids() == {8, 9}
    assert [block(kv, t, b) for t in (0, 1) for b in (8, 9)] == before
    w.shutdown()


def test_a_job_named_in_wait_jumps_the_queue(memkv_server):
    src = kv_cache(seed=5)
    ws = worker(memkv_server.address, src)
    chunks = [(b"q%d" % i, 0) for i in range(8)]
    ws.submit_store(1, list(range(16)), [16], [0], chunks)
    assert finish(ws, 1).success
    ws.shutdown()
    w = worker(memkv_server.address, kv_cache(seed=6), slots=1)  # one value at a time
    w.submit_load(1, list(range(16)), [16], [0], chunks)  # eight values, one after another
    w.submit_load(2, [0, 1], [2], [0], chunks[:1])  # queued behind all of job 1
    w.wait({2})
    done = w.get_finished()
    assert [f.job_id for f in done] == [2]  # job 1 still has values waiting for the slot
    assert w.offloader.drain(30) and [f.job_id for f in w.get_finished()] == [1]
    w.shutdown()


@pytest.mark.parametrize("recompute", [False, True], ids=["stock", "recompute"])
def test_a_wait_that_gives_up_queued_loads_raises_nothing_and_answers_them_failed(memkv_server,
                                                                                   recompute):
    """Every value of job 2 still waits behind job 1's, stuck on a frozen server, when
    memkv_wait_timeout_s passes. Giving job 2 up answers it at once as a failed load, and `wait`
    returns normally (it raised "cannot notify on un-acquired lock" into vLLM's worker)."""
    kv = kv_cache(seed=7)
    w = worker(memkv_server.address, kv, slots=1, wait_timeout_s=0.2)
    try:
        w.recompute_failed_loads = recompute
        before = [block(kv, t, b) for t in (0, 1) for b in range(16)]
        with memkv_server.frozen():
            w.submit_load(1, [2, 3], [2], [0], [(b"first", 0)])  # the only slot, on the network
            w.submit_load(2, [8, 9, 10, 11], [4], [0], [(b"a", 0), (b"b", 0)])  # queued behind
            w.wait({2})
            (f,) = w.get_finished()
            assert (f.job_id, f.success, f.nbytes) == (2, recompute, 0)
            assert w.take_failed_block_ids() == ({8, 9, 10, 11} if recompute else set())
        assert finish(w, 1).success is recompute  # "first" was never stored: failed too
        assert w.take_failed_block_ids() == ({2, 3} if recompute else set())
        assert w.get_finished() == [] and not w.has_pending_jobs()
        assert [block(kv, t, b) for t in (0, 1) for b in range(16)] == before
    finally:
        w.shutdown()
