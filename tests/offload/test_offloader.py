"""The direct-mode offloader core with host KV tensors against a real memkv server: byte-exact
round trips in every layout, partial values, failures as values, scratch smaller than a job."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from helpers import entries, offloader, run, until
from layouts import LAYOUTS, all_bytes, block_bytes

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import load_config
from memkv_vllm.offload import Entry, KVRef, PagedKV


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_byte_exact_and_writes_nothing_else(memkv_server, layout):
    kv = LAYOUTS[layout](32, "cpu")
    off = offloader(memkv_server.address, kv)
    src, dst = [3, 17, 0, 31, 8], [20, 21, 1, 5, 30]
    groups = range(len(kv.groups))
    for g in groups:
        r = run(off, 10 + g, entries(b"g%d" % g, g, src), load=False)
        assert r.ok and r.failed_block_ids == () and r.nbytes == len(src) * kv.value_bytes[g]
    want = {g: [block_bytes(kv, g, b) for b in src] for g in groups}
    for t in kv.tensors:  # the source blocks may be reused: loads must not need them
        t.view(torch.uint8).fill_(0x5A)
    before = all_bytes(kv)
    for g in groups:
        r = run(off, 20 + g, [Entry(e.key, g, (d,)) for e, d in
                              zip(entries(b"g%d" % g, g, src), dst, strict=True)], load=True)
        assert r.ok and set(r.ok_keys) == {b"g%d/%d" % (g, i) for i in range(len(src))}
        assert [block_bytes(kv, g, b) for b in dst] == want[g]
    # Only the destination blocks' stored bytes changed: padding and other blocks are intact.
    after = all_bytes(kv)
    for t_idx, (b0, b1) in enumerate(zip(before, after, strict=True)):
        pitch = kv.pitch[t_idx]
        stored = {r.nbytes for g in groups for r in kv.groups[g] if r.tensor == t_idx}
        for blk in range(kv.num_blocks[t_idx]):
            lo, hi = blk * pitch, (blk + 1) * pitch
            if blk in dst:
                hi = lo + max(stored)
                assert b0[hi:(blk + 1) * pitch] == b1[hi:(blk + 1) * pitch]
            else:
                assert b0[lo:hi] == b1[lo:hi], f"tensor {t_idx} block {blk} was written"
    off.close()


def test_value_layout_is_ref_major_sub_blocks(memkv_server):
    """The stored value is each ref's bytes of sub-block 0, 1, ... in ref order (the layout the
    docs promise; another reader of the cluster depends on it)."""
    kv = LAYOUTS["padded_two_groups"](8, "cpu", bpv=2)
    off = offloader(memkv_server.address, kv)
    assert run(off, 1, [Entry(b"v", 1, (5, 2))], load=False).ok
    off.close()
    raw = np.zeros(kv.value_bytes[1], dtype=np.uint8)
    client = MemKVClient.from_config(load_config({"servers": [memkv_server.address]}))
    assert client.get_into([b"v"], [raw]) == [Status.OK]
    (a5, b5), (a2, b2) = block_bytes(kv, 1, 5), block_bytes(kv, 1, 2)
    assert raw.tobytes() == a5 + a2 + b5 + b2


def test_partial_values_load_the_tail_sub_blocks(memkv_server):
    kv = LAYOUTS["kv_per_layer"](16, "cpu", bpv=4)
    off = offloader(memkv_server.address, kv)
    assert run(off, 1, [Entry(b"chunk", 0, (4, 9, 2, 7))], load=False).ok
    want = [block_bytes(kv, 0, b) for b in (2, 7)]
    r = run(off, 2, [Entry(b"chunk", 0, (12, 13), first_pos=2)], load=True)
    assert r.ok and [block_bytes(kv, 0, b) for b in (12, 13)] == want
    off.close()


def test_failed_values_leave_their_blocks_alone_and_are_reported(memkv_server):
    kv = LAYOUTS["kv_per_layer"](16, "cpu")
    off = offloader(memkv_server.address, kv)
    assert run(off, 1, [Entry(b"here", 0, (1,))], load=False).ok
    untouched = block_bytes(kv, 0, 9)
    r = run(off, 2, [Entry(b"here", 0, (8,)), Entry(b"missing", 0, (9,))], load=True)
    assert not r.ok and r.ok_keys == (b"here",) and r.failed_block_ids == (9,)
    assert block_bytes(kv, 0, 8) == block_bytes(kv, 0, 1)
    assert block_bytes(kv, 0, 9) == untouched
    off.close()


def test_dead_server_fails_jobs_as_values(memkv_server):
    kv = LAYOUTS["kv_per_layer"](16, "cpu")
    off = offloader(memkv_server.address, kv)
    memkv_server.kill()
    s = run(off, 1, entries(b"s", 0, [1, 2, 3]), load=False)
    assert not s.ok and sorted(s.failed_block_ids) == [1, 2, 3] and s.nbytes == 0
    before = all_bytes(kv)
    r = run(off, 2, entries(b"s", 0, [4, 5]), load=True)
    assert not r.ok and sorted(r.failed_block_ids) == [4, 5] and all_bytes(kv) == before
    off.close()


def test_jobs_larger_than_scratch_recycle_slots(memkv_server):
    kv = LAYOUTS["mla_latent"](64, "cpu")
    off = offloader(memkv_server.address, kv, scratch_values=2)
    assert off.n_slots == 2
    src = list(range(0, 40, 2))
    off.submit_store(1, entries(b"m", 0, src))
    off.submit_store(2, entries(b"n", 0, [1, 3]))
    assert off.drain(30)
    assert sorted((r.job_id, r.ok) for r in off.poll()) == [(1, True), (2, True)]
    want = [block_bytes(kv, 0, b) for b in src]
    dst = list(range(41, 61))
    r = run(off, 3, [Entry(b"m/%d" % i, 0, (d,)) for i, d in enumerate(dst)], load=True)
    assert r.ok and [block_bytes(kv, 0, b) for b in dst] == want
    off.close()


def test_a_store_reads_its_blocks_once_copied(memkv_server):
    """wait() on a store returns when the blocks were copied out: the caller may overwrite them
    while the values are still on their way, and the stored values are the old bytes."""
    kv = LAYOUTS["kv_per_layer"](8, "cpu")
    off = offloader(memkv_server.address, kv)
    want = block_bytes(kv, 0, 3)
    off.submit_store(1, [Entry(b"snap", 0, (3,))])
    assert off.wait([1], 10)
    for t in kv.tensors:
        t[3].view(torch.uint8).fill_(7)
    assert off.drain(10) and off.poll()[0].ok
    assert run(off, 2, [Entry(b"snap", 0, (5,))], load=True).ok
    assert block_bytes(kv, 0, 5) == want
    off.close()


def test_bad_entries_raise_at_submit(memkv_server):
    kv = LAYOUTS["kv_per_layer"](8, "cpu", bpv=2)
    off = offloader(memkv_server.address, kv)
    for bad in (Entry(b"k", 0, (8,)), Entry(b"k", 0, (-1,)), Entry(b"k", 1, (0,)),
                Entry(b"k", 0, (1, 2, 3)),
                Entry(b"k", 0, (1,), first_pos=2), Entry(b"k", 0, ())):
        with pytest.raises(ValueError):
            off.submit_store(1, [bad])
    assert off.poll() == [] and not off.has_pending_jobs()
    off.close()


def test_a_block_id_must_exist_in_every_tensor_of_its_group():
    kv = PagedKV([torch.zeros((6, 64), dtype=torch.int8), torch.zeros((4, 64), dtype=torch.int8)])
    kv.check(Entry(b"k", 0, (3,)))
    with pytest.raises(ValueError, match=r"tensor 1 \(4 blocks\)"):
        kv.check(Entry(b"k", 0, (4,)))


def test_geometry_errors():
    t = torch.zeros((4, 64), dtype=torch.int8)
    with pytest.raises(ValueError, match="pitch"):
        PagedKV([t], [[KVRef(0, 65)]])
    with pytest.raises(ValueError, match="no tensor"):
        PagedKV([t], [[KVRef(1, 8)]])
    from memkv_vllm.offload.movers import make_mover

    with pytest.raises(ValueError, match="CUDA"):
        make_mover(PagedKV([t]), 1, 64, "gpu")
    with pytest.raises(ValueError, match="medium"):
        make_mover(PagedKV([t]), 1, 64, "disk")


def test_closed_offloader_fails_new_jobs(memkv_server):
    kv = LAYOUTS["kv_per_layer"](8, "cpu")
    off = offloader(memkv_server.address, kv)
    off.close()
    off.submit_load(4, [Entry(b"k", 0, (2,))])
    (r,) = off.poll()
    assert r.job_id == 4 and not r.ok and r.failed_block_ids == (2,)


def _offload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("memkv-offload-")]


def test_the_pipeline_advances_without_the_caller(memkv_server):
    """Nobody calls poll, wait or drain: the progress threads still take each gathered batch to
    the network, reuse its slot for the next one, and scatter loaded values into their blocks."""
    kv = LAYOUTS["kv_per_layer"](32, "cpu")
    earlier = set(_offload_threads())  # other tests' offloaders not collected yet
    off = offloader(memkv_server.address, kv, scratch_values=2, batch_values=1)
    src, dst = list(range(0, 10)), list(range(20, 30))
    es = entries(b"bg", 0, src)
    want = [block_bytes(kv, 0, b) for b in src]
    off.submit_store(1, es)  # 10 values through 2 slots: 8 gathers happen after submit returns
    client = MemKVClient.from_config(load_config({"servers": [memkv_server.address]}))
    keys = [e.key for e in es]
    assert until(lambda: client.exists(keys) == [Status.OK] * len(keys)), "values not stored"
    off.submit_load(2, [Entry(e.key, 0, (d,)) for e, d in zip(es, dst, strict=True)])
    assert until(lambda: [block_bytes(kv, 0, b) for b in dst] == want), "blocks not loaded"
    results: list = []
    assert until(lambda: bool(results.extend(off.poll())) or len(results) == 2)
    assert sorted((r.job_id, r.ok) for r in results) == [(1, True), (2, True)]
    off.close()
    client.close()
    assert set(_offload_threads()) - earlier == set()


def test_progress_threads_sleep_while_the_network_is_silent(memkv_server):
    """A load waiting on a frozen server costs no CPU: the threads sleep, nothing spins."""
    kv = LAYOUTS["kv_per_layer"](8, "cpu")
    off = offloader(memkv_server.address, kv)
    assert run(off, 1, [Entry(b"k", 0, (1,))], load=False).ok
    with memkv_server.frozen():
        off.submit_load(2, [Entry(b"k", 0, (2,))])
        cpu, wall = time.process_time(), time.monotonic()
        assert not off.drain(0.5)  # still on the network
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert cpu < 0.2 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"
    assert off.drain(30)
    (r,) = off.poll()
    assert r.job_id == 2 and r.ok and block_bytes(kv, 0, 2) == block_bytes(kv, 0, 1)
    off.close()


class _Fence:
    def __init__(self) -> None:
        self.passed = False

    def done(self) -> bool:
        return self.passed

    def wait(self) -> None:
        self.passed = True


def test_job_rows_never_wait_while_slots_bound_what_is_in_flight():
    """The copy kernel's job rows: with at most `rows` blocks in flight (what the scratch slots
    allow), taking rows never waits for an earlier job, even across many wraps of the ring."""
    from memkv_vllm.offload.movers import JobRows

    rows = 48
    ring = JobRows(torch, rows, torch.device("cpu"))
    in_flight: list[tuple[_Fence, int]] = []
    for i in range(5000):
        n = 1 + (i * 7) % 23
        while sum(k for _, k in in_flight) + n > rows:
            in_flight.pop(0)[0].passed = True  # the oldest copy ends and frees its slots
        blocks = [(i + j) % 1000 for j in range(n)]
        h, dev = ring.take(blocks, [1 << 40 | j for j in range(n)], list(range(n)))
        assert dev[:n].tolist() == blocks and dev[n:2 * n].tolist()[-1] == 1 << 40 | n - 1
        assert dev.data_ptr() % 16 == 0
        f = _Fence()
        ring.used_until([h], f)
        in_flight.append((f, n))
    assert ring.waits == 0


def test_job_rows_wait_for_the_oldest_job_only_when_full():
    from memkv_vllm.offload.movers import JobRows

    ring = JobRows(torch, 4, torch.device("cpu"))
    fences = []
    while ring.waits == 0:  # nothing ever passes: the ring fills up, then must wait
        h, _ = ring.take(list(range(16)), list(range(16)), list(range(16)))
        fences.append(_Fence())
        ring.used_until([h], fences[-1])
    assert fences[0].passed and not any(f.passed for f in fences[1:])
    assert len(fences) == ring.words // 48 + 1
    with pytest.raises(ValueError, match="blocks in one launch"):
        ring.take([0] * ring.words, [0] * ring.words, [0] * ring.words)
