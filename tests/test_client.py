"""The client against real `memkv serve` processes on loopback: data integrity, sharing, failure."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from memkv_procs import memkv_command

from memkv_vllm import _native
from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig, parse_server

KEY_HEX = "ab" * 32


def client_for(*servers, transport: str = "tcp", **kw) -> MemKVClient:
    """A client of `servers`; over RDMA (the `transport` fixture's "rdma") it uses loopback."""
    addrs = tuple(s.address for s in servers)
    if transport == "rdma":
        kw.setdefault("rdma_devices", ("lo",))
    return MemKVClient(MemKVConfig(servers=addrs, transport=transport, **kw))


def rand_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20])
def test_numpy_round_trip_is_byte_exact(memkv_server_factory, transport, size):
    srv = memkv_server_factory(memory="512M", lanes=2)
    c = client_for(srv, transport=transport)
    src = rand_bytes(size, size)
    assert c.put([b"k/%d" % size], [src]) == [Status.OK]
    dst = np.zeros(size, dtype=np.uint8)
    assert c.get_into([b"k/%d" % size], [dst]) == [Status.OK]
    assert np.array_equal(src, dst)


def test_batch_of_mixed_sizes_and_buffer_types(transport, memkv_server):
    c = client_for(memkv_server, transport=transport)
    vals = [rand_bytes(n, i) for i, n in enumerate([1, 100, 4096, 300_000])]
    keys = [b"mixed/%d" % i for i in range(len(vals))]
    srcs = [bytes(vals[0]), bytearray(vals[1]), memoryview(vals[2]), vals[3].reshape(1000, 300)]
    assert c.put(keys, srcs) == [Status.OK] * 4
    dsts = [bytearray(1), np.zeros(100, np.uint8), memoryview(bytearray(4096)),
            np.zeros((300, 1000), np.uint8)]
    assert c.get_into(keys, dsts) == [Status.OK] * 4
    for v, d in zip(vals, dsts, strict=True):
        assert np.array_equal(v, np.frombuffer(d, np.uint8).reshape(-1))


def test_blocks_of_a_registered_pool_round_trip(transport, memkv_server):
    """A pool registered once (as the block store does): its blocks move through that one
    registration (RDMA) or as plain buffers (TCP), and come back byte-exact."""
    c = client_for(memkv_server, transport=transport)
    pool = rand_bytes(64 * 4096, 7).reshape(64, 4096)
    c.register_buffer(pool.ctypes.data, pool.nbytes)
    keys = [b"pool/%d" % i for i in range(64)]
    assert c.put(keys, list(pool)) == [Status.OK] * 64
    out = np.zeros_like(pool)
    c.register_buffer(out.ctypes.data, out.nbytes)
    assert c.get_into(keys[::-1], list(out)) == [Status.OK] * 64
    assert np.array_equal(out[::-1], pool)
    c.unregister_buffer(out.ctypes.data)
    c.unregister_buffer(pool.ctypes.data)
    # Unregistered memory still works: buffers are then registered as they come.
    assert c.get_into(keys[:1], [out[0]]) == [Status.OK]
    assert np.array_equal(out[0], pool[0])


def test_misses_length_mismatch_and_invalid_keys(transport, memkv_server):
    c = client_for(memkv_server, transport=transport)
    c.put([b"len8"], [b"12345678"])
    buf = bytearray(b"untouched")
    st = c.get_into([b"len8", b"absent", b"", b"x" * 2000], [buf, bytearray(3), bytearray(1),
                                                             bytearray(1)])
    assert st == [Status.LENGTH_MISMATCH, Status.NOT_FOUND, Status.INVALID_KEY,
                  Status.INVALID_KEY]
    assert buf == b"untouched", "a length mismatch must not copy any byte"
    assert c.exists_lengths([b"len8", b"absent"]) == [(Status.OK, 8), (Status.NOT_FOUND, 0)]
    assert c.delete([b"len8", b"len8"]) == [Status.OK, Status.NOT_FOUND]
    with pytest.raises(ValueError):
        c.get_into([b"ro"], [b"read-only bytes"])


