"""Attacks on a real `memkv serve` from outside that once exhausted it: floods of its metrics port,
a low open-files limit turned into a lockout, requests that announce more than they send, and TLS
handshakes that are garbage, floods or trickles.
Each test drives the real server with raw sockets and failed against the server before its fix;
the last ones are tenants trying to reach beyond their key prefix. The attacks on the request
path run over TCP and over the same-host transport's unix socket (`link`): a peer there gets the
same deadlines, budgets and refusals (docs/shm.md)."""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import ssl
import struct
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from memkv_procs import proc_status
from test_server import (
    AUTH,
    DELETE,
    EXISTS,
    GET,
    HELLO,
    PING,
    PUT,
    STATS,
    assert_closed_with_error,
    connect,
    header,
    hello,
    key_lens,
    read_frame,
    recv_exact,
)
from test_server_limits import (
    KEY,
    MALFORMED,
    STALLED,
    UNAUTHENTICATED,
    authed,
    error_code,
    round_trip_s,
    rss,
)
from test_tenants import KEY_A, KEY_B, tenant_server
from tls_certs import Pki

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig

AUTH_FAILED = 7


def unix(srv) -> socket.socket:
    """A connection to `srv`'s default same-host socket (the abstract name of its address)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(f"\0memkv/{srv.address}")
    return s


@pytest.fixture(params=[connect, unix], ids=["tcp", "unix"])
def dial(request: pytest.FixtureRequest) -> Callable[[Any], socket.socket]:
    """How the attacker reaches the server: TCP, or the same-host unix socket."""
    return request.param


def served_on_both_links(srv, key: str | None = KEY) -> None:
    """A fresh client gets byte-exact round trips over TCP and over the same-host path."""
    round_trip_s(srv, key)
    round_trip_s(srv, key, transport="shm")


def open_fds(srv) -> int:
    return len(list(Path(f"/proc/{srv.proc.pid}/fd").iterdir()))


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_metrics_port_floods_cost_neither_threads_nor_memory(memkv_server_factory):
    srv = memkv_server_factory(memory="64M", auth_key=KEY, metrics=True)
    port = srv.metrics_port
    assert "memkv_items 0" in scrape(port)
    threads, base = proc_status(srv.proc.pid, "Threads"), rss(srv)
    # Silent connections: each once took a thread of the HTTP server, without limit.
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(400)]
    # A peer pipelining requests without reading the replies: they were queued without limit.
    pipe = socket.create_connection(("127.0.0.1", port), timeout=5)
    pipe.setblocking(False)
    requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 4096
    sent, t = 0, time.monotonic()
    while sent < 64 << 20 and time.monotonic() - t < 3:
        try:
            sent += pipe.send(requests)
        except BlockingIOError:
            time.sleep(0.01)
        except OSError:  # answered once and closed: the rest is never read
            break
    try:
        assert proc_status(srv.proc.pid, "Threads") <= threads + 1
        assert open_fds(srv) <= 64
        assert rss(srv) - base < 16 << 20
        # A scraper still gets in (the oldest silent connections give way), and so do clients.
        assert "memkv_items 0" in scrape(port)
        assert round_trip_s(srv) < 1.0
    finally:
        for s in [*silent, pipe]:
            s.close()
    for head, status in [(b"GET /other HTTP/1.1\r\n\r\n", b"404"),
                         (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
                         (b"x" * (8 << 10), b"431"),  # a head longer than 8 KiB
                         (header(GET, 0), b"400")]:  # a memkv frame: not HTTP
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head)
        s.shutdown(socket.SHUT_WR)
        reply = s.recv(4096)
        s.close()
        assert (reply.split(b" ")[1] if reply else b"") == status, reply
    assert srv.alive()


@pytest.mark.parametrize("nofile,serves", [("256:4096", 1024), ("256", 96)])
def test_the_open_files_limit_cannot_lock_out_a_client_with_the_key(
        memkv_server_factory, nofile, serves):
    """Each connection holds two descriptors. Out of descriptors, the server could not accept the
    connection that would close the oldest unauthenticated one, so 128 silent sockets under a
    256-descriptor limit locked a client with the key out. The server raises its soft limit to
    what --max-connections needs; where the hard limit is lower it serves fewer connections."""
    srv = memkv_server_factory(memory="16M", auth_key=KEY, wrapper=["prlimit", f"--nofile={nofile}",
                                                                    "--"],
                               extra=["--handshake-timeout", "30"])
    limits = Path(f"/proc/{srv.proc.pid}/limits").read_text()
    soft = int(next(ln for ln in limits.splitlines() if ln.startswith("Max open files")).split()[3])
    assert soft >= min(4096, 2 * 1024 + 64) if serves == 1024 else soft == 256
    silent = [connect(srv) for _ in range(300)]
    try:
        assert round_trip_s(srv) < 1.0
    finally:
        for s in silent:
            s.close()
    assert ("serving_connections=96" in srv.log()) == (serves == 96), srv.log()


def test_a_request_that_stops_sending_is_cut_off_whatever_size_it_announced(
        memkv_server_factory, dial):
    """The deadline of a request counted the payload length its header announces, before the
    key table vouched for it: four PUTs announcing 16 MiB bodies and 2^62 payload bytes held the
    whole buffer budget for decades, and every other client's request got BUSY. A request must
    now keep pace with the minimum rate as its bytes arrive."""
    srv = memkv_server_factory(memory="256M", auth_key=KEY, extra=["--frame-timeout", "1"])
    liars = []
    for _ in range(4):
        s = authed(srv, dial=dial)
        s.sendall(header(PUT, 16 << 20, payload_len=1 << 62))
        liars.append(s)
    # Clients wait for the budget for up to the frame timeout; the liars fall behind their pace
    # at the frame timeout, so a client is served within two of them.
    t = time.monotonic()
    while True:
        try:
            round_trip_s(srv)
            break
        except AssertionError:
            assert time.monotonic() - t < 2.5, "no client served while the liars hold the budget"
    for s in liars:
        s.settimeout(10)
        assert error_code(s) == STALLED
    assert time.monotonic() - t < 5
    # A well-formed table whose one value is far over the limit: its bytes would be read and
    # discarded, at 1 MiB/s over 2^50 bytes.
    body = key_lens([(b"huge", 1 << 50)])
    huge = authed(srv, dial=dial)
    huge.settimeout(10)
    t = time.monotonic()
    huge.sendall(header(PUT, len(body), payload_len=1 << 50) + body)
    assert error_code(huge) == STALLED
    assert time.monotonic() - t < 5
    served_on_both_links(srv)


def test_a_reader_that_takes_nothing_is_cut_off_whatever_the_size_of_its_reply(
        memkv_server_factory, dial):
    """A 64 MiB reply was due within the frame timeout plus 8 s at 8 MiB/s, pins held all along,
    however little of it the reader took; now it must be taken at the minimum rate as it goes."""
    srv = memkv_server_factory(memory="256M", lanes=1, extra=["--frame-timeout", "1",
                                                              "--min-rate", "8M"])
    c = MemKVClient(MemKVConfig(servers=(srv.address,)))
    assert c.put([b"big"], [b"b" * (64 << 20)]) == [Status.OK]
    s = dial(srv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    hello(s)
    body = key_lens([(b"big", 64 << 20)])
    s.sendall(header(GET, len(body)) + body)
    t = time.monotonic()
    while srv.stats()["in_transfer_bytes"] and time.monotonic() - t < 30:
        time.sleep(0.2)
    assert time.monotonic() - t < 5, "pins held past the reply's pace"
    assert srv.stats()["errors"]["stalled"] == 1
    s.close()
    served_on_both_links(srv, None)


def test_a_peer_trickling_its_handshake_is_closed_at_the_handshake_timeout(
        memkv_server_factory, dial):
    """Only the first byte of a handshake frame had to come within the handshake timeout; the
    rest had the frame timeout, so a peer sending its HELLO a byte at a time held its connection
    for both. The handshake timeout now bounds every byte before authentication."""
    srv = memkv_server_factory(memory="16M", auth_key=KEY, extra=["--handshake-timeout", "1"])
    s = dial(srv)
    t = time.monotonic()
    for b in header(HELLO, 0):
        s.send(bytes([b]))
        # The trickle's pace; the server's answer ends it early.
        if select.select([s], [], [], 0.1)[0]:
            break
    s.settimeout(5)
    assert error_code(s) == STALLED
    assert time.monotonic() - t < 2.5


@pytest.mark.parametrize("op", [HELLO, PING, STATS])
def test_a_body_on_a_request_that_takes_none_is_refused_unread(memkv_server_factory, op, dial):
    """HELLO (after authentication), PING and STATS take no body; one was read into the buffer
    budget and ignored. Now it is a malformed frame, refused before its body is read."""
    srv = memkv_server_factory(memory="16M", auth_key=KEY)
    s = authed(srv, dial=dial)
    s.sendall(header(op, 16 << 20) + b"x" * 100)
    assert_closed_with_error(s, MALFORMED)


def test_data_before_authentication_never_reaches_a_value(memkv_server_factory, dial):
    srv = memkv_server_factory(memory="16M", auth_key=KEY)
    s = dial(srv)
    s.sendall(header(HELLO, 0))
    read_frame(s)
    body = key_lens([(b"stolen", 5)])
    s.sendall(header(PUT, len(body), payload_len=5) + body + b"bytes")
    op, _, _ = read_frame(s)
    assert op == 0xFF
    c = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY)))
    assert c.exists([b"stolen"]) == [Status.NOT_FOUND]
    c.close()
    served_on_both_links(srv)


# --- TLS (docs/tls.md): the handshake is bounded like any handshake frame --------------------


def _tls_server(factory, tmp_path: Path, *extra: str):
    pki = Pki(tmp_path)
    return factory(memory="16M", auth_key=KEY, extra=pki.server_flags() + list(extra)), pki


def _tls_round_trip_s(srv, pki: Pki) -> float:
    return round_trip_s(srv, tls_ca=str(pki.ca))


def _client_hello(pki: Pki) -> bytes:
    """The first flight of a real TLS client, as bytes to send by hand."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `s` (reading and dropping what it sends first)."""
    t = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except (ConnectionResetError, ssl.SSLError):
        pass
    took = time.monotonic() - t
    assert took < seconds
    return took


