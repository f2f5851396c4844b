"""Building an offloader on a real server and running jobs to completion."""

from __future__ import annotations

import time
from collections.abc import Callable

from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import load_config
from memkv_vllm.core.store import BlockStore, StoreOptions
from memkv_vllm.offload import Entry, JobResult, KVOffloader, PagedKV


def offloader(address: str, kv: PagedKV, medium: str = "auto", scratch_values: int = 64,
              copy_method: str = "auto", batch_values: int = 4, device_io: bool = False,
              client: MemKVClient | None = None, **store_opts: object) -> KVOffloader:
    if client is None:
        client = MemKVClient.from_config(load_config({"servers": [address]}))
    store = BlockStore(client, StoreOptions(**store_opts))  # type: ignore[arg-type]
    slot = -(-kv.max_value_bytes // 4096) * 4096
    return KVOffloader(kv, store, medium=medium, scratch_bytes=scratch_values * slot,
                       batch_values=batch_values, copy_method=copy_method, device_io=device_io)


def run(off: KVOffloader, job_id: int, entries: list[Entry], load: bool,
        timeout: float = 30.0) -> JobResult:
    """Submit one job and wait for its result (every other result must not exist)."""
    (off.submit_load if load else off.submit_store)(job_id, entries)
    assert off.drain(timeout), "job did not finish"
    results = off.poll()
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll `cond` until it holds or `timeout` passes (for state only another thread changes)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def entries(prefix: bytes, group: int, blocks: list[int], bpv: int = 1) -> list[Entry]:
    """One entry per `bpv` consecutive ids of `blocks`."""
    return [Entry(prefix + b"/%d" % i, group, tuple(blocks[i:i + bpv]))
            for i in range(0, len(blocks), bpv)]