def test_submitted_ops_complete_and_keep_buffers_alive(memkv_server):
    c = client_for(memkv_server)
    keys = [b"async/%d" % i for i in range(32)]
    op = c.submit_put(keys, [rand_bytes(65536, i) for i in range(32)])  # temporaries: op owns them
    assert op.wait(30) == [Status.OK] * 32
    assert c.submit_exists(keys + [b"nope"]).wait(30) == [Status.OK] * 32 + [Status.NOT_FOUND]
    dst = [np.zeros(65536, np.uint8) for _ in keys]
    op = c.submit_get_into(keys, dst)
    assert op.wait(30) == [Status.OK] * 32 and op.done()
    assert all(np.array_equal(d, rand_bytes(65536, i)) for i, d in enumerate(dst))


def test_two_clients_share_a_two_server_cluster(memkv_cluster2):
    a, b = client_for(*memkv_cluster2), client_for(*reversed(memkv_cluster2))
    keys = [b"shared/%04d" % i for i in range(200)]
    vals = [rand_bytes(1000 + i, i) for i in range(200)]
    assert a.put(keys, vals) == [Status.OK] * 200
    # The server order in the list does not change placement: b finds everything a wrote.
    dst = [np.zeros(1000 + i, np.uint8) for i in range(200)]
    assert b.get_into(keys, dst) == [Status.OK] * 200
    assert all(np.array_equal(v, d) for v, d in zip(vals, dst, strict=True))
    items = [s.stats()["items"] for s in memkv_cluster2]
    assert sum(items) == 200 and min(items) > 50, f"keys not spread over both servers: {items}"


def test_killed_server_turns_its_keys_into_misses_without_hanging(transport, memkv_cluster2):
    keys = [b"kill/%04d" % i for i in range(64)]
    vals = [rand_bytes(1 << 20, i) for i in range(64)]
    # The 64 MiB are stored with a patient client: on a loaded 2-core box an RDMA connection's
    # set-up (the provider's endpoint buffers on both sides) took longer than 1 s to connect
    # and the puts longer than the 3 s the client under test allows one operation.
    loader = client_for(*memkv_cluster2, transport=transport, op_timeout_s=60.0,
                        connect_timeout_s=30.0)
    assert loader.put(keys, vals) == [Status.OK] * 64
    loader.close()
    # A dead server on loopback refuses at once: the connect timeout bounds nothing here, and
    # the live server's RDMA connection may take more than 1 s to set up on a loaded box.
    c = client_for(*memkv_cluster2, transport=transport, op_timeout_s=3.0, connect_timeout_s=10.0)
    victim = memkv_cluster2[1]
    owned_by_victim = [c.server_of(k) == victim.address for k in keys]
    dst = [np.zeros(1 << 20, np.uint8) for _ in keys]
    # Kill the server while a big batched get is in flight.
    op = c.submit_get_into(keys * 8, dst * 8)
    victim.kill()
    t0 = time.monotonic()
    st = op.wait(30)
    assert st is not None, "a batch must not hang when a server dies"
    st = c.get_into(keys, dst)
    assert time.monotonic() - t0 < 15
    for s, lost, v, d in zip(st, owned_by_victim, vals, dst, strict=True):
        if lost:
            # Marked down (UNAVAILABLE), or refused when the backoff expired and it was retried.
            assert s in (Status.UNAVAILABLE, Status.REFUSED)
        else:
            assert s == Status.OK and np.array_equal(v, d)
    assert any(owned_by_victim) and not all(owned_by_victim)
    t0 = time.monotonic()
    st = c.exists(keys)
    assert [s in (Status.UNAVAILABLE, Status.REFUSED) for s in st] == owned_by_victim
    assert time.monotonic() - t0 < 5, "a known-down server must answer fast (backoff)"


def test_auth_key_required_and_checked(memkv_server_factory):
    srv = memkv_server_factory(auth_key=KEY_HEX)
    good = client_for(srv, auth_key=bytes.fromhex(KEY_HEX))
    assert good.put([b"secret"], [b"v"]) == [Status.OK]
    wrong = client_for(srv, auth_key=bytes.fromhex("cd" * 32))
    assert wrong.exists([b"secret"]) == [Status.AUTH_FAILED]
    none = client_for(srv)
    assert none.exists([b"secret"]) == [Status.AUTH_FAILED]
    assert good.exists([b"secret"]) == [Status.OK], "server must still serve after rejections"
    errors = srv.stats()["errors"]
    assert errors["auth_failed"] >= 1


