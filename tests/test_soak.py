"""Soak and attack: a real `memkv serve` under an address-space limit (`prlimit --as`) of twice its
--memory plus a stated overhead, attacked for SOAK_SECS (default 45) by peers without the key
(silent sockets, oversized bodies before auth, garbage) and by peers with it (slow readers and
writers, repeated keys, overwrite and lease floods, tiny values under long keys), while
self-verifying clients read and write (one of them by RDMA, libfabric's tcp provider), a fresh
client times a PUT/GET round trip every half second, and a second server is stopped (SIGSTOP),
resumed and killed (SIGKILL) under them.

It checks: the server never dies, its RSS stays within the stated bound, every round trip takes
under a second, and no client ever reads a byte other than those it stored. All traffic is to
127.0.0.1; every loop ends at the deadline. docs/security.md records the figures."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import shutil
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from memkv_procs import proc_status
from test_server import EXISTS, GET, HELLO, PUT, header, key_lens, read_frame
from test_server_limits import KEY, authed, round_trip_s, rss

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig

MIB = 1 << 20
MEMORY = 64 * MIB
BUDGET = 32 * MIB
# Address space beyond 2 x --memory: the binary and its libraries, thread stacks, malloc's
# per-thread arenas and the verifier pool. docs/security.md states it.
AS_OVERHEAD = 512 * MIB
# Resident memory beyond the arena (--memory, pre-faulted) and the index (at most --memory):
# the buffer budget plus code, stacks and allocator slack.
RSS_OVERHEAD = 96 * MIB
# The RDMA connections the attacked server allows (--max-rdma-connections) and what each may
# cost in the libfabric provider's own buffers (about 2.5 MiB over tcp;ofi_rxm with memkv's rxm
# sizes, docs/rdma.md "Memory per connection").
RDMA_ENDPOINTS = 2
RDMA_ENDPOINT_RSS = 8 * MIB
SOAK_SECS = float(os.environ.get("SOAK_SECS", "45"))

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit")


def vm_size(srv) -> int:
    """The server's address space, bytes (what `prlimit --as` limits)."""
    return proc_status(srv.proc.pid, "VmSize") << 10


