"""The Redis backend against a REAL Redis Cluster (3 primaries + 3 replicas, `redis-server` on
loopback ports, started and killed here): round trips, keys spread over the nodes, checksums
(a value corrupted behind our back is a miss, never bytes), the block store on top, standalone
Redis with a password, and an unreachable cluster. Failover, slot migration and eviction:
tests/test_redis_failover.py."""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("redis", reason="the redis backend needs redis-py (scripts/test.sh --setup)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_procs import FLAVORS, RedisCluster, RedisStandalone, free_ports, poll  # noqa: E402

from memkv_vllm.core.backends import make_client  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.interface import Lookup, Status  # noqa: E402
from memkv_vllm.core.redis_client import (  # noqa: E402
    TRAILER_BYTES,
    RedisBlockClient,
    frame_value,
    redis_key,
    unframe_value,
)
from memkv_vllm.core.store import BlockStore, StoreOptions  # noqa: E402


@pytest.fixture(scope="module", params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    """Every test here runs against Redis and against Valkey (a fork that speaks the same
    protocol and cluster bus: users run either)."""
    return request.param


@pytest.fixture(scope="module")
def cluster(flavor: str) -> Iterator[RedisCluster]:
    c = RedisCluster(primaries=3, replicas=1, flavor=flavor)
    yield c
    c.stop()


def client_for(urls: list[str], **kw: object) -> RedisBlockClient:
    c = make_client(load_config({"backend": "redis", "servers": urls, **kw}, env={}))
    assert isinstance(c, RedisBlockClient)
    return c


@pytest.fixture
def client(cluster: RedisCluster) -> Iterator[RedisBlockClient]:
    c = client_for(cluster.urls[:1], op_timeout_s=5)  # the slot map names the other nodes
    yield c
    c.close()


def rows(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def ptrs(a: np.ndarray) -> list[int]:
    return [int(a[i].ctypes.data) for i in range(len(a))]


def test_round_trip_exists_delete(client: RedisBlockClient, cluster: RedisCluster) -> None:
    assert client.mode is None  # connects on first use
    keys = [f"rt/{i}".encode() for i in range(200)]
    src = rows(200, 4096, 1)
    assert set(client.put_ptrs(keys, ptrs(src), [4096] * 200)) == {Status.OK}
    dst = np.zeros_like(src)
    assert set(client.get_into_ptrs(keys, ptrs(dst), [4096] * 200)) == {Status.OK}
    assert (dst == src).all()
    assert client.mode == "cluster"
    probe = client.submit_exists(keys + [b"rt/absent"], lease_ms=1000)
    answer = poll(lambda: probe.wait(0), 10, "the probe")
    assert answer == bytes([Status.OK] * 200 + [Status.NOT_FOUND])
    assert client.exists(keys[:3], lease_ms=0) == bytes([Status.OK] * 3)
    assert set(client.delete(keys[:100])) == {Status.OK}
    assert client.exists(keys[:101]) == bytes([Status.NOT_FOUND] * 100 + [Status.OK])
    # A batch's keys spread over every primary, not onto one node.
    per_node = [int(n.cmd("DBSIZE").strip()) for n in cluster.primaries()]
    assert len(per_node) == 3 and min(per_node) >= 15, per_node


def test_binary_keys_with_braces_still_spread(client: RedisBlockClient) -> None:
    # A direct-mode key is binary and may contain '{...}': the leading tag decides the slot.
    from redis.crc import key_slot

    keys = [b"mkD1{ns}" + i.to_bytes(4, "big") + b"\x00}" for i in range(64)]
    assert len({key_slot(redis_key(k)) for k in keys}) > 50
    src = rows(64, 100, 2)
    assert set(client.put_ptrs(keys, ptrs(src), [100] * 64)) == {Status.OK}
    dst = np.zeros_like(src)
    assert set(client.get_into_ptrs(keys, ptrs(dst), [100] * 64)) == {Status.OK}
    assert (dst == src).all()


def test_framing_rejects_every_wrong_value() -> None:
    a = rows(1, 1000, 3)[0]
    v = bytes(frame_value(int(a.ctypes.data), 1000))
    assert len(v) == 1000 + TRAILER_BYTES and v[:1000] == a.tobytes()
    assert unframe_value(v, 1000) == Status.OK
    assert unframe_value(None, 1000) == Status.NOT_FOUND
    assert unframe_value(v, 999) == Status.LENGTH_MISMATCH
    assert unframe_value(v[:10], 1000) == Status.CORRUPT
    assert unframe_value(a.tobytes() + bytes(16), 1000) == Status.CORRUPT  # no trailer
    for pos in (0, 500, 999, 1003, 1010):  # payload, CRC, length field
        bad = bytearray(v)
        bad[pos] ^= 0x40
        assert unframe_value(bytes(bad), 1000) != Status.OK, pos


def test_value_corrupted_with_redis_cli_is_a_miss_never_bytes(
        client: RedisBlockClient, cluster: RedisCluster) -> None:
    keys = [b"corrupt/a", b"corrupt/b", b"corrupt/c"]
    src = rows(3, 2048, 4)
    assert set(client.put_ptrs(keys, ptrs(src), [2048] * 3)) == {Status.OK}
    cli = cluster.nodes[0]
    # Behind the client's back: flip bytes inside a's payload, replace b by a foreign value.
    cli.cmd("-c", "SETRANGE", redis_key(keys[0]).decode(), "100", "XXXX")
    cli.cmd("-c", "SET", redis_key(keys[1]).decode(), "x" * (2048 + TRAILER_BYTES))
    dst = np.full_like(src, 0xEE)
    st = client.get_into_ptrs(keys, ptrs(dst), [2048] * 3)
    assert list(st) == [Status.CORRUPT, Status.CORRUPT, Status.OK]
    assert (dst[:2] == 0xEE).all(), "a corrupt value's bytes reached the caller's memory"
    assert (dst[2] == src[2]).all()
    # Corrupt values are deleted: nobody will try them again.
    assert client.exists(keys) == bytes([Status.NOT_FOUND, Status.NOT_FOUND, Status.OK])


def test_wrong_length_is_length_mismatch_and_untouched(client: RedisBlockClient) -> None:
    src = rows(1, 512, 5)
    assert client.put_ptrs([b"len/a"], ptrs(src), [512]) == bytes([Status.OK])
    dst = np.full((1, 1024), 0xAB, dtype=np.uint8)
    assert client.get_into_ptrs([b"len/a"], ptrs(dst), [1024]) == bytes([Status.LENGTH_MISMATCH])
    assert (dst == 0xAB).all()


def test_block_store_over_redis_cluster(client: RedisBlockClient) -> None:
    """The memkv `BlockStore`, unchanged, on the Redis client: lookups, loads, stores."""
    pool = rows(16, 8192, 6)
    out = np.zeros_like(pool)
    store = BlockStore(client, StoreOptions(n_read_threads=2, n_write_threads=2,
                                            blocks_per_op=4))
    try:
        store.register_buffer(int(pool.ctypes.data), pool.nbytes, owner=pool)
        store.register_buffer(int(out.ctypes.data), out.nbytes, owner=out)
        keys = [f"bs/{i}".encode() for i in range(16)]
        assert store.lookup(keys[0]) is Lookup.PENDING
        store.flush_lookups()
        poll(lambda: not store.has_pending_lookups() or store.lookup(keys[0]) is not
             Lookup.PENDING, 10, "the first probe")
        assert store.lookup(keys[0]) is Lookup.MISS
        store.submit_store(1, keys, ptrs(pool), [8192] * 16)
        assert store.drain(30)
        (c,) = store.poll()
        assert c.ok and len(c.ok_keys) == 16
        store.submit_load(2, keys, ptrs(out), [8192] * 16)
        assert store.drain(30)
        (c,) = store.poll()
        assert c.ok and c.nbytes == pool.nbytes
        assert (out == pool).all()
    finally:
        store.close()


def test_standalone_with_password_and_auto_mode(flavor: str) -> None:
    r = RedisStandalone(password="s3cret", flavor=flavor)
    try:
        good = client_for(r.urls, redis_password="s3cret")
        src = rows(4, 300, 7)
        keys = [f"sa/{i}".encode() for i in range(4)]
        assert set(good.put_ptrs(keys, ptrs(src), [300] * 4)) == {Status.OK}
        dst = np.zeros_like(src)
        assert set(good.get_into_ptrs(keys, ptrs(dst), [300] * 4)) == {Status.OK}
        assert (dst == src).all()
        assert good.mode == "standalone"  # what redis_mode auto found
        good.close()
        bad = client_for(r.urls, redis_password="wrong")
        assert set(bad.exists(keys)) == {Status.AUTH_FAILED}
        bad.close()
    finally:
        r.stop()


def test_unreachable_cluster_is_a_fast_miss_not_an_error() -> None:
    port = free_ports(1)[0]
    c = client_for([f"redis://127.0.0.1:{port}"], redis_mode="cluster", connect_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        st = c.exists([b"a", b"b"])
        assert len(st) == 2 and not any(Status.is_ok(s) for s in st)
        buf = np.zeros((1, 64), dtype=np.uint8)
        assert not Status.is_ok(c.get_into_ptrs([b"a"], ptrs(buf), [64])[0])
        # within the backoff, no new connect attempt: an immediate miss
        assert not Status.is_ok(c.put_ptrs([b"a"], ptrs(buf), [64])[0])
        assert time.monotonic() - t0 < 5
    finally:
        c.close()


def test_memory_is_written_only_for_ok_keys(client: RedisBlockClient) -> None:
    keys = [b"only/ok", b"only/missing"]
    src = rows(1, 256, 8)
    client.put_ptrs(keys[:1], ptrs(src), [256])
    dst = (ctypes.c_ubyte * 512)(*([0x11] * 512))
    base = ctypes.addressof(dst)
    st = client.get_into_ptrs(keys, [base, base + 256], [256, 256])
    assert list(st) == [Status.OK, Status.NOT_FOUND]
    assert bytes(dst[:256]) == src.tobytes() and bytes(dst[256:]) == b"\x11" * 256


def test_eviction_turns_a_hit_into_a_miss_at_load_never_into_bytes(flavor: str) -> None:
    """Redis has no leases: a block the lookup saw can be evicted (maxmemory + allkeys-lru)
    before its load. The load then fails like any miss (the tier recomputes) and the block
    store reads MISS from then on; the destination keeps its bytes."""
    r = RedisStandalone(extra=["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"],
                        flavor=flavor)
    client = client_for(r.urls)
    pool = rows(2, 256 << 10, 9)
    out = np.full((1, 256 << 10), 0x5A, dtype=np.uint8)
    writer = BlockStore(client, StoreOptions(n_read_threads=1, n_write_threads=1))
    store = BlockStore(client, StoreOptions(n_read_threads=1, n_write_threads=1))  # the reader
    try:
        writer.register_buffer(int(pool.ctypes.data), pool.nbytes, owner=pool)
        store.register_buffer(int(out.ctypes.data), out.nbytes, owner=out)
        writer.submit_store(1, [b"ev/victim"], ptrs(pool[:1]), [256 << 10])
        assert writer.drain(10) and writer.poll()[0].ok
        assert store.lookup(b"ev/victim") is Lookup.PENDING
        store.flush_lookups()
        assert poll(lambda: store.lookup(b"ev/victim") is not Lookup.PENDING, 10, "the probe")
        assert store.lookup(b"ev/victim") is Lookup.HIT
        # Another engine fills the server until the victim goes. The lookup's TOUCH made it
        # the newest key and Redis's LRU is approximate (it samples keys), so no fixed amount
        # of filler is sure to evict it (CI once kept it past 16 MiB of filler into 8 MB).
        # `exists` without a lease is EXISTS, which leaves the LRU clock alone.
        for batch in range(64):
            filler = [f"ev/fill/{batch}/{i}".encode() for i in range(16)]
            client.put_ptrs(filler, [int(pool[1].ctypes.data)] * 16, [256 << 10] * 16)
            if client.exists([b"ev/victim"]) == bytes([Status.NOT_FOUND]):
                break
        assert r.node.info("stats")["evicted_keys"] != "0"
        assert client.exists([b"ev/victim"]) == bytes([Status.NOT_FOUND]), "never evicted"
        store.submit_load(2, [b"ev/victim"], ptrs(out), [256 << 10])
        assert store.drain(10)
        (c,) = store.poll()
        assert not c.ok and c.gone_keys == (b"ev/victim",)
        assert (out == 0x5A).all()
        assert store.lookup(b"ev/victim") is Lookup.MISS
    finally:
        writer.close()
        store.close()
        client.close()
        r.stop()


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    """(certificate, key) of a self-signed certificate for 127.0.0.1: a TLS server's own CA."""
    cert, key = str(tmp_path / "c.pem"), str(tmp_path / "k.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_tls_settings_reach_the_connection(tmp_path: Path, flavor: str) -> None:
    """rediss:// plus redis_tls_ca: a TLS-only server answers; without the CA it cannot."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = _self_signed(tmp_path)
    r = RedisStandalone(tls=(cert, key), flavor=flavor)
    try:
        good = client_for(r.urls, redis_tls_ca=cert)
        src = rows(2, 1000, 10)
        assert set(good.put_ptrs([b"tls/a", b"tls/b"], ptrs(src), [1000] * 2)) == {Status.OK}
        dst = np.zeros_like(src)
        assert set(good.get_into_ptrs([b"tls/a", b"tls/b"], ptrs(dst), [1000] * 2)) == {
            Status.OK}
        assert (dst == src).all()
        good.close()
        untrusted = client_for(r.urls, connect_timeout_s=1)  # system CAs only: refused cert
        assert not any(Status.is_ok(s) for s in untrusted.exists([b"tls/a"]))
        untrusted.close()
    finally:
        r.stop()


def test_probes_queued_behind_a_stuck_server_time_out_without_io(flavor: str) -> None:
    """A server that stops answering (SIGSTOP) while the scheduler submits a probe per step:
    the probes already sent wait out op_timeout_s, the ones queued behind them answer TIMEOUT at
    once, so the backlog does not grow with the outage; once the server runs again, probes
    answer normally."""
    r = RedisStandalone(flavor=flavor)
    client = client_for(r.urls, op_timeout_s=0.5, io_threads=2)
    try:
        assert client.exists([b"stuck/a"]) == bytes([Status.NOT_FOUND])  # connected
        r.node.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        probes = [client.submit_exists([b"stuck/a", b"stuck/b"]) for _ in range(40)]
        answers = [p.wait(10) for p in probes]
        elapsed = time.monotonic() - t0
        assert all(a == bytes([Status.TIMEOUT] * 2) for a in answers), set(answers)
        # 40 probes x 0.5 s on 2 threads would take 10 s; only the first few wait.
        assert elapsed < 3.0, elapsed
        r.node.proc.send_signal(signal.SIGCONT)
        assert poll(lambda: client.submit_exists([b"stuck/a"]).wait(5) ==
                    bytes([Status.NOT_FOUND]), 10, "probes to answer after SIGCONT")
    finally:
        r.node.proc.send_signal(signal.SIGCONT)
        client.close()
        r.stop()


def test_read_from_replicas_reads_on_replicas(cluster: RedisCluster) -> None:
    """redis_read_from_replicas: GETs go to replicas too (their command counters show it),
    and what they return is still checked byte for byte."""
    c = client_for(cluster.urls[:1], redis_read_from_replicas=True)
    try:
        keys = [f"rr/{i}".encode() for i in range(60)]
        src = rows(60, 1024, 11)
        assert set(c.put_ptrs(keys, ptrs(src), [1024] * 60)) == {Status.OK}
        poll(cluster.replicas_caught_up, 20, "replication")
        replicas = [n for n in cluster.live() if n.info("replication").get("role") == "slave"]
        before = sum(int(n.info("commandstats").get("cmdstat_get", "calls=0").split(",")[0]
                         .split("=")[1]) for n in replicas)
        dst = np.zeros_like(src)
        for _ in range(4):
            assert set(c.get_into_ptrs(keys, ptrs(dst), [1024] * 60)) == {Status.OK}
            assert (dst == src).all()
        after = sum(int(n.info("commandstats").get("cmdstat_get", "calls=0").split(",")[0]
                        .split("=")[1]) for n in replicas)
        assert after - before >= 60, (before, after)
    finally:
        c.close()


# The ACL line of docs/redis.md ("TLS and one ACL user per tenant"), for tenant NAME.
TENANT_ACL = ("on >{name}-password resetkeys ~{{????}}{name}/* resetchannels -@all +get +set "
              "+exists +touch +del +ping +info +cluster|slots +cluster|shards +command +readonly")


def test_one_acl_user_per_tenant_over_tls_confines_it_to_its_prefix(tmp_path: Path,
                                                                     flavor: str) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    doc = (Path(__file__).resolve().parent.parent / "docs/redis.md").read_text()
    assert "ACL SETUSER team-a " + TENANT_ACL.format(name="team-a") in doc
    cert, key = _self_signed(tmp_path)
    r = RedisStandalone(tls=(cert, key), flavor=flavor)
    try:
        for name in ("team-a", "team-b"):
            out = r.node.cmd("ACL", "SETUSER", name, *TENANT_ACL.format(name=name).split())
            assert out.strip() == "OK", out
        a = client_for(r.urls, redis_tls_ca=cert, redis_username="team-a",
                       redis_password="team-a-password")
        b = client_for(r.urls, redis_tls_ca=cert, redis_username="team-b",
                       redis_password="team-b-password")
        src = rows(1, 500, 11)
        assert list(b.put_ptrs([b"team-b/blk"], ptrs(src), [500])) == [Status.OK]
        assert list(a.put_ptrs([b"team-a/blk"], ptrs(src), [500])) == [Status.OK]
        dst = np.zeros_like(src)
        assert list(a.get_into_ptrs([b"team-a/blk"], ptrs(dst), [500])) == [Status.OK]
        assert (dst == src).all()
        # Team B's block exists, and team A can neither read, overwrite nor probe it.
        assert list(a.get_into_ptrs([b"team-b/blk"], ptrs(dst), [500])) == [Status.AUTH_FAILED]
        assert list(a.put_ptrs([b"team-b/blk"], ptrs(src), [500])) == [Status.AUTH_FAILED]
        assert list(a.exists([b"team-b/blk"])) == [Status.AUTH_FAILED]
        assert list(b.exists([b"team-b/blk"])) == [Status.OK]
        a.close()
        b.close()
    finally:
        r.stop()