def test_memory_budget_holds_under_3x_writes(memkv_server_factory):
    srv = memkv_server_factory(memory="64M", lanes=2)
    c = client_for(srv)
    size, n = 1 << 20, 192  # 3x the budget
    for i in range(0, n, 8):
        keys = [b"evict/%04d" % j for j in range(i, i + 8)]
        assert c.put(keys, [rand_bytes(size, j) for j in range(i, i + 8)]) == [Status.OK] * 8
    st = srv.stats()
    assert st["memory_used_bytes"] <= st["memory_capacity_bytes"] == 64 << 20
    assert st["evictions"] >= n - 64
    dst = np.zeros(size, np.uint8)
    hits = 0
    for j in range(n):
        s = c.get_into([b"evict/%04d" % j], [dst])[0]
        assert s in (Status.OK, Status.NOT_FOUND)
        if s == Status.OK:
            hits += 1
            assert np.array_equal(dst, rand_bytes(size, j)), f"wrong bytes for key {j}"
    assert 32 <= hits <= 64
    assert c.exists([b"evict/%04d" % (n - 1)]) == [Status.OK], "newest value must survive"


def test_leased_values_survive_pressure(memkv_server_factory, transport):
    srv = memkv_server_factory(memory="16M", lanes=1)
    c = client_for(srv, transport=transport)
    c.put([b"keep"], [rand_bytes(1 << 20, 99)])
    assert c.exists([b"keep"], lease_ms=60_000) == [Status.OK]
    for i in range(64):
        c.put([b"fill/%d" % i], [rand_bytes(1 << 20, i)])
    dst = np.zeros(1 << 20, np.uint8)
    assert c.get_into([b"keep"], [dst]) == [Status.OK]
    assert np.array_equal(dst, rand_bytes(1 << 20, 99))
    assert srv.stats()["leases_granted"] == 1


def test_concurrent_clients_never_read_wrong_bytes(memkv_server_factory, transport):
    srv = memkv_server_factory(memory="32M", lanes=2)
    errors: list[str] = []

    def worker(t: int) -> None:
        c = client_for(srv, transport=transport)
        for i in range(60):
            k = b"race/%d" % (i % 10)
            # Every writer writes the same bytes for a key, so any OK read must match them.
            v = rand_bytes(512 << 10, i % 10)
            c.put([k], [v])
            d = np.zeros(512 << 10, np.uint8)
            if c.get_into([k], [d]) == [Status.OK] and not np.array_equal(d, v):
                errors.append(f"thread {t}: wrong bytes for {k!r}")

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors


def test_rdma_transport_is_refused_clearly(memkv_server, monkeypatch):
    # No such provider: the client cannot be made.
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "no-such-provider")
    with pytest.raises(ValueError, match="transport 'rdma': fi_getinfo"):
        client_for(memkv_server, transport="rdma")
    # A server without --rdma: its keys fail as values and health says why.
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")
    c = client_for(memkv_server, transport="rdma")
    assert c.put([b"r"], [b"v"]) == [Status.UNAVAILABLE]
    (h,) = c.health().values()
    assert "RDMA is off on this server" in h["reason"]


def test_a_server_on_another_provider_refuses_rdma_and_serves_auto_over_tcp(
        memkv_server_factory, monkeypatch):
    srv = memkv_server_factory(memory="16M", lanes=1,
                               extra=["--rdma", "--rdma-provider", "sockets",
                                      "--shm-socket", "off"])
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")
    c = client_for(srv, transport="rdma")
    assert c.put([b"p"], [b"v"]) == [Status.UNAVAILABLE]
    (h,) = c.health().values()
    assert ('the server\'s libfabric provider is "sockets", the client\'s '
            '"tcp;ofi_rxm with 256-byte rxm buffers"') in h["reason"], h
    auto = client_for(srv, transport="auto", rdma_devices=("lo",))
    assert auto.put([b"p"], [b"v"]) == [Status.OK]
    d = bytearray(1)
    assert auto.get_into([b"p"], [d]) == [Status.OK] and d == b"v"


def test_env_config_reaches_the_client(memkv_server, monkeypatch):
    monkeypatch.setenv("MEMKV_SERVERS", memkv_server.address)
    monkeypatch.delenv("MEMKV_CONFIG", raising=False)
    c = MemKVClient.from_config()
    assert c.put([b"env"], [b"ok"]) == [Status.OK]
    assert c.ping()[memkv_server.address] is not None
    assert os.environ["MEMKV_SERVERS"] == memkv_server.address


