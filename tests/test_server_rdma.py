"""The server's RDMA data path against hostile and broken peers: a real `memkv serve --rdma` on
loopback (libfabric's tcp provider) spoken to with hand-made frames (docs/protocol.md, "RDMA data
path") from `_native.RdmaTestPeer`, a bare libfabric endpoint whose registered memory the server
reads and writes. Each bad request gets a per-key status or an error frame, touches no byte it
was not given, leaks nothing, and leaves the server serving TCP and RDMA clients."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from memkv_procs import memkv_command, proc_status
from test_server import (
    ERROR,
    GET,
    PING,
    PUT,
    connect,
    hello,
    read_frame,
    still_serving,
)
from test_server_limits import KEY, authed

from memkv_vllm import _native
from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig

RDMA_HELLO, FLAG_RDMA = 0x09, 1
MALFORMED, UNAUTHENTICATED, STALLED = 4, 6, 10
MIB = 1 << 20
# The same-host path off: `auto` clients of these servers are to take RDMA (or fall back to
# TCP), not the unix socket a local server serves by default.
RDMA_ARGS = ["--rdma", "--rdma-provider", "tcp", "--rdma-devices", "lo", "--shm-socket", "off"]


def frame(op: int, body: bytes, flags: int = 0) -> bytes:
    return b"MK" + struct.pack("<BBIQIIQ", 1, op, flags, 1, len(body), 0, 0) + body


def rdma_hello_body(provider: bytes, address: bytes) -> bytes:
    return struct.pack("<B", len(provider)) + provider + struct.pack("<H", len(address)) + address


def descriptors(items: list[tuple[bytes, int, int, int]]) -> bytes:
    """(key, length, addr, rkey) per key."""
    return struct.pack("<I", len(items)) + b"".join(
        struct.pack("<H", len(k)) + k + struct.pack("<QQQ", n, a, r) for k, n, a, r in items)


class Peer:
    """A raw RDMA client: one TCP control connection with an accepted RDMA_HELLO."""

    def __init__(self, srv, ep: _native.RdmaTestPeer, sock: socket.socket | None = None) -> None:
        self.ep = ep
        self.s = sock or connect(srv)
        if sock is None:
            hello(self.s)
        ok, why = self.rdma_hello(ep.provider().encode(), ep.address())
        assert ok, why

    def rdma_hello(self, provider: bytes, address: bytes) -> tuple[bool, str]:
        self.s.sendall(frame(RDMA_HELLO, rdma_hello_body(provider, address)))
        op, body, _ = read_frame(self.s)
        assert op == 0x89, op
        return body[0] == 1, body[1:].decode()

    def desc(self, key: bytes, offset: int, length: int) -> tuple[bytes, int, int, int]:
        addr, rkey = self.ep.descriptor(offset)
        return key, length, addr, rkey

    def put(self, *items: tuple[bytes, int, int, int]) -> list[int]:
        self.s.sendall(frame(PUT, descriptors(list(items)), FLAG_RDMA))
        op, body, plen = read_frame(self.s)
        assert op == 0x85 and plen == 0, (op, body)
        return list(body[4:])

    def get(self, *items: tuple[bytes, int, int, int]) -> list[tuple[int, int]]:
        self.s.sendall(frame(GET, descriptors(list(items)), FLAG_RDMA))
        op, body, plen = read_frame(self.s)
        assert op == 0x86 and plen == 0, (op, body)
        return [struct.unpack_from("<BQ", body, 4 + 9 * i) for i in range(len(items))]

    def closed(self) -> bool:
        """The server closed the connection (after its last reply)."""
        self.s.settimeout(10)
        try:
            return self.s.recv(1) == b""
        except ConnectionResetError:
            return True


@pytest.fixture
def endpoints() -> Iterator:
    """``make(size, progress=True)``: test endpoints on tcp/lo, closed after the test."""
    made: list[_native.RdmaTestPeer] = []

    def make(size: int, progress: bool = True) -> _native.RdmaTestPeer:
        made.append(_native.RdmaTestPeer("tcp", "lo", size, progress))
        return made[-1]

    yield make
    for ep in made:
        ep.close()


@pytest.fixture
def rdma_server(memkv_server_factory):
    return memkv_server_factory(memory="64M", lanes=2, extra=RDMA_ARGS)


def rdma_still_serving(srv) -> None:
    """A fresh RDMA client (the real one) still round-trips a value byte-exact."""
    c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma", rdma_devices=("lo",)))
    try:
        v = bytes(range(256)) * 1000
        assert c.put([b"rdma-alive"], [v]) == [Status.OK]
        d = bytearray(len(v))
        assert c.get_into([b"rdma-alive"], [d]) == [Status.OK] and d == v
    finally:
        c.close()


@pytest.fixture(autouse=True)
def _rdma_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")


def test_values_round_trip_by_hand_and_misses_touch_nothing(rdma_server, endpoints):
    ep = endpoints(8 * MIB)
    p = Peer(rdma_server, ep)
    value = bytes((i * 7 + i // 251) % 256 for i in range(3 * MIB + 5))  # several chunks
    ep.write(0, value)
    assert p.put(p.desc(b"v", 0, len(value)), p.desc(b"empty", 0, 0)) == [Status.OK] * 2
    ep.write(4 * MIB, b"\xee" * (4 * MIB))
    got = p.get(p.desc(b"v", 4 * MIB, len(value)), p.desc(b"absent", 4 * MIB - 100, 100),
                p.desc(b"empty", 0, 0))
    assert got == [(Status.OK, len(value)), (Status.NOT_FOUND, 0), (Status.OK, 0)]
    assert ep.read(4 * MIB, len(value)) == value
    assert p.get(p.desc(b"v", 4 * MIB - 50, 10)) == [(Status.LENGTH_MISMATCH, len(value))]
    assert ep.read(4 * MIB - 100, 100) == b"\0" * 100, "misses write no byte"
    # The real client reads what the hand-made one stored.
    c = MemKVClient(MemKVConfig(servers=(rdma_server.address,)))
    d = bytearray(len(value))
    assert c.get_into([b"v"], [d]) == [Status.OK] and d == value


def test_hostile_descriptors_fail_their_key_and_touch_nothing_else(rdma_server, endpoints):
    ep = endpoints(2 * MIB)
    value = bytes(range(256)) * 1024
    ep.write(0, value)
    p = Peer(rdma_server, ep)
    assert p.put(p.desc(b"good", 0, len(value))) == [Status.OK]
    # A key the registration does not have: REMOTE_ACCESS, nothing stored, connection closed.
    key, n, addr, rkey = p.desc(b"bad", 0, 1000)
    assert p.put((key, n, addr, rkey ^ 0x5A5A)) == [Status.REMOTE_ACCESS]
    assert p.closed()
    # An address past the registration's end: the write fails, the memory is as it was.
    before = ep.read(0, 2 * MIB)
    p = Peer(rdma_server, ep)
    assert p.get(p.desc(b"good", 2 * MIB - 8, len(value))) == [(Status.REMOTE_ACCESS, 0)]
    assert p.closed()
    assert ep.read(0, 2 * MIB) == before
    # A length no lane can hold is refused before any read; absurd addresses fail as values.
    p = Peer(rdma_server, ep)
    assert p.put(p.desc(b"huge", 0, 1 << 62)) == [Status.TOO_LARGE]
    assert p.get((b"good", len(value), 2**64 - 8, 0)) == [(Status.REMOTE_ACCESS, 0)]
    assert p.closed()
    c = MemKVClient(MemKVConfig(servers=(rdma_server.address,)))
    assert c.exists([b"bad", b"huge"]) == [Status.NOT_FOUND] * 2
    st = rdma_server.stats()
    assert st["errors"]["rdma_remote"] == 3 and st["in_transfer_bytes"] == 0
    still_serving(rdma_server)
    rdma_still_serving(rdma_server)


def test_broken_handshakes_are_refused_with_their_reason(memkv_server_factory, endpoints):
    srv = memkv_server_factory(memory="16M", lanes=1, auth_key=KEY, extra=RDMA_ARGS)
    ep = endpoints(4096)
    # Before AUTH: refused unread, the connection closed.
    s = connect(srv)
    hello(s)
    s.sendall(frame(RDMA_HELLO, rdma_hello_body(b"tcp;ofi_rxm", ep.address())))
    op, body, _ = read_frame(s)
    assert op == ERROR and struct.unpack("<H", body[:2])[0] == UNAUTHENTICATED
    # Another provider's client, an address of the wrong length, a name that is not UTF-8.
    p = Peer(srv, ep, authed(srv))
    assert p.rdma_hello(b"verbs;ofi_rxm", ep.address()) == (
        False, "the server's libfabric provider is \"tcp;ofi_rxm with 256-byte rxm buffers\", "
               "the client's \"verbs;ofi_rxm\"")
    # The same provider with rxm buffers of another size (FI_OFI_RXM_BUFFER_SIZE set on one side
    # only, or a memkv that left rxm's default): rxm would refuse the server's connection to it
    # and every transfer would stall until its deadline, so it is refused here, with the reason.
    assert p.rdma_hello(b"tcp;ofi_rxm", ep.address()) == (
        False, "the server's libfabric provider is \"tcp;ofi_rxm with 256-byte rxm buffers\", "
               "the client's \"tcp;ofi_rxm\"")
    ok, why = p.rdma_hello(ep.provider().encode(), b"\1\2\3")
    assert not ok and "3-byte endpoint address" in why
    p.s.sendall(frame(RDMA_HELLO, rdma_hello_body(b"\xff\xfe", ep.address())))
    op, body, _ = read_frame(p.s)
    assert op == ERROR and struct.unpack("<H", body[:2])[0] == MALFORMED
    # An RDMA transfer before an accepted RDMA_HELLO: an error frame naming it.
    s = authed(srv)
    s.sendall(frame(PUT, descriptors([(b"k", 10, 0, 0)]), FLAG_RDMA))
    op, body, _ = read_frame(s)
    assert op == ERROR and b"before RDMA_HELLO" in body
    assert srv.stats()["errors"]["rdma_refused"] == 3


def test_a_server_without_rdma_refuses_the_handshake_and_keeps_the_connection(
        memkv_server, endpoints):
    ep = endpoints(4096)
    s = connect(memkv_server)
    hello(s)
    s.sendall(frame(RDMA_HELLO, rdma_hello_body(ep.provider().encode(), ep.address())))
    op, body, _ = read_frame(s)
    assert (op, body) == (0x89, b"\0RDMA is off on this server (start it with --rdma)")
    s.sendall(frame(PING, b""))  # the connection still serves
    assert read_frame(s)[0] == 0x83


# A client whose endpoint cannot answer the server's reads: it sends its PUT and stops (SIGSTOP)
# with all its threads. An endpoint that is merely never progressed by its owner is not enough:
# the tcp provider's own threads (rxm's connection progress) sometimes serve the reads anyway.
_STOPPED_CLIENT = """
import os, signal, struct, sys, time
from types import SimpleNamespace
from memkv_vllm import _native
from test_server import ERROR, read_frame
from test_server_rdma import FLAG_RDMA, MIB, PUT, Peer, descriptors, frame
p = Peer(SimpleNamespace(address=sys.argv[1]), _native.RdmaTestPeer("tcp", "lo", MIB, False))
request = frame(PUT, descriptors([p.desc(b"slow", 0, 100_000)]), FLAG_RDMA)
print(time.monotonic(), flush=True)
p.s.sendall(request)
os.kill(os.getpid(), signal.SIGSTOP)
op, body, _ = read_frame(p.s)
print(op, struct.unpack("<H", body[:2])[0] if op == ERROR else None, p.closed(), flush=True)
"""


def test_a_client_that_stops_driving_its_endpoint_is_cut_off_at_the_deadline(
        memkv_server_factory):
    srv = memkv_server_factory(memory="16M", lanes=1,
                               extra=RDMA_ARGS + ["--frame-timeout", "1", "--min-rate", "1M"])
    tests = str(Path(__file__).parent)
    child = subprocess.Popen([sys.executable, "-c", _STOPPED_CLIENT, srv.address], cwd=tests,
                             env={**os.environ, "PYTHONPATH": tests}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        sent = float(child.stdout.readline())
        while (srv.stats()["errors"].get("stalled", 0) == 0
               and time.monotonic() - sent < 10):
            time.sleep(0.02)
        took = time.monotonic() - sent
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
    # 1 s allowance plus 100 kB at 1 MiB/s, and not much more; the client then reads the
    # error and finds the connection closed.
    assert 1.0 <= took < 5.0, (took, err)
    assert out.split() == [str(ERROR), str(STALLED), "True"], (out, err)
    st = srv.stats()
    assert (st["items"], st["memory_used_bytes"], st["in_transfer_bytes"]) == (0, 0, 0)
    assert st["errors"]["stalled"] == 1
    rdma_still_serving(srv)


def test_a_client_gone_before_its_transfer_costs_one_key_and_no_memory(memkv_server_factory,
                                                                      endpoints):
    rdma_server = memkv_server_factory(memory="64M", lanes=2,
                                       extra=RDMA_ARGS + ["--frame-timeout", "1"])
    value = b"g" * MIB
    ep = endpoints(len(value))
    ep.write(0, value)
    p = Peer(rdma_server, ep)
    assert p.put(p.desc(b"g", 0, len(value))) == [Status.OK]
    gone = endpoints(len(value))
    q = Peer(rdma_server, gone)
    d = q.desc(b"g", 0, len(value))
    gone.close()  # the endpoint and its registration vanish; the TCP connection stays
    q.s.sendall(frame(GET, descriptors([d]), FLAG_RDMA))
    op, body, _ = read_frame(q.s)
    if op == ERROR:  # the provider never reports the peer gone: the deadline ends it
        assert struct.unpack("<H", body[:2])[0] == STALLED
    else:
        assert op == 0x86 and body[4] == Status.REMOTE_ACCESS
    assert q.closed()
    deadline = time.monotonic() + 10
    while rdma_server.stats()["in_transfer_bytes"]:
        assert time.monotonic() < deadline, "the value stayed pinned"
        time.sleep(0.05)
    rdma_still_serving(rdma_server)


def test_a_put_of_many_keys_over_rdma_is_served_in_one_frame(rdma_server, endpoints):
    """1,000 keys in one frame, each its own read or write and status."""
    ep = endpoints(1000 * 64)
    for i in range(1000):
        ep.write(64 * i, bytes([i % 256]) * 64)
    p = Peer(rdma_server, ep)
    items = [p.desc(b"many/%d" % i, 64 * i, 64) for i in range(1000)]
    assert p.put(*items) == [Status.OK] * 1000
    ep.write(0, b"\0" * 64000)
    assert p.get(*items[::-1]) == [(Status.OK, 64)] * 1000
    assert all(ep.read(64 * i, 64) == bytes([i % 256]) * 64 for i in range(1000))


def test_cli_bench_over_rdma_prints_its_figures_beside_tcps():
    """`memkv bench --transport rdma` end to end on a tiny volume: each row carries the TCP
    figures and, beside them, memkv's over RDMA, all positive (speed is not asserted here:
    docs/benchmarks.md records it)."""
    out = subprocess.run(
        memkv_command() + ["bench", "--transport", "rdma", "--rdma-provider", "tcp",
                           "--rdma-devices", "lo", "--sizes", "64K,1M", "--threads", "1",
                           "--volume", "4M", "--memory", "64M", "--repeat", "1", "--keys", "3"],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    head = next(ln for ln in lines if ln.lstrip().startswith("value thr"))
    assert head.split("|")[-1].split() == ["rdma-put", "rdma-get"]
    rows = [ln for ln in lines if ln.lstrip()[:1].isdigit() and "|" in ln]
    assert [r.split()[:2] for r in rows] == [["64K", "1"], ["1M", "1"]]
    for r in rows:
        cells = r.split("|")
        put, get = map(float, cells[2].split())
        rdma_put, rdma_get = map(float, cells[-1].split())
        assert min(put, get, rdma_put, rdma_get) > 0, r


def test_rdma_endpoints_are_bounded_and_given_back(memkv_server_factory, endpoints):
    """Each RDMA connection costs the provider's own buffers outside --memory (about 2.5 MiB
    over tcp;ofi_rxm), so their number is bounded: RDMA_HELLO past it is refused with the
    reason, a closed connection gives its endpoint back, and `auto` clients fall back to TCP."""
    srv = memkv_server_factory(memory="16M", lanes=1,
                               extra=RDMA_ARGS + ["--max-rdma-connections", "2"])
    ep = endpoints(4096)
    first, _second = Peer(srv, ep), Peer(srv, ep)
    s = connect(srv)
    hello(s)
    third = Peer.__new__(Peer)
    third.ep, third.s = ep, s
    assert third.rdma_hello(ep.provider().encode(), ep.address()) == (
        False, "the server's RDMA connections are at their bound (2, --max-rdma-connections)")
    auto = MemKVClient(MemKVConfig(servers=(srv.address,), transport="auto",
                                   rdma_devices=("lo",), connections_per_server=1))
    d = bytearray(3)
    assert auto.put([b"a"], [b"abc"]) == [Status.OK]
    assert auto.get_into([b"a"], [d]) == [Status.OK] and d == b"abc"
    first.s.close()
    deadline = time.monotonic() + 10
    while not third.rdma_hello(ep.provider().encode(), ep.address())[0]:
        assert time.monotonic() < deadline, "a closed connection kept its endpoint"
        time.sleep(0.05)
    assert srv.stats()["errors"]["rdma_refused"] >= 2


def test_a_server_of_other_rxm_buffers_refuses_rdma_and_serves_auto_over_tcp(
        memkv_server_factory, endpoints, monkeypatch):
    """The user's FI_OFI_RXM_BUFFER_SIZE wins over memkv's: this server keeps rxm's default
    buffers and names its provider as a memkv that never set them does. rxm would refuse its
    connections to this process's endpoints (256-byte buffers), so RDMA_HELLO is refused with
    the reason and an `auto` client moves its values over TCP instead of stalling."""
    monkeypatch.setenv("FI_OFI_RXM_BUFFER_SIZE", "16384")
    srv = memkv_server_factory(memory="16M", lanes=1, extra=RDMA_ARGS)
    monkeypatch.delenv("FI_OFI_RXM_BUFFER_SIZE")
    assert "rxm=memkv set FI_OFI_RXM_MSG_RX_SIZE=16; the user's FI_OFI_RXM_BUFFER_SIZE=16384" in (
        srv.log())
    ep = endpoints(4096)
    s = connect(srv)
    hello(s)
    p = Peer.__new__(Peer)
    p.ep, p.s = ep, s
    assert p.rdma_hello(ep.provider().encode(), ep.address()) == (
        False, "the server's libfabric provider is \"tcp;ofi_rxm\", the client's "
               "\"tcp;ofi_rxm with 256-byte rxm buffers\"")
    auto = MemKVClient(MemKVConfig(servers=(srv.address,), transport="auto",
                                   rdma_devices=("lo",)))
    value = bytes(range(256)) * 4096
    d = bytearray(len(value))
    assert auto.put([b"a"], [value]) == [Status.OK]
    assert auto.get_into([b"a"], [d]) == [Status.OK] and d == value
    auto.close()


def rss(pid: int | str = "self") -> int:
    return proc_status(pid, "VmRSS") << 10


# What one RDMA connection may cost in resident memory, in the server and in the client: about
# 2.5 MiB over tcp;ofi_rxm with memkv's rxm sizes (docs/rdma.md, "Memory per connection"), 85
# MiB (server) and 71 MiB (client) with rxm's defaults.
ENDPOINT_RSS = 8 * MIB
CONNECTIONS = 8


def test_an_rdma_connection_costs_the_server_a_few_mib(memkv_server_factory, endpoints):
    """The server's RSS grows by less than ENDPOINT_RSS per RDMA connection that moved a 1 MiB
    value each way (the rxm buffers are allocated by then), values byte-exact; its default bound
    on such connections is sized by that cost."""
    srv = memkv_server_factory(memory="16M", lanes=1, extra=RDMA_ARGS)
    ep = endpoints(2 * MIB)
    value = bytes((i * 13 + i // 256) % 256 for i in range(MIB))
    ep.write(0, value)
    assert srv.proc is not None
    before = rss(srv.proc.pid)
    peers = [Peer(srv, ep) for _ in range(CONNECTIONS)]
    for i, p in enumerate(peers):
        ep.write(MIB, b"\0" * MIB)
        assert p.put(p.desc(b"v%d" % i, 0, MIB)) == [Status.OK]
        assert p.get(p.desc(b"v%d" % i, MIB, MIB)) == [(Status.OK, MIB)]
        assert ep.read(MIB, MIB) == value
    grown = rss(srv.proc.pid) - before
    assert grown < CONNECTIONS * ENDPOINT_RSS, (
        f"{CONNECTIONS} RDMA connections grew the server's RSS by {grown / MIB:.0f} MiB")
    out = subprocess.run(memkv_command() + ["serve", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert "--max-rdma-connections <MAX_RDMA_CONNECTIONS>" in out.stdout
    assert "[default: 256]" in out.stdout.split("--max-rdma-connections")[1].split("\n  -")[0]


def test_an_rdma_connection_costs_the_client_a_few_mib(memkv_server_factory):
    """This process's RSS grows by less than ENDPOINT_RSS per RDMA connection of a client that
    fanned a batch out over CONNECTIONS of them (each moving its values both ways, byte-exact)."""
    srv = memkv_server_factory(memory="64M", lanes=1, extra=RDMA_ARGS)
    n = 4 * CONNECTIONS  # the client sends four values per connection of a fanned-out batch
    keys = [b"c%d" % i for i in range(n)]
    values = [bytes([i]) * (256 << 10) for i in range(n)]
    bufs = [bytearray(len(v)) for v in values]
    before = rss()
    c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma", rdma_devices=("lo",),
                                connections_per_server=CONNECTIONS))
    try:
        assert c.put(keys, values) == [Status.OK] * n
        assert c.get_into(keys, bufs) == [Status.OK] * n and bufs == values
        grown = rss() - before
        opened = srv.stats()["connections"] - 1  # less the stats request's own
        assert opened >= 2, "the batch did not fan out"
        assert grown < opened * ENDPOINT_RSS, (
            f"{opened} RDMA connections grew the client's RSS by {grown / MIB:.0f} MiB")
    finally:
        c.close()