def test_garbage_before_and_after_the_tls_handshake_closes_only_that_connection(
        memkv_server_factory, tmp_path: Path):
    srv, pki = _tls_server(memkv_server_factory, tmp_path)
    # A record header that claims a handshake, then noise.
    s = connect(srv)
    s.sendall(b"\x16\x03\x01\x00\x40" + bytes(range(64)))
    _closed_within(s, 3)
    # A real handshake, then bytes that are no record of this session.
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    tls = ctx.wrap_socket(connect(srv), server_hostname="localhost")
    raw = socket.socket(fileno=os.dup(tls.fileno()))
    raw.sendall(b"\x17\x03\x03\x00\x20" + b"\xff" * 32)
    _closed_within(raw, 3)
    raw.close()
    tls.close()
    assert _tls_round_trip_s(srv, pki) < 1.0
    assert srv.alive()


def test_a_tls_handshake_flood_cannot_lock_out_a_client_with_the_key(
        memkv_server_factory, tmp_path: Path):
    """Peers that start TLS handshakes and never finish them hold unauthenticated slots, which
    give way to new connections, as silent plaintext peers do."""
    srv, pki = _tls_server(memkv_server_factory, tmp_path, "--max-connections", "8",
                           "--handshake-timeout", "30")
    threads = proc_status(srv.proc.pid, "Threads")
    hello_bytes = _client_hello(pki)
    flood = []
    try:
        for i in range(64):
            s = connect(srv)
            # Half send a whole ClientHello and wait for nothing, half stop inside it.
            s.sendall(hello_bytes if i % 2 else hello_bytes[:20])
            flood.append(s)
        assert proc_status(srv.proc.pid, "Threads") <= threads + 9
        assert _tls_round_trip_s(srv, pki) < 1.0
    finally:
        for s in flood:
            s.close()
    assert srv.alive()