def test_frozen_server_times_out_then_recovers_logging_each_change_once(transport, memkv_server,
                                                                       caplog):
    """A server that accepts but stops answering (SIGSTOP) costs one op timeout, not a hang;
    retries during its backoff periods stay quiet; once it answers again the client reconnects.
    Going down (with the reason) and coming back are logged once each. Over RDMA the timed-out
    GET's registration is revoked, so the server's late write, once resumed, fails."""
    caplog.set_level(logging.INFO, logger="memkv_client")
    c = client_for(memkv_server, transport=transport, op_timeout_s=1.0, connect_timeout_s=0.5)
    assert c.put([b"f"], [b"1"]) == [Status.OK]
    memkv_server.proc.send_signal(signal.SIGSTOP)
    stat = f"/proc/{memkv_server.proc.pid}/stat"
    while open(stat).read().split(") ")[1][0] != "T":  # wait until it is really stopped
        time.sleep(0.01)
    try:
        t0 = time.monotonic()
        assert c.get_into([b"f"], [bytearray(1)]) == [Status.TIMEOUT]
        assert time.monotonic() - t0 < 1.5
        t_end = time.monotonic() + 2.0  # several backoff periods: retried, still down
        while time.monotonic() < t_end:
            assert c.exists([b"f"])[0] in (Status.TIMEOUT, Status.UNAVAILABLE)
    finally:
        memkv_server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while c.exists([b"f"]) != [Status.OK]:
        assert time.monotonic() < deadline, "client never recovered"
        time.sleep(0.05)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("memkv_client")]
    assert sum("server down" in m for m in msgs) == 1, msgs
    assert sum("answers again" in m for m in msgs) == 1, msgs
    assert "outcome=TIMEOUT" in next(m for m in msgs if "server down" in m)
    assert c.health()[memkv_server.address]["up"] is True
    d = bytearray(1)
    assert c.get_into([b"f"], [d]) == [Status.OK] and d == b"1"


def test_a_restarted_server_is_used_again_with_fresh_values(transport, memkv_server_factory):
    """A server killed and started again on its address: the client finds it once its backoff
    ends (over RDMA with a new handshake and endpoint), misses what the old one held, and
    stores and reads byte-exact again."""
    first = memkv_server_factory(memory="64M", lanes=2)
    c = client_for(first, transport=transport, op_timeout_s=3.0, connect_timeout_s=0.5)
    v = rand_bytes(3 << 20, 1)
    assert c.put([b"before"], [v]) == [Status.OK]
    first.kill()
    assert c.exists([b"before"])[0] in (Status.REFUSED, Status.UNAVAILABLE)
    memkv_server_factory(memory="64M", lanes=2, listen=first.address)
    deadline = time.monotonic() + 15
    while (st := c.exists([b"before"])) != [Status.NOT_FOUND]:
        assert st[0] in (Status.REFUSED, Status.UNAVAILABLE), st
        assert time.monotonic() < deadline, "the restarted server was never used"
        time.sleep(0.05)
    w = rand_bytes(5 << 20, 2)
    assert c.put([b"after"], [w]) == [Status.OK]
    d = np.zeros(5 << 20, np.uint8)
    assert c.get_into([b"after"], [d]) == [Status.OK] and np.array_equal(d, w)


# --- honest outcomes, true deadlines (a server that trickles, refuses, or is not memkv) ---------


def _frame(opcode: int, request_id: int, body: bytes, payload_len: int = 0) -> bytes:
    """One memkv frame header (docs/protocol.md) followed by its body."""
    return struct.pack("<2sBBIQIIQ", b"MK", 1, opcode, 0, request_id, len(body), 0,
                       payload_len) + body


class TricklingPeer(threading.Thread):
    """A fake memkv server for one connection: answers HELLO, then answers the first request
    with `reply(request_id)` (header and body at once) and trickles `trickle` bytes one per
    50 ms until the client hangs up."""

    def __init__(self, reply, trickle: int) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.reply, self.trickle, self.sent = reply, trickle, 0
        self.start()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "client hung up early"
            data += chunk
        return data

    def run(self) -> None:
        conn, _ = self.listener.accept()
        with conn, self.listener:
            self._read(conn, 32)
            conn.sendall(_frame(0x81, 1, struct.pack("<B32sQ", 0, bytes(32), 1 << 20)))
            hdr = self._read(conn, 32)
            request_id, body_len = struct.unpack_from("<QI", hdr, 8)
            self._read(conn, body_len)
            conn.sendall(self.reply(request_id))
            try:
                for _ in range(self.trickle):
                    conn.sendall(b"\xab")
                    self.sent += 1
                    time.sleep(0.05)
            except OSError:
                pass  # the client closed the connection at its deadline


