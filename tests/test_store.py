"""The block store against a real memkv server, with plain numpy memory and no vLLM.

This is how another serving stack would use it (test_store_contract.py checks the contract with
a fake client and a fake clock; this proves it holds over the real client and server).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from memkv_procs import MemKVServer

from memkv_vllm.core.store import BlockStore, Lookup, StoreOptions

pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")


@pytest.fixture
def server(memkv_server: MemKVServer) -> MemKVServer:
    return memkv_server


def _store(address: str, memory: np.ndarray, **opts) -> BlockStore:
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    st = BlockStore(MemKVClient.from_config(load_config({"servers": [address]})),
                    StoreOptions(**opts))
    st.register_buffer(memory.ctypes.data, memory.nbytes, owner=memory)
    return st


def _wait(cond, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def test_round_trip_with_batched_lookups(server: MemKVServer) -> None:
    src = np.random.default_rng(1).integers(-128, 127, size=(5, 4096), dtype=np.int8)
    dst = np.zeros_like(src)
    st = _store(server.address, src, blocks_per_op=2)
    try:
        keys = [f"blk/{i}".encode() for i in range(5)]
        ptrs = [src.ctypes.data + i * 4096 for i in range(5)]
        st.submit_store(1, keys, ptrs, [4096] * 5)
        done: list = []
        _wait(lambda: done.extend(st.poll()) or done)
        assert done[0].ok and done[0].job_id == 1 and done[0].nbytes == 5 * 4096

        assert st.lookup(keys[0]) is Lookup.HIT  # our own store is known without a probe
        fresh = _store(server.address, dst)
        try:
            asked = keys + [b"blk/absent"]
            assert [fresh.lookup(k) for k in asked] == [Lookup.PENDING] * 6
            fresh.flush_lookups()  # one exists batch for all six
            _wait(lambda: fresh.lookup(asked[-1]) is not Lookup.PENDING)
            _wait(lambda: all(fresh.lookup(k) is not Lookup.PENDING for k in asked))
            assert [fresh.lookup(k) for k in asked] == [Lookup.HIT] * 5 + [Lookup.MISS]
            assert fresh.stats()["probes"] == 1

            fresh.submit_load(2, keys, [dst.ctypes.data + i * 4096 for i in range(5)],
                              [4096] * 5)
            got: list = []
            _wait(lambda: got.extend(fresh.poll()) or got)
            assert got[0].ok and got[0].is_load and np.array_equal(dst, src)
        finally:
            fresh.close()
    finally:
        st.close()


def test_missing_key_fails_the_load_and_becomes_a_miss(server: MemKVServer) -> None:
    dst = np.zeros(4096, dtype=np.int8)
    st = _store(server.address, dst)
    try:
        st.submit_load(9, [b"nope"], [dst.ctypes.data], [4096])
        got: list = []
        _wait(lambda: got.extend(st.poll()) or got)
        assert not got[0].ok and got[0].ok_keys == ()
        assert st.lookup(b"nope") is Lookup.MISS  # remembered: no second load attempt
    finally:
        st.close()


def test_wait_any_returns_when_a_job_finished(server: MemKVServer) -> None:
    """wait_any blocks until a finished job waits in poll(), without waiting for every job."""
    mem = np.ones((2, 4096), dtype=np.int8)
    st = _store(server.address, mem)
    try:
        t0 = time.monotonic()
        assert st.wait_any(0.2) is False  # nothing submitted: times out
        assert time.monotonic() - t0 >= 0.2
        st.submit_store(1, [b"w/0"], [mem.ctypes.data], [4096])
        assert st.wait_any(10) is True
        assert [c.job_id for c in st.poll()] == [1]
        assert st.wait_any(0) is False  # polled: nothing waits any more
    finally:
        st.close()