def test_a_tls_handshake_trickled_is_closed_at_the_handshake_timeout(
        memkv_server_factory, tmp_path: Path):
    srv, pki = _tls_server(memkv_server_factory, tmp_path, "--handshake-timeout", "1")
    s = connect(srv)
    t = time.monotonic()
    for b in _client_hello(pki):
        try:
            s.send(bytes([b]))
        except OSError:  # closed by the server: the trickle ends
            break
        if select.select([s], [], [], 0.05)[0]:
            break
    _closed_within(s, 5)
    assert time.monotonic() - t < 2.5
    assert _tls_round_trip_s(srv, pki) < 1.0


def tenant_conn(srv, key: str) -> tuple[socket.socket, bytes]:
    """A raw connection authenticated with `key`, and the AUTH reply's body (its tenant)."""
    s = connect(srv)
    s.sendall(header(HELLO, 0))
    _, body, _ = read_frame(s)
    s.sendall(header(AUTH, 32) + hmac.new(bytes.fromhex(key), body[1:33], hashlib.sha256).digest())
    op, info, _ = read_frame(s)
    assert op == 0x82, op
    return s, info


def keys_body(keys: list[bytes]) -> bytes:
    return struct.pack("<I", len(keys)) + b"".join(struct.pack("<H", len(k)) + k for k in keys)