def test_trickled_get_ends_at_the_deadline_and_leaves_unanswered_buffers_alone():
    table = struct.pack("<IBQBQ", 2, Status.NOT_FOUND, 0, Status.OK, 100)
    peer = TricklingPeer(lambda rid: _frame(0x86, rid, table, payload_len=100), trickle=100)
    c = client_for(peer, op_timeout_s=1.0)
    miss, slow = bytearray(b"\x07" * 100), bytearray(b"\x07" * 100)
    t0 = time.monotonic()
    st = c.get_into([b"a", b"b"], [miss, slow])
    took = time.monotonic() - t0
    assert st == [Status.TIMEOUT, Status.TIMEOUT]
    assert took < 1.5, f"a 1 s deadline took {took:.1f} s against a trickling server"
    assert miss == b"\x07" * 100, "a buffer whose key was not answered OK was written"
    after = bytes(slow)
    peer.join(10)
    assert not peer.is_alive() and peer.sent < 40
    assert slow == after, "caller memory written after the call returned"
    h = c.health()[peer.address]
    assert h["up"] is False and h["last_failure"] == "TIMEOUT"


def test_each_failure_says_what_happened(memkv_server_factory, caplog):
    caplog.set_level(logging.DEBUG, logger="memkv_client")
    # Nothing listens: REFUSED, then UNAVAILABLE while marked down, with the reason kept.
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    c = MemKVClient(MemKVConfig(servers=(closed,)))
    assert c.exists([b"k"]) == [Status.REFUSED]
    assert c.exists([b"k"]) == [Status.UNAVAILABLE]
    st = c.stats()[closed]
    assert "error" in st and st["client"]["last_failure"] == "REFUSED"
    assert "refused" in st["client"]["reason"].lower()
    # Wrong key: AUTH_FAILED, and the server is fine for others.
    srv = memkv_server_factory(auth_key=KEY_HEX)
    wrong = client_for(srv, auth_key=bytes.fromhex("cd" * 32))
    assert wrong.put([b"x"], [b"1"]) == [Status.AUTH_FAILED]
    assert wrong.health()[srv.address]["last_failure"] == "AUTH_FAILED"
    # Not a memkv server: PROTOCOL_ERROR.
    peer = TricklingPeer(lambda rid: b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(32), trickle=0)
    assert client_for(peer).exists([b"k"]) == [Status.PROTOCOL_ERROR]
    peer.join(10)
    downs = [r for r in caplog.records if "server down" in r.getMessage()]
    assert len(downs) == 3, [r.getMessage() for r in downs]  # one per server, not per call
    assert all(r.levelno == logging.WARNING for r in downs)


def test_batches_beyond_the_frame_limits_are_split(memkv_server):
    c = client_for(memkv_server, connections_per_server=1)  # the whole batch on one connection
    keys = [b"split/%d" % i for i in range(70_000)]  # more keys than one frame carries
    assert set(c.exists(keys)) == {Status.NOT_FOUND}
    assert c.health()[memkv_server.address]["up"] is True