def value_for(key: bytes, version: int, size: int) -> bytes:
    """The bytes a verifying client stores under `key` at `version`: anyone can recompute them."""
    seed = hashlib.blake2b(key + version.to_bytes(4, "little"), digest_size=16).digest()
    return (seed * (size // 16 + 1))[:size]


class Soak:
    def __init__(self, srv, other) -> None:
        self.srv, self.other = srv, other
        self.deadline = time.monotonic() + SOAK_SECS
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.round_trips: list[float] = []
        self.peak_rss = 0
        self.peak_vm = 0
        self.verified = 0
        self.retried = 0
        self.lock = threading.Lock()

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def guarded(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while self.running():
                try:
                    fn()
                except OSError:
                    time.sleep(0.01)  # the server cut us off: that is its job
                except Exception as e:  # noqa: BLE001 - any other surprise fails the soak
                    self.fail(f"{name}: {e!r}")
                    return
        return run

    # ---- attackers without the key ----------------------------------------------------------
    def silent_sockets(self) -> None:
        socks = [socket.create_connection(self.addr(), timeout=5) for _ in range(48)]
        time.sleep(0.5)
        for s in socks:
            s.close()

    def bodies_before_auth(self) -> None:
        s = socket.create_connection(self.addr(), timeout=5)
        s.sendall(header(HELLO, 0) + header(PUT, 16 * MIB) + b"\0" * 65536)
        read_frame(s)
        read_frame(s)
        s.close()

    def garbage(self) -> None:
        s = socket.create_connection(self.addr(), timeout=5)
        s.sendall(random.randbytes(random.randint(1, 4096)))
        try:
            s.recv(64)
        finally:
            s.close()

    # ---- attackers with the key ----------------------------------------------------------------
    def slow_reader(self) -> None:
        s = authed(self.srv)
        body = key_lens([(b"verify/%d" % i, 0) for i in range(32)] + [(b"big", 4 * MIB)])
        s.sendall(header(GET, len(body)) + body)
        s.settimeout(2)
        while self.running() and s.recv(65536):
            time.sleep(1)
        s.close()

    def slow_writer(self) -> None:
        s = authed(self.srv)
        body = key_lens([(b"slowput", 4 * MIB)])
        s.sendall(header(PUT, len(body), payload_len=4 * MIB) + body + b"s" * (256 << 10))
        s.settimeout(10)
        while self.running() and s.recv(64) == b"":
            time.sleep(0.5)
        s.close()

    def amplifier(self) -> None:
        s = authed(self.srv)
        body = key_lens([(b"big", 4 * MIB)] * 65_536)
        s.sendall(header(GET, len(body)) + body)
        _, _, plen = read_frame(s)
        if plen > 4 * MIB:
            self.fail(f"a GET naming one key 65,536 times got {plen} payload bytes")
        s.close()

    def overwrite_and_lease_flood(self) -> None:
        s = authed(self.srv)
        n = 8000
        body = key_lens([(b"o" * 1000, 1)] * n)
        s.sendall(header(PUT, len(body), payload_len=n) + body + b"v" * n)
        read_frame(s)
        body = struct.pack("<II", 3_600_000, 65_536) + (struct.pack("<H", 1) + b"L") * 65_536
        s.sendall(header(EXISTS, len(body)) + body)
        read_frame(s)
        s.close()

    def tiny_values(self) -> None:
        s = authed(self.srv)
        n = 8000
        tag = random.randbytes(4).hex().encode()
        body = key_lens([(tag + b"%0992d" % i, 1) for i in range(n)])
        s.sendall(header(PUT, len(body), payload_len=n) + body + b"t" * n)
        read_frame(s)
        s.close()

    # ---- clients with the key --------------------------------------------------------------------
    def verifier(self, servers: tuple[str, ...], tag: str,
                 transport: str = "tcp") -> Callable[[], None]:
        client = MemKVClient(MemKVConfig(servers=servers, auth_key=bytes.fromhex(KEY),
                                         op_timeout_s=1.0, transport=transport,
                                         rdma_devices=("lo",) if transport == "rdma" else ()))
        stored: dict[bytes, tuple[int, int]] = {}  # key -> (version, size) acknowledged
        # Over the same-host path the values move through a registered memfd region (the
        # server copies out of its first MiB and into its second), as the tier's pool does.
        region = None
        if transport == "shm":
            fd = os.memfd_create("memkv-soak")
            os.ftruncate(fd, 2 * MIB)
            region = np.frombuffer(mmap.mmap(fd, 2 * MIB), dtype=np.uint8)
            os.close(fd)
            client.register_buffer(region.ctypes.data, region.nbytes)

        def step() -> None:
            key = b"verify/%s/%d" % (tag.encode(), random.randrange(32))
            size = random.choice([4096, 65536, MIB])
            version = stored.get(key, (0, 0))[0] + 1
            src: Any = value_for(key, version, size)
            if region is not None:
                region[:size] = np.frombuffer(src, dtype=np.uint8)
                src = region[:size]
            if client.put([key], [src]) == [Status.OK]:
                stored[key] = (version, size)
            else:
                stored.pop(key, None)  # maybe stored, maybe not: not checked again
            for k, (v, sz) in random.sample(sorted(stored.items()), min(4, len(stored))):
                buf: Any = bytearray(sz) if region is None else region[MIB:MIB + sz]
                if client.get_into([k], [buf]) == [Status.OK]:
                    if bytes(buf) != value_for(k, v, sz):
                        self.fail(f"{tag}: wrong bytes under {k!r}")
                    with self.lock:
                        self.verified += 1
            time.sleep(0.005)
        return step

    def prober(self) -> None:
        """A fresh client's PUT/GET round trip; a failed attempt (its connection closed during
        the flood) is retried with another fresh client, all within the same second."""
        t = time.monotonic()
        errors = []
        while time.monotonic() - t < 1.0:
            try:
                round_trip_s(self.srv)
                break
            except AssertionError as e:
                errors.append(str(e).splitlines()[0])
        took = time.monotonic() - t
        with self.lock:
            self.round_trips.append(took)
            self.retried += bool(errors)
        if took >= 1.0:
            self.fail(f"no round trip within 1 s: {errors}; server {self.srv.stats()['errors']}")
        time.sleep(0.5)

    def sampler(self) -> None:
        if not self.srv.alive():
            self.fail("the server under attack died:\n" + self.srv.log()[-2000:])
            self.stop.set()
            return
        self.peak_rss = max(self.peak_rss, rss(self.srv))
        self.peak_vm = max(self.peak_vm, vm_size(self.srv))
        time.sleep(0.1)

    def stopper(self) -> None:
        """SIGSTOP the second server for 2 s, resume it, then SIGKILL it halfway through."""
        pid = self.other.proc.pid
        if time.monotonic() > self.deadline - SOAK_SECS / 2:
            self.other.kill()
            while self.running():
                time.sleep(0.2)
            return
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2)
        os.kill(pid, signal.SIGCONT)
        time.sleep(3)

    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.srv.port)


def test_soak_and_attack(memkv_server_factory, monkeypatch):
    as_limit = 2 * MEMORY + AS_OVERHEAD
    # Both servers serve RDMA too (libfabric's tcp provider on loopback): one verifier moves its
    # values by RDMA through the same attacks, stops and kills; another by the same-host path.
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")
    rdma = ["--rdma", "--rdma-devices", "lo"]
    srv = memkv_server_factory(
        memory=f"{MEMORY >> 20}M", lanes=2, auth_key=KEY,
        wrapper=["prlimit", f"--as={as_limit}"],
        extra=["--max-connections", "48", "--handshake-timeout", "1", "--frame-timeout", "2",
               "--min-rate", "1M", "--max-buffer-memory", f"{BUDGET >> 20}M", *rdma,
               "--max-rdma-connections", str(RDMA_ENDPOINTS)])
    other = memkv_server_factory(memory="32M", lanes=1, auth_key=KEY, extra=rdma)
    c = MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY)))
    assert c.put([b"big"], [b"B" * 4 * MIB]) == [Status.OK]
    soak = Soak(srv, other)
    jobs = {
        "silent": soak.silent_sockets, "bodies": soak.bodies_before_auth,
        "garbage": soak.garbage, "slow_reader": soak.slow_reader,
        "slow_writer": soak.slow_writer, "amplifier": soak.amplifier,
        "floods": soak.overwrite_and_lease_flood, "tiny": soak.tiny_values,
        "verify_a": soak.verifier((srv.address,), "a"),
        "verify_ab": soak.verifier((srv.address, other.address), "ab"),
        "verify_rdma": soak.verifier((srv.address, other.address), "rdma", "rdma"),
        "verify_shm": soak.verifier((srv.address, other.address), "shm", "shm"),
        "probe": soak.prober, "rss": soak.sampler, "stopper": soak.stopper,
    }
    threads = [threading.Thread(target=soak.guarded(n, f), name=n) for n, f in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_SECS + 60)
    soak.stop.set()
    assert not [t.name for t in threads if t.is_alive()], "a soak thread did not end"
    assert srv.alive(), srv.log()[-2000:]
    stats = srv.stats()
    bound = 2 * MEMORY + BUDGET + RSS_OVERHEAD + RDMA_ENDPOINTS * RDMA_ENDPOINT_RSS
    print(f"\nsoak {SOAK_SECS:.0f}s: peak RSS {soak.peak_rss / MIB:.0f} MiB "
          f"(bound {bound / MIB:.0f} MiB), peak address space {soak.peak_vm / MIB:.0f} MiB "
          f"(limit {as_limit / MIB:.0f} MiB); round trips "
          f"{len(soak.round_trips)} ({soak.retried} retried), "
          f"max {max(soak.round_trips, default=0) * 1e3:.0f} ms; "
          f"verified reads {soak.verified}; errors {stats['errors']}")
    assert not soak.failures, soak.failures
    assert soak.peak_rss <= bound
    assert len(soak.round_trips) >= SOAK_SECS / 2 and max(soak.round_trips) < 1.0
    assert soak.verified > 0
    assert stats["errors"]["corrupt"] == 0
