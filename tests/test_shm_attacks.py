"""The attack suite's raw-socket attacks, over the same-host transport's unix socket: a peer there
gets the same deadlines, budgets and refusals as over TCP (docs/shm.md), and the real server goes
on serving clients of both paths."""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
import time

from test_server import (
    AUTH,
    GET,
    HELLO,
    PING,
    PUT,
    STATS,
    assert_closed_with_error,
    header,
    key_lens,
    read_frame,
)
from test_server_limits import KEY, MALFORMED, STALLED, error_code, round_trip_s

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig


def unix(srv) -> socket.socket:
    """A connection to `srv`'s default same-host socket (the abstract name of its address)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(f"\0memkv/{srv.address}")
    return s


def unix_authed(srv) -> socket.socket:
    s = unix(srv)
    s.sendall(header(HELLO, 0))
    op, body, _ = read_frame(s)
    assert op == 0x81 and body[0] == 1
    s.sendall(header(AUTH, 32) + hmac.new(bytes.fromhex(KEY), body[1:33], hashlib.sha256).digest())
    assert read_frame(s)[0] == 0x82
    return s


def shm_round_trip(srv) -> None:
    c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="shm", op_timeout_s=5.0,
                                auth_key=bytes.fromhex(KEY)))
    try:
        assert c.put([b"probe-shm"], [b"s" * 100]) == [Status.OK]
        d = bytearray(100)
        assert c.get_into([b"probe-shm"], [d]) == [Status.OK] and d == b"s" * 100
    finally:
        c.close()


def test_requests_announcing_more_than_they_send_are_cut_off(memkv_server_factory):
    srv = memkv_server_factory(memory="256M", auth_key=KEY, extra=["--frame-timeout", "1"])
    liars = []
    for _ in range(4):
        s = unix_authed(srv)
        s.sendall(header(PUT, 16 << 20, payload_len=1 << 62))
        liars.append(s)
    t = time.monotonic()
    for s in liars:
        assert error_code(s) == STALLED
    assert time.monotonic() - t < 5
    round_trip_s(srv)
    shm_round_trip(srv)


def test_a_reader_that_takes_nothing_is_cut_off(memkv_server_factory):
    srv = memkv_server_factory(memory="256M", lanes=1, auth_key=KEY,
                               extra=["--frame-timeout", "1", "--min-rate", "8M"])
    c = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY)))
    assert c.put([b"big"], [b"b" * (64 << 20)]) == [Status.OK]
    s = unix_authed(srv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    body = key_lens([(b"big", 64 << 20)])
    s.sendall(header(GET, len(body)) + body)
    t = time.monotonic()
    while srv.stats()["in_transfer_bytes"] and time.monotonic() - t < 30:
        time.sleep(0.2)
    assert time.monotonic() - t < 5, "pins held past the reply's pace"
    assert srv.stats()["errors"]["stalled"] == 1
    s.close()
    shm_round_trip(srv)


def test_a_trickled_handshake_is_closed_at_the_handshake_timeout(memkv_server_factory):
    srv = memkv_server_factory(memory="16M", auth_key=KEY, extra=["--handshake-timeout", "1"])
    s = unix(srv)
    t = time.monotonic()
    for b in header(HELLO, 0):
        s.send(bytes([b]))
        if select.select([s], [], [], 0.1)[0]:
            break
    assert error_code(s) == STALLED
    assert time.monotonic() - t < 2.5


def test_unauthenticated_requests_and_bodies_on_bodiless_requests_are_refused(
        memkv_server_factory):
    srv = memkv_server_factory(memory="16M", auth_key=KEY)
    for op in (HELLO, PING, STATS):
        s = unix_authed(srv)
        s.sendall(header(op, 16 << 20) + b"x" * 100)
        assert_closed_with_error(s, MALFORMED)
    # Data before authentication never reaches a value.
    s = unix(srv)
    s.sendall(header(HELLO, 0))
    read_frame(s)
    body = key_lens([(b"stolen", 5)])
    s.sendall(header(PUT, len(body), payload_len=5) + body + b"bytes")
    op, _, _ = read_frame(s)
    assert op == 0xFF
    c = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY)))
    assert c.exists([b"stolen"]) == [Status.NOT_FOUND]
    shm_round_trip(srv)