def test_existence_checks_answer_every_key_in_place_across_servers_and_frames(memkv_cluster2):
    """Empty batches, repeated keys, keys of both servers interleaved, invalid keys among valid
    ones, and a batch of more keys than one frame carries: each answer lands at its key's place."""
    c = client_for(*memkv_cluster2)
    stored = [b"ex/%06d" % i for i in range(0, 70_000, 7)]
    assert c.put(stored, [b"x" * 5] * len(stored)) == [Status.OK] * len(stored)
    assert min(s.stats()["items"] for s in memkv_cluster2) > len(stored) // 3
    keys = [b"ex/%06d" % i for i in range(70_000)]  # over MAX_BATCH (65,536): several frames
    hit = [i % 7 == 0 for i in range(70_000)]
    codes = c.codes.exists(keys)
    assert codes == bytes(Status.OK if h else Status.NOT_FOUND for h in hit)
    assert c.exists(keys) == list(map(Status, codes))
    # Repeats, invalid keys between valid ones, and keys as other bytes-like objects.
    mixed = [keys[7], b"", keys[7], keys[1], b"k" * 2000, bytearray(keys[14]), keys[7]]
    ok, miss, bad = Status.OK, Status.NOT_FOUND, Status.INVALID_KEY
    assert c.exists(mixed) == [ok, bad, ok, miss, bad, ok, ok]
    assert c.codes.exists_lengths(mixed) == (bytes([ok, bad, ok, miss, bad, ok, ok]),
                                             [5, 0, 5, 0, 0, 5, 5])
    assert c.codes.exists(iter(mixed[:4])) == bytes([ok, bad, ok, miss])  # any iterable
    assert c.codes.submit_exists(tuple(mixed)).wait(30) == bytes([ok, bad, ok, miss, bad, ok, ok])
    # Leases on repeated keys: one lease per value, the same answers.
    assert c.exists([keys[0], keys[0]], lease_ms=60_000) == [ok, ok]
    assert c.exists([]) == [] and c.codes.exists([]) == b"" and c.exists_lengths([]) == []
    assert c.codes.submit_exists([]).wait(30) == b""
    with pytest.raises(TypeError):
        c.exists(["a str is not a key"])
    with pytest.raises(TypeError):
        c.exists(None)
    stats = [s.stats() for s in memkv_cluster2]
    assert not any(n for st in stats for n in st["errors"].values())
    # The servers counted every key they answered: two full passes, three of `mixed` (five
    # valid keys, four hits), its first four once, and the leased pair.
    total = {k: sum(st[k] for st in stats) for k in ("exists_hits", "exists_misses",
                                                     "leases_granted")}
    assert total == {"exists_hits": 2 * 10_000 + 3 * 4 + 2 + 2,
                     "exists_misses": 2 * 60_000 + 3 * 1 + 1, "leases_granted": 2}


def test_status_codes_say_what_the_enums_say_for_hits_misses_and_a_down_server(
        memkv_cluster2):
    up, down = memkv_cluster2
    down.kill()
    keys = [b"codes/%d" % i for i in range(300)]
    client_for(up).put(keys[::2], [b"8 bytes!"] * 150)  # stored where the pair looks for them
    # Each sees the failure anew, each key of a server in one request (one REFUSED answer).
    codes_c, enums_c = (client_for(up, down, connections_per_server=1) for _ in range(2))
    owner = [codes_c.server_of(k) for k in keys]

    def expected(down_status: Status) -> list[Status]:
        return [down_status if o == down.address else Status.OK if i % 2 == 0 else
                Status.NOT_FOUND for i, o in enumerate(owner)]

    first = expected(Status.REFUSED)  # nothing listens; then UNAVAILABLE while marked down
    assert {Status.OK, Status.NOT_FOUND, Status.REFUSED} <= set(first)
    codes, enums = codes_c.codes.exists(keys), enums_c.exists(keys)
    assert isinstance(codes, bytes) and list(codes) == first
    assert enums == first and all(type(s) is Status for s in enums)
    later = expected(Status.UNAVAILABLE)

    def down_as_unavailable(got: list[int] | list[Status], n: int = len(keys)) -> list[Status]:
        """`got` with the down server's keys as UNAVAILABLE, after checking they all say the same,
        UNAVAILABLE while it is marked down or REFUSED once the 100 ms mark lapsed (a slow box)."""
        down_said = {Status(got[i]) for i in range(n) if owner[i] == down.address}
        assert len(down_said) <= 1 and down_said <= {Status.UNAVAILABLE, Status.REFUSED}, got
        return [Status.UNAVAILABLE if owner[i] == down.address else Status(got[i])
                for i in range(n)]

    assert down_as_unavailable(codes_c.codes.exists(keys)) == later
    assert down_as_unavailable(enums_c.exists(keys)) == later
    op = codes_c.codes.submit_exists(keys)
    assert down_as_unavailable(op.wait(30)) == later
    assert down_as_unavailable(enums_c.submit_exists(keys).wait(30)) == later
    lens = [8 if s == Status.OK else 0 for s in later]
    codes, got_lens = codes_c.codes.exists_lengths(keys)
    assert down_as_unavailable(codes) == later and got_lens == lens
    pairs = enums_c.exists_lengths(keys)
    assert down_as_unavailable([s for s, _ in pairs]) == later and [n for _, n in pairs] == lens
    codes, got_lens = op.wait_lengths(0)  # the finished op answers again, the same
    assert down_as_unavailable(codes) == later and got_lens == lens
    got = [bytearray(8) for _ in keys]
    assert down_as_unavailable(codes_c.codes.get_into(keys, got)) == later
    assert down_as_unavailable(enums_c.get_into(keys, got)) == later
    assert down_as_unavailable(codes_c.codes.delete(keys[:2]), 2) == later[:2]
    gone = [Status.NOT_FOUND if s in (Status.OK, Status.NOT_FOUND) else s for s in later[:2]]
    assert down_as_unavailable(enums_c.delete(keys[:2]), 2) == gone
    with pytest.raises(ValueError, match="EXISTS"):
        codes_c.codes.submit_put([b"x"], [b"1"]).wait_lengths(30)


