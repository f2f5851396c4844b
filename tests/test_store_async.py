"""The block store over the native client's submitted operations and completion queue: one
Python harvester thread however many operations are in flight, a frozen server failing jobs
within the client's operation timeout, and the queue itself (tags once, timeouts, wake)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from memkv_procs import MemKVServer

from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.completions import TagQueue
from memkv_vllm.core.config import load_config
from memkv_vllm.core.interface import AsyncBlockClient, Completion, Status
from memkv_vllm.core.store import BlockStore, StoreOptions

_native = pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")

BLOCK = 64 << 10


def _client(address: str, **cfg: object) -> MemKVClient:
    return MemKVClient.from_config(load_config({"servers": [address], **cfg}))


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _collect(st: BlockStore, n: int, timeout: float) -> list[Completion]:
    out: list[Completion] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert st.wait_any(max(0.0, deadline - time.monotonic())), f"{len(out)} of {n} jobs"
        out += st.poll()
    return out


def test_the_native_queue_hands_each_tag_out_once(memkv_server: MemKVServer) -> None:
    c = _client(memkv_server.address)
    try:
        q = c.codes.completion_queue()
        data = np.arange(8 * 256, dtype=np.uint8).reshape(8, 256)
        ops = {t: c.codes.submit_put_ptrs([f"q/{t}".encode()], [int(data[t].ctypes.data)], [256],
                                          q, t) for t in range(8)}
        got: list[int] = []
        while len(got) < len(ops):
            tags = q.wait(30)
            assert tags, "no tag within 30 s"
            got += tags
        assert sorted(got) == list(range(8))
        # Each op is done when its tag arrives: collected without blocking.
        assert all(op.done() and op.wait(0) == bytes([Status.OK]) for op in ops.values())
        t0 = time.monotonic()
        assert q.wait(0.2) == []  # nothing twice; the timeout ends the wait
        assert time.monotonic() - t0 >= 0.2
        q.wake()
        assert q.wait(None) == []
        dst = np.zeros_like(data)
        gets = c.codes.submit_get_into_ptrs([b"q/3", b"q/nope"], [int(dst[0].ctypes.data),
                                            int(dst[1].ctypes.data)], [256, 256], q, 99)
        assert q.wait(30) == [99]
        assert gets.wait(0) == bytes([Status.OK, Status.NOT_FOUND])
        assert (dst[0] == data[3]).all() and not dst[1].any()
        d = c.codes.submit_delete([b"q/3", b"q/nope"], q, 7)
        assert q.wait(30) == [7] and d.wait(0)[0] == Status.OK
        # The ops of the old API still work without a queue.
        assert c.codes.submit_exists([b"q/3", b"q/4"]).wait(30) == bytes(
            [Status.NOT_FOUND, Status.OK])
    finally:
        c.close()


@pytest.mark.parametrize("face", ["codes", "enums"])
def test_the_store_runs_on_one_harvester_thread(memkv_server: MemKVServer, face: str) -> None:
    """Many operations in flight in both directions: the only Python thread the store adds is
    its harvester, and every byte arrives."""
    n_jobs, per_job = 12, 16
    src = np.random.default_rng(3).integers(0, 255, (n_jobs * per_job, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    client = _client(memkv_server.address, io_threads=4)
    codes = client.codes if face == "codes" else client
    assert isinstance(codes, AsyncBlockClient)
    before = _threads()
    st = BlockStore(codes, StoreOptions(n_read_threads=8, n_write_threads=8, blocks_per_op=2))
    try:
        st.register_buffer(int(src.ctypes.data), src.nbytes, owner=src)
        st.register_buffer(int(dst.ctypes.data), dst.nbytes, owner=dst)

        def rows(a: np.ndarray, j: int) -> tuple[list[bytes], list[int], list[int]]:
            idx = range(j * per_job, (j + 1) * per_job)
            return ([f"h/{i}".encode() for i in idx], [int(a[i].ctypes.data) for i in idx],
                    [BLOCK] * per_job)

        for j in range(n_jobs):
            st.submit_store(j, *rows(src, j))
        assert _threads() - before == {"memkv-harvest"}
        done = _collect(st, n_jobs, 60)
        assert all(c.ok for c in done), [c for c in done if not c.ok]
        for j in range(n_jobs):
            st.submit_load(100 + j, *rows(dst, j))
        assert _threads() - before == {"memkv-harvest"}
        done = _collect(st, n_jobs, 60)
        assert all(c.ok and c.is_load for c in done)
        assert (dst == src).all()
        assert st.stats()["jobs_in_flight"] == 0
    finally:
        st.close()
        client.close()
    assert "memkv-harvest" not in _threads()


def test_a_frozen_server_fails_jobs_within_the_op_timeout(memkv_server: MemKVServer) -> None:
    """SIGSTOP: every operation in flight times out one op_timeout after its submission, also
    those waiting for one of the client's two I/O threads; the jobs complete failed, their
    keys turn MISS, and the store works again once the server runs."""
    op_timeout = 1.0
    src = np.random.default_rng(4).integers(0, 255, (64, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    client = _client(memkv_server.address, io_threads=2, op_timeout_s=op_timeout)
    st = BlockStore(client.codes, StoreOptions(n_read_threads=8, n_write_threads=8,
                                               blocks_per_op=4))
    keys = [f"f/{i}".encode() for i in range(64)]
    ptr = [int(src[i].ctypes.data) for i in range(64)]
    back = [int(dst[i].ctypes.data) for i in range(64)]
    try:
        st.register_buffer(int(src.ctypes.data), src.nbytes, owner=src)
        st.register_buffer(int(dst.ctypes.data), dst.nbytes, owner=dst)
        st.submit_store(1, keys[:32], ptr[:32], [BLOCK] * 32)
        assert _collect(st, 1, 30)[0].ok
        with memkv_server.frozen():
            t0 = time.monotonic()
            st.submit_load(2, keys[:16], back[:16], [BLOCK] * 16)  # 4 ops
            st.submit_load(3, keys[16:32], back[16:32], [BLOCK] * 16)  # 4 ops
            st.submit_store(4, keys[32:48], ptr[32:48], [BLOCK] * 16)  # 4 ops
            assert st.drain(op_timeout + 5)
            took = time.monotonic() - t0
            done = {c.job_id: c for c in st.poll()}
        assert sorted(done) == [2, 3, 4] and not any(c.ok for c in done.values())
        assert took < op_timeout * 1.8, f"{took:.2f} s for an op_timeout of {op_timeout} s"
        assert st.lookup(keys[0]).value == "miss"  # a failed load is not promoted again soon
        # The server runs again: a new store job goes through (the client may need a moment to
        # find the server up again).
        deadline = time.monotonic() + 30
        job = 10
        while True:
            st.submit_store(job, keys[48:], ptr[48:], [BLOCK] * 16)
            if _collect(st, 1, 30)[0].ok:
                break
            assert time.monotonic() < deadline, "the store never worked again"
            job += 1
    finally:
        st.close()
        client.close()


class _BrokenOps:
    """An AsyncBlockClient whose loads fail to start and whose stores fail as a whole (as a
    panicked native op answers: its wait raises)."""

    def __init__(self) -> None:
        self.queue = TagQueue()

    def completion_queue(self) -> TagQueue:
        return self.queue

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> object:
        raise OSError("no probes here")

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: TagQueue | None = None,
                             tag: int = 0) -> object:
        raise OSError("cannot start")

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: TagQueue | None = None, tag: int = 0) -> object:
        class Panicked:
            def done(self) -> bool:
                return True

            def wait(self, timeout: float | None = None) -> bytes:
                raise RuntimeError("memkv internal error (a bug; please report it): boom")

        assert queue is not None
        queue.push(tag)
        return Panicked()

    def submit_delete(self, keys: Sequence[bytes], queue: TagQueue | None = None,
                      tag: int = 0) -> object:
        raise OSError("no deletes here")


def test_failed_and_panicked_operations_complete_their_keys_as_unavailable() -> None:
    """More operations than may be in flight: every one fails, none is left waiting."""
    mem = np.zeros((32, 64), dtype=np.uint8)
    st = BlockStore(_BrokenOps(), StoreOptions(n_read_threads=2, n_write_threads=2,
                                               blocks_per_op=2))
    try:
        st.register_buffer(int(mem.ctypes.data), mem.nbytes, owner=mem)
        ptrs = [int(mem[i].ctypes.data) for i in range(32)]
        keys = [f"b/{i}".encode() for i in range(32)]
        st.submit_load(1, keys, ptrs, [64] * 32)
        st.submit_store(2, keys, ptrs, [64] * 32)
        assert st.drain(10)
        done = {c.job_id: c for c in st.poll()}
        assert sorted(done) == [1, 2]
        assert not done[1].ok and done[1].ok_keys == () and done[1].gone_keys == ()
        assert not done[2].ok and done[2].ok_keys == ()
        assert st.stats()["load_blocks_failed"] == 32 and st.stats()["store_blocks_failed"] == 32
        assert st.stats()["store_backlog_bytes"] == 0 and not st.has_pending_jobs()
    finally:
        st.close()
