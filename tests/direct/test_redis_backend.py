"""Direct mode over the Redis backend: `direct.cluster.connect` honours ``backend: redis``, and a
worker stores chunks into a real standalone `redis-server` and loads them byte-exact into other
blocks of another KV cache. A value corrupted behind our back is a failed load (recompute), never
bytes in the KV tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
redis = pytest.importorskip("redis", reason="the redis backend needs redis-py (test.sh --setup)")

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from redis_procs import RedisStandalone  # noqa: E402
from test_worker import BPC, PREFIX, block, finish, kv_cache  # noqa: E402

from memkv_vllm.core.redis_client import RedisBlockClient, redis_key  # noqa: E402
from memkv_vllm.direct.cluster import connect  # noqa: E402
from memkv_vllm.direct.keys import key_under  # noqa: E402
from memkv_vllm.direct.worker import DirectWorker  # noqa: E402
from memkv_vllm.offload import KVOffloader  # noqa: E402


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisStandalone]:
    r = RedisStandalone()
    yield r
    r.stop()


def redis_worker(urls: list[str], seed: int) -> tuple[DirectWorker, object]:
    kv = kv_cache(seed=seed)
    store, client, _ = connect({"backend": "redis", "servers": urls, "op_timeout_s": 5},
                               n_read_threads=2, n_write_threads=2)
    assert isinstance(client, RedisBlockClient)
    off = KVOffloader(kv, store, medium="host", scratch_bytes=8 * 4096)
    return DirectWorker(off, PREFIX, rank=1, blocks_per_chunk=BPC), kv


def test_direct_worker_round_trip_through_redis(redis_server: RedisStandalone) -> None:
    (ws, src), (wd, dst) = (redis_worker(redis_server.urls, s) for s in (1, 2))
    chunks = [(b"ra", 0), (b"rb", 0)]
    ws.submit_store(1, [2, 3, 4, 5], [4], [0], chunks)
    assert not finish(ws, 1).failed
    wd.submit_load(2, [10, 11, 12, 13], [4], [0], chunks)
    assert not finish(wd, 2).failed
    assert [block(dst, t, b) for t in (0, 1) for b in (10, 11, 12, 13)] == [
        block(src, t, b) for t in (0, 1) for b in (2, 3, 4, 5)]
    ws.shutdown()
    wd.shutdown()


def test_a_corrupt_redis_value_fails_the_load_and_writes_nothing(
        redis_server: RedisStandalone) -> None:
    (ws, _), (wd, dst) = (redis_worker(redis_server.urls, s) for s in (3, 4))
    chunks = [(b"rc", 0)]
    ws.submit_store(1, [2, 3], [2], [0], chunks)
    assert not finish(ws, 1).failed
    r = redis.Redis(port=redis_server.node.port)
    name = redis_key(key_under(PREFIX, b"rc", 0, 1))
    value = bytearray(r.get(name))
    value[5] ^= 0xFF  # a payload byte: the trailer's CRC no longer matches
    r.set(name, bytes(value))
    before = [block(dst, t, b) for t in (0, 1) for b in (8, 9)]
    wd.submit_load(2, [8, 9], [2], [0], chunks)
    assert finish(wd, 2).failed_block_ids == {8, 9}
    r.close()
    assert [block(dst, t, b) for t in (0, 1) for b in (8, 9)] == before
    ws.shutdown()
    wd.shutdown()
