"""The SGLang backend over ``backend: redis``: the same block store, so the same pages and the
same misses, on a real redis-server (tests/redis_procs.py)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed in this venv: tests/hicache run in "
                    ".venv-sglang (bash scripts/setup-sglang.sh)")
redis = pytest.importorskip("redis", reason="backend: redis needs redis-py (test.sh --setup)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt-get install redis-server)",
                allow_module_level=True)

from redis_procs import RedisStandalone  # noqa: E402
from sglang_pools import backend, host_pool, names, page_bytes, pages, same, storage_config  # noqa: E402

from memkv_vllm.core.redis_client import redis_key  # noqa: E402


def test_round_trip_and_a_corrupt_value_over_redis():
    srv = RedisStandalone()
    try:
        cfg = {"backend": "redis", "servers": srv.urls, "op_timeout_s": 5}
        a_host, b_host = host_pool("mla", "layer_first"), host_pool("mla", "layer_first")
        a = backend(a_host, storage_config(True, **cfg))
        b = backend(b_host, storage_config(True, **cfg))
        keys = names("redis", 3)
        want = page_bytes(a_host, 0, 3)
        assert a.batch_set_v1(keys, pages(a_host, 0, 3)) == [True] * 3
        assert b.batch_exists(keys) == 3
        # A payload byte flipped behind our back: Redis' value fails its checksum.
        r = redis.Redis(port=srv.node.port)
        name = redis_key(a.remote_keys(keys[2])[1])
        value = bytearray(r.get(name))
        value[5] ^= 0xFF
        r.set(name, bytes(value))
        r.close()
        b_host.kv_buffer.zero_()
        assert b.batch_get_v1(keys, pages(b_host, 4, 3)) == [True, True, False]
        got = page_bytes(b_host, 4, 3)
        assert same(got[:2], want[:2])
        assert not same(got[2:], want[2:])
        assert b.batch_exists(keys) == 2
        a.close()
        b.close()
    finally:
        srv.stop()