def statuses(body: bytes, with_lens: bool) -> list[int]:
    n = struct.unpack("<I", body[:4])[0]
    step = 9 if with_lens else 1
    return [body[4 + i * step] for i in range(n)]


def raw_ops(s: socket.socket, keys: list[bytes]) -> dict[str, list[int]]:
    """PUT (a 3-byte value each), GET, EXISTS with a lease, DELETE of `keys`, raw: statuses."""
    body = key_lens([(k, 3) for k in keys])
    s.sendall(header(PUT, len(body), payload_len=3 * len(keys)) + body + b"v" * 3 * len(keys))
    out = {"put": statuses(read_frame(s)[1], False)}
    s.sendall(header(GET, len(body)) + body)
    _, reply, payload = read_frame(s)
    out["get"] = statuses(reply, True)
    recv_exact(s, payload)
    leased = struct.pack("<I", 60_000) + keys_body(keys)
    s.sendall(header(EXISTS, len(leased)) + leased)
    out["exists"] = statuses(read_frame(s)[1], True)
    body = keys_body(keys)
    s.sendall(header(DELETE, len(body)) + body)
    out["delete"] = statuses(read_frame(s)[1], False)
    return out


def test_a_tenant_cannot_escape_its_prefix_with_key_tricks(memkv_server_factory, tmp_path):
    """Raw frames from a tenant naming keys at the edges of its prefix and another's: only keys
    that start with its own prefix byte for byte are its; everything else answers FORBIDDEN on
    every operation and leaves the other tenant's values, leases and counts untouched."""
    srv = tenant_server(memkv_server_factory, tmp_path)
    a, info = tenant_conn(srv, KEY_A)
    assert info == struct.pack("<H", 6) + b"team-a" + struct.pack("<H", 2) + b"a/" + b"\x00"
    a_client = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY_A)))
    assert a_client.put([b"a/v", b"a/"], [b"secret", b"prefix"]) == [Status.OK] * 2
    b, _ = tenant_conn(srv, KEY_B)
    assert raw_ops(b, [b"b/x"]) == {"put": [0], "get": [0], "exists": [0], "delete": [0]}
    # Another's key and its prefix itself, the start of another's prefix (and of its own), the
    # other's key behind a byte or in another case, a path that "climbs out" of its own prefix
    # (a key of its own: keys are bytes, not paths), and a longest key under another's prefix.
    tricks = [b"a/v", b"a/", b"a", b"b", b"\x00a/v", b"A/v", b"b/../a/v", b"a/" + b"x" * 1022]
    own_path = tricks.index(b"b/../a/v")
    for op, st in raw_ops(b, tricks).items():
        want = [10] * len(tricks)
        want[own_path] = 0
        assert st == want, (op, st)
    # a's values are as a left them, unleased.
    out = [bytearray(6), bytearray(6)]
    assert a_client.get_into([b"a/v", b"a/"], out) == [Status.OK] * 2
    assert out == [b"secret", b"prefix"]
    st = a_client.stats()[srv.address]
    assert st["tenants"]["team-a"]["forbidden"] == 0
    assert st["tenants"]["team-b"]["forbidden"] == 4 * (len(tricks) - 1)
    assert st["leased_bytes"] == 0 and st["items"] == 2
    # An empty key is no key at all: a protocol error that closes the connection.
    body = key_lens([(b"", 3)])
    b.sendall(header(PUT, len(body), payload_len=3) + body + b"vvv")
    assert_closed_with_error(b, MALFORMED)
    a.close()


def test_a_tenant_cannot_authenticate_as_another_or_skip_auth(memkv_server_factory, tmp_path):
    srv = tenant_server(memkv_server_factory, tmp_path)
    # An answer seen on one connection is worthless on the next: the nonce differs.
    s = connect(srv)
    s.sendall(header(HELLO, 0))
    _, hello1, _ = read_frame(s)
    mac = hmac.new(bytes.fromhex(KEY_A), hello1[1:33], hashlib.sha256).digest()
    t = connect(srv)
    t.sendall(header(HELLO, 0))
    _, hello2, _ = read_frame(t)
    assert hello2[0] == 1, "a server with tenants always asks for a credential"
    t.sendall(header(AUTH, 32) + mac)
    assert_closed_with_error(t, AUTH_FAILED)
    # No AUTH: no command.
    body = keys_body([b"a/x"])
    s.sendall(header(DELETE, len(body)) + body)
    assert_closed_with_error(s, UNAUTHENTICATED)
    c = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY_A)))
    assert c.put([b"a/ok"], [b"v"]) == [Status.OK]