def test_status_numbers_match_the_native_client():
    assert dict(_native.statuses()) == {s.name: s.value for s in Status}


def test_native_client_places_keys_like_the_config_whatever_the_spelling(memkv_cluster2):
    a, b = (s.port for s in memkv_cluster2)
    canon = (f"127.0.0.1:{a}", f"localhost:{b}")
    py = MemKVClient(MemKVConfig(servers=canon))
    raw = _native.Client([f" 127.0.0.1:{a}\t", f"LocalHost.:{b}"])
    assert raw.servers() == list(canon)
    assert [parse_server(s) for s in (f" 127.0.0.1:{a}\t", f"LocalHost.:{b}")] == list(canon)
    for i in range(2000):
        k = b"place/%d" % i
        assert canon[raw.server_of(k)] == py.server_of(k)


def test_transport_auto_runs_tcp_and_says_so(memkv_server):
    # The client says it once per process: a fresh process, whatever other tests said before.
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from memkv_vllm.core.client import MemKVClient, Status\n"
        "from memkv_vllm.core.config import MemKVConfig\n"
        f"c = MemKVClient(MemKVConfig(servers=({memkv_server.address!r},), transport='auto',"
        " rdma_devices=('mlx5_0',)))\n"
        "assert c.put([b'auto'], [b'1']) == [Status.OK]\n"
        "c.put([b'auto2'], [b'2'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    said = [line for line in out.splitlines() if "no usable RDMA" in line]
    assert len(said) == 1 and "using TCP" in said[0], out


def test_bench_against_a_too_small_server_fails_clearly():
    out = subprocess.run(
        memkv_command() + ["bench", "--memory", "8M", "--sizes", "4M", "--threads", "2",
                           "--keys", "4", "--volume", "16M", "--repeat", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "exceeds the servers' memory" in out.stderr
    assert "panic" not in (out.stdout + out.stderr).lower()
    assert "Traceback" not in out.stderr


def test_odd_numbers_from_python_raise_value_errors_not_panics(memkv_server):
    c = client_for(memkv_server)
    op = c.submit_exists([b"k"])
    assert op.wait(float("inf")) == [Status.NOT_FOUND]  # inf = no limit
    assert op.wait(-1) == [Status.NOT_FOUND]  # negative = poll
    with pytest.raises(ValueError, match="NaN"):
        op.wait(float("nan"))
    with pytest.raises(ValueError, match="seconds"):
        _native.Client([memkv_server.address], None, 2, 1.0, 1e300)


def test_cli_rejects_a_bad_timeout_without_a_panic():
    out = subprocess.run(memkv_command() + ["ping", "--timeout=-1", "--servers", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "--timeout -1 is not a positive number of seconds" in out.stderr
    assert "panic" not in out.stderr.lower()


def test_keys_grouped_by_server_are_the_keys_each_server_owns(memkv_cluster2):
    """`by_server` (what the block store probes each server with) is the client's placement."""
    c = client_for(*memkv_cluster2)
    keys = [b"group/%d" % i for i in range(300)]
    groups = c.by_server(keys)
    assert len(groups) == 2 and sorted(k for g in groups for k in g) == sorted(keys)
    for g in groups:
        assert len({c.server_of(k) for k in g}) == 1
        assert g == [k for k in keys if k in set(g)]  # in the keys' order
    one = client_for(memkv_cluster2[0])
    assert one.by_server(keys) == [keys] and one.by_server([]) == []
    c.close()
    one.close()
