"""The same-host data path (`transport: shm`, docs/shm.md) against real `memkv serve` processes:
values move by the server's copies into and out of the client's memfd and /dev/shm regions."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig

KEY_HEX = "cd" * 32


class Region:
    """`nbytes` of a memfd mapped shared, as a numpy array; what `register_buffer` hands over."""

    def __init__(self, nbytes: int, name: str = "memkv-shm-test") -> None:
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data

    def close(self) -> None:
        del self.array
        self.map.close()
        os.close(self.fd)


def shm_client(srv, **kw) -> MemKVClient:
    return MemKVClient(MemKVConfig(servers=(srv.address,), transport="shm", **kw))


def server_maps(srv, name: str) -> bool:
    """Whether the server process has a mapping of the memfd called `name` (the region)."""
    return f"/memfd:{name}" in Path(f"/proc/{srv.proc.pid}/maps").read_text()


def test_round_trips_are_byte_exact_through_the_servers_copies(memkv_server_factory):
    srv = memkv_server_factory(memory="512M", lanes=2)
    c = shm_client(srv)
    sizes = [1, 4097, 1 << 20, (3 << 20) + 5]
    src, dst = Region(16 << 20, "memkv-src"), Region(16 << 20, "memkv-dst")
    c.register_buffer(src.ptr, src.array.nbytes)
    c.register_buffer(dst.ptr, dst.array.nbytes)
    rng = np.random.default_rng(1)
    offs = np.cumsum([0, *sizes[:-1]]) * 2
    for o, n in zip(offs, sizes, strict=True):
        src.array[o : o + n] = rng.integers(0, 256, n, dtype=np.uint8)
    keys = [b"shm/%d" % n for n in sizes]
    assert (
        c.put(keys, [src.array[o : o + n] for o, n in zip(offs, sizes, strict=True)])
        == [Status.OK] * 4
    )
    assert server_maps(srv, "memkv-src"), "the server copied out of the client's region"
    assert (
        c.get_into(keys, [dst.array[o : o + n] for o, n in zip(offs, sizes, strict=True)])
        == [Status.OK] * 4
    )
    assert server_maps(srv, "memkv-dst")
    for o, n in zip(offs, sizes, strict=True):
        assert np.array_equal(src.array[o : o + n], dst.array[o : o + n])
    # A TCP client reads the same bytes: one store, whatever the path.
    tcp = MemKVClient(MemKVConfig(servers=(srv.address,)))
    out = np.zeros(sizes[-1], np.uint8)
    assert tcp.get_into(keys[-1:], [out]) == [Status.OK]
    assert np.array_equal(out, src.array[offs[-1] : offs[-1] + sizes[-1]])
    c.unregister_buffer(src.ptr)
    c.unregister_buffer(dst.ptr)
    src.close()
    dst.close()


def test_statuses_and_leases_over_shared_memory(memkv_server_factory):
    srv = memkv_server_factory()
    c = shm_client(srv)
    r = Region(1 << 20)
    c.register_buffer(r.ptr, r.array.nbytes)
    r.array[:100] = 7
    assert c.put([b"a"], [r.array[:100]]) == [Status.OK]
    r.array[4096:4196] = 0xEE
    st = c.get_into([b"a", b"missing"], [r.array[4096:4195], r.array[8192:8200]])
    assert st == [Status.LENGTH_MISMATCH, Status.NOT_FOUND]
    assert (r.array[4096:4196] == 0xEE).all(), "nothing copied for a failed key"
    assert c.exists_lengths([b"a"], lease_ms=5000) == [(Status.OK, 100)]
    assert c.get_into([b"a"], [r.array[8192:8292]]) == [Status.OK]
    assert (r.array[8192:8292] == 7).all()
    c.unregister_buffer(r.ptr)
    r.close()


def test_auth_is_required_over_the_socket(memkv_server_factory):
    srv = memkv_server_factory(auth_key=KEY_HEX)
    r = Region(1 << 20)
    no_key = shm_client(srv)
    no_key.register_buffer(r.ptr, r.array.nbytes)
    assert no_key.put([b"k"], [r.array[:10]]) == [Status.AUTH_FAILED]
    c = shm_client(srv, auth_key=bytes.fromhex(KEY_HEX))
    c.register_buffer(r.ptr, r.array.nbytes)
    assert c.put([b"k"], [r.array[:10]]) == [Status.OK]
    c.unregister_buffer(r.ptr)
    no_key.unregister_buffer(r.ptr)
    r.close()


_WRITER = """
import mmap, os, sys
import numpy as np
from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import MemKVConfig
fd = os.memfd_create("memkv-writer"); os.ftruncate(fd, 8 << 20)
a = np.frombuffer(mmap.mmap(fd, 8 << 20), dtype=np.uint8)
c = MemKVClient(MemKVConfig(servers=(sys.argv[1],), transport="shm"))
c.register_buffer(a.ctypes.data, a.nbytes)
i = 0
while True:
    a[:] = i % 251
    c.put([b"w/%d" % (i % 16)], [a])
    i += 1
    if i == 16:
        print("ready", flush=True)
