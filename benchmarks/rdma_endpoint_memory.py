"""What one RDMA connection costs in resident memory, in the server and in the client: a real
`memkv serve --rdma` on loopback (libfabric's tcp provider, `tcp;ofi_rxm`) and a memkv client
in this process, both over the same provider.

    python benchmarks/rdma_endpoint_memory.py [--connections 32] [--value 1M]

The server side speaks RDMA through `_native.RdmaTestPeer`, which only a module built with
memkv-py's cargo feature `test-peer` has (as `bash scripts/test.sh` builds it: `maturin develop
--release --features pyo3/extension-module,test-peer`; a wheel does not).

The server's figure: its RSS (/proc/<pid>/status) after `--connections` TCP connections each
set up an RDMA endpoint (RDMA_HELLO) and moved one value each way through it, less its RSS
before, per connection. The client's: this process's RSS after a client with
`connections_per_server=--connections` fanned a batch out over that many RDMA connections (each
PUT and GET of one value), less before, per connection the server counted. Every value read back
is checked byte for byte.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm import _native  # noqa: E402
from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402

MIB = 1 << 20
RDMA_ARGS = ["--rdma", "--rdma-provider", "tcp", "--rdma-devices", "lo"]
# Frames of docs/protocol.md: HELLO (version 1, no auth), RDMA_HELLO, PUT and GET with
# FLAG_RDMA (per key: length, remote address, remote key).
HELLO, RDMA_HELLO, PUT, GET, FLAG_RDMA = 0x01, 0x09, 0x05, 0x06, 1


def rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def frame(op: int, body: bytes, flags: int = 0) -> bytes:
    return b"MK" + struct.pack("<BBIQIIQ", 1, op, flags, 1, len(body), 0, 0) + body


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    def exact(n: int) -> bytes:
        b = b""
        while len(b) < n:
            part = s.recv(n - len(b))
            if not part:
                raise ConnectionError("server closed the connection")
            b += part
        return b

    head = exact(32)
    op = head[3]
    blen, _, plen = struct.unpack("<IIQ", head[16:32])
    body = exact(blen)
    exact(plen)
    return op, body


def rdma_connection(addr: str, ep: _native.RdmaTestPeer) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(frame(HELLO, b""))
    read_frame(s)
    prov, name = ep.provider().encode(), ep.address()
    s.sendall(frame(RDMA_HELLO, struct.pack("<B", len(prov)) + prov
                    + struct.pack("<H", len(name)) + name))
    op, body = read_frame(s)
    if op != RDMA_HELLO | 0x80 or body[0] != 1:
        raise RuntimeError(f"RDMA_HELLO refused: {body[1:].decode()}")
    return s


def transfer(s: socket.socket, op: int, key: bytes, ep: _native.RdmaTestPeer, offset: int,
             length: int) -> int:
    addr, rkey = ep.descriptor(offset)
    body = struct.pack("<I", 1) + struct.pack("<H", len(key)) + key
    s.sendall(frame(op, body + struct.pack("<QQQ", length, addr, rkey), FLAG_RDMA))
    _, reply = read_frame(s)
    return reply[4]


def server_cost(a: argparse.Namespace) -> None:
    srv = MemKVServer(memory="64M", lanes=1, extra=RDMA_ARGS + [
        "--max-rdma-connections", str(a.connections)]).start()
    ep = _native.RdmaTestPeer("tcp", "lo", 2 * a.value)
    data = os.urandom(a.value)
    ep.write(0, data)
    socks = []
    try:
        pid = srv.proc.pid  # type: ignore[union-attr]
        before = rss(pid)
        for i in range(a.connections):
            s = rdma_connection(srv.address, ep)
            socks.append(s)
            key = b"k%d" % i
            assert transfer(s, PUT, key, ep, 0, a.value) == Status.OK
            assert transfer(s, GET, key, ep, a.value, a.value) == Status.OK
            assert ep.read(a.value, a.value) == data, "GET over RDMA returned other bytes"
        after = rss(pid)
        print(f"server: {a.connections} RDMA connections, RSS {before / MIB:.1f} -> "
              f"{after / MIB:.1f} MiB: {(after - before) / a.connections / MIB:.2f} MiB each",
              flush=True)
    finally:
        for s in socks:
            s.close()
        ep.close()
        srv.kill()


def client_cost(a: argparse.Namespace) -> None:
    srv = MemKVServer(memory="256M", lanes=1, extra=RDMA_ARGS + [
        "--max-rdma-connections", str(a.connections)]).start()
    try:
        os.environ["MEMKV_RDMA_PROVIDER"] = "tcp"
        # Four keys per connection: the client fans a batch out four values to a connection.
        n = 4 * a.connections
        keys = [b"c%d" % i for i in range(n)]
        vals = [os.urandom(a.value // 4) for _ in range(n)]
        bufs = [bytearray(len(v)) for v in vals]
        before = rss()  # the values are in memory already: the difference is the client's
        c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma",
                                    rdma_devices=("lo",), connections_per_server=a.connections))
        assert c.put(keys, vals) == [Status.OK] * n
        assert c.get_into(keys, bufs) == [Status.OK] * n
        assert bufs == vals, "GET over RDMA returned other bytes"
        after = rss()
        conns = srv.stats()["connections"] - 1  # less the stats request's own
        print(f"client: {conns} RDMA connections, RSS {before / MIB:.1f} -> {after / MIB:.1f} "
              f"MiB: {(after - before) / max(conns, 1) / MIB:.2f} MiB each", flush=True)
        c.close()
    finally:
        srv.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--value", type=size, default=MIB, help="bytes each connection moves")
    a = p.parse_args()
    if not hasattr(_native, "RdmaTestPeer"):
        p.error("memkv_vllm._native lacks RdmaTestPeer: build it with memkv-py's feature "
                "test-peer (bash scripts/test.sh does)")
    server_cost(a)
    client_cost(a)


if __name__ == "__main__":
    main()