"""


def test_a_client_killed_mid_transfer_leaves_every_value_intact(memkv_server_factory):
    """A writer whose PUTs copy 8 MiB out of its region is SIGKILLed while they run: every
    stored value is one whole value it wrote (checksummed by the server on the way out)."""
    srv = memkv_server_factory(memory="512M", lanes=2)
    w = subprocess.Popen(
        [sys.executable, "-c", _WRITER, srv.address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert w.stdout is not None and w.stdout.readline() == "ready\n"
    time.sleep(0.2)  # several more PUTs in flight
    w.send_signal(signal.SIGKILL)
    w.wait(10)
    tcp = MemKVClient(MemKVConfig(servers=(srv.address,)))
    out = np.zeros(8 << 20, np.uint8)
    for k in range(16):
        assert tcp.get_into([b"w/%d" % k], [out]) == [Status.OK]
        assert (out == out[0]).all(), f"value {k} mixes two writes"
    assert srv.alive()


def test_a_killed_server_leaves_no_socket_and_no_shm_file(memkv_server_factory):
    before = set(os.listdir("/dev/shm"))
    srv = memkv_server_factory()
    name = f"@memkv/{srv.address}"
    assert name in Path("/proc/net/unix").read_text(), "the abstract socket is bound"
    r = Region(1 << 20)
    c = shm_client(srv)
    c.register_buffer(r.ptr, r.array.nbytes)
    assert c.put([b"k"], [r.array[:10]]) == [Status.OK]
    srv.kill()
    assert name not in Path("/proc/net/unix").read_text()
    assert set(os.listdir("/dev/shm")) <= before
    # The client sees a dead server as such, never a hang.
    assert c.put([b"k"], [r.array[:10]]) in ([Status.REFUSED], [Status.UNAVAILABLE])
    c.unregister_buffer(r.ptr)
    r.close()


def test_a_socket_file_is_removed_when_the_server_stops(memkv_server_factory, tmp_path):
    path = tmp_path / "memkv.sock"
    srv = memkv_server_factory(extra=["--shm-socket", str(path)])
    assert path.exists()
    assert srv.stop() == 0
    assert not path.exists()


def test_shm_off_refuses_a_strict_client_and_auto_falls_back(memkv_server_factory):
    srv = memkv_server_factory(extra=["--shm-socket", "off"])
    assert shm_client(srv).put([b"k"], [b"v"]) == [Status.REFUSED]
    auto = MemKVClient(MemKVConfig(servers=(srv.address,), transport="auto"))
    assert auto.put([b"k"], [b"v"]) == [Status.OK]


@pytest.mark.parametrize("bound", [["--max-shm-regions", "0"], ["--max-shm-region", "4K"]])
def test_a_refused_region_moves_its_values_over_the_socket(memkv_server_factory, bound):
    srv = memkv_server_factory(extra=bound)
    r = Region(1 << 20, "memkv-refused")
    c = shm_client(srv)
    c.register_buffer(r.ptr, r.array.nbytes)
    r.array[:1000] = 3
    assert c.put([b"k"], [r.array[:1000]]) == [Status.OK]
    assert not server_maps(srv, "memkv-refused")
    assert c.get_into([b"k"], [r.array[4096:5096]]) == [Status.OK]
    assert (r.array[4096:5096] == 3).all()
    assert "shared-memory region refused" in srv.log()
    c.unregister_buffer(r.ptr)
    r.close()


def test_descriptor_floods_and_garbage_leave_the_server_serving(memkv_server_factory):
    """Unauthenticated peers on the unix socket: garbage, and HELLOs carrying many descriptors
    each. The server keeps none of them beyond the connection and answers a real client."""
    import socket
    import struct

    srv = memkv_server_factory(auth_key=KEY_HEX)
    fds_before = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
    r = Region(1 << 20)
    hello = b"MK" + bytes([1, 0x01]) + struct.pack("<IQIIQ", 0, 1, 0, 0, 0)
    peers = []
    for i in range(20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(f"\0memkv/{srv.address}")
        if i % 2:
            s.sendall(os.urandom(4096))
        else:
            socket.send_fds(s, [hello], [r.fd] * 8)
        peers.append(s)
    for s in peers:
        s.close()
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{srv.proc.pid}/fd")) > fds_before + 2:
        assert time.monotonic() < deadline, "the server held passed descriptors"
        time.sleep(0.05)
    c = shm_client(srv, auth_key=bytes.fromhex(KEY_HEX))
    c.register_buffer(r.ptr, r.array.nbytes)
    assert c.put([b"k"], [r.array[:10]]) == [Status.OK]
    assert srv.alive()
    c.unregister_buffer(r.ptr)
    r.close()


def test_a_clients_connections_share_one_server_mapping_of_its_region(memkv_server_factory):
    """Each of a client's connections hands the server its region; the server maps that part of
    the file once (docs/shm.md), so a restarted engine's first copies do not fault every page
    once per connection."""
    srv = memkv_server_factory(memory="512M", lanes=2)
    c = shm_client(srv, connections_per_server=4)
    r = Region(16 << 20, "memkv-shared")
    c.register_buffer(r.ptr, r.array.nbytes)
    r.array[:] = np.random.default_rng(3).integers(0, 256, r.array.nbytes, dtype=np.uint8)
    keys = [b"shared/%d" % i for i in range(16)]
    views = [r.array[i << 20:(i + 1) << 20] for i in range(16)]
    assert c.put(keys, views) == [Status.OK] * 16
    expect = r.array.copy()
    r.array[:] = 0
    assert c.get_into(keys, views) == [Status.OK] * 16
    assert (r.array == expect).all()
    maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
    assert maps.count("/memfd:memkv-shared") == 1, maps
    c.unregister_buffer(r.ptr)
    c.close()
    del views
    r.close()


def test_a_frozen_server_costs_one_deadline_and_serves_again_after(memkv_server_factory):
    """SIGSTOP mid-service: the GET fails within its op timeout and its buffer is untouched
    (the server copies nothing it cannot reply for); after SIGCONT the same region works."""
    srv = memkv_server_factory(memory="256M", lanes=2)
    c = shm_client(srv, op_timeout_s=1.0)
    r = Region(4 << 20, "memkv-frozen")
    c.register_buffer(r.ptr, r.array.nbytes)
    r.array[: 1 << 20] = 9
    assert c.put([b"f"], [r.array[: 1 << 20]]) == [Status.OK]
    r.array[1 << 20 : 2 << 20] = 1
    with srv.frozen():
        t = time.monotonic()
        st = c.get_into([b"f"], [r.array[1 << 20 : 2 << 20]])
        waited = time.monotonic() - t
    assert st[0] in (Status.TIMEOUT, Status.UNAVAILABLE), st
    assert waited < 3.0, f"a frozen server held the GET {waited:.1f} s past its 1 s deadline"
    deadline = time.monotonic() + 10
    while c.get_into([b"f"], [r.array[2 << 20 : 3 << 20]]) != [Status.OK]:
        assert time.monotonic() < deadline, "no recovery after SIGCONT"
        time.sleep(0.05)
    assert (r.array[2 << 20 : 3 << 20] == 9).all()
    c.unregister_buffer(r.ptr)
    c.close()
    r.close()
