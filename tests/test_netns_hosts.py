"""The hosts fixture itself (tests/netns_hosts.py): separate network stacks that a client in the
root namespace reaches only through their veth pairs, removed without a trace."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from memkv_procs import MemKVServer
from netns_hosts import PORT, Hosts, links, namespaces

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import load_config


def test_servers_on_two_hosts_serve_a_client_through_the_veths(net_hosts: Hosts) -> None:
    a, b = net_hosts.add(), net_hosts.add()
    for h in (a, b):
        h.serve()
    assert a.address != b.address and a.address.startswith("10.231.")
    # Each host is a stack of its own: it has only its loopback and its end of the pair.
    out = subprocess.run(a.cmd("ip", "-o", "-4", "addr"), capture_output=True, text=True,
                         check=True).stdout
    assert sorted(line.split()[3] for line in out.splitlines()) == sorted(
        ["127.0.0.1/8", f"{a.addr}/30"])
    client = MemKVClient(load_config({"servers": [a.address, b.address]}, env={}))
    keys = [f"k{i}".encode() for i in range(64)]
    vals = [np.full(256, i, dtype=np.uint8) for i in range(64)]
    assert set(client.put(keys, vals)) == {Status.OK}
    bufs = [np.empty(256, dtype=np.uint8) for _ in keys]
    assert set(client.get_into(keys, bufs)) == {Status.OK}
    assert all(np.array_equal(x, y) for x, y in zip(bufs, vals, strict=True))
    assert {client.server_of(k) for k in keys} == {a.address, b.address}
    client.close()


def test_close_removes_every_namespace_and_link() -> None:
    why = Hosts.available()
    if why is not None:
        pytest.skip(f"hosts as network namespaces: {why}")
    before_ns, before_links = set(namespaces()), set(links())
    hosts = Hosts()
    try:
        made = [hosts.add() for _ in range(2)]
        made[0].serve()
        assert {h.ns for h in made} <= set(namespaces())
        assert {h.link for h in made} <= set(links())
    finally:
        hosts.close()
    assert set(namespaces()) == before_ns
    assert set(links()) == before_links
    assert made[0].server is None


def _connect_from(host, addr: str, port: int) -> str:
    """What a TCP connect from inside `host` to addr:port does within 1 s: ok, timeout or the
    error's name."""
    probe = ("import socket\n"
             "try:\n"
             f"    socket.create_connection(({addr!r}, {port}), 1).close(); print('ok')\n"
             "except TimeoutError: print('timeout')\n"
             "except OSError as e: print(type(e).__name__, e.errno)\n")
    return subprocess.run(host.cmd(sys.executable, "-c", probe), capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()


def test_a_hub_address_reaches_every_spoke_and_its_blackhole_is_silence(net_hosts: Hosts
                                                                        ) -> None:
    center, a, b = net_hosts.add(), net_hosts.add(), net_hosts.add()
    addr, ends = net_hosts.hub(center, [a, b])
    center.server = MemKVServer(memory="16M", lanes=1, listen=f"0.0.0.0:{PORT}",
                                wrapper=center.cmd()).start()
    center.server.address = center.address  # the root namespace's way in
    assert [_connect_from(h, addr, PORT) for h in (a, b)] == ["ok", "ok"]  # one name for both
    center.blackhole(*ends)
    # The spokes' connects hang (the SYN-ACKs vanish), with no error; the root namespace, whose
    # end is not cut off, still reaches the server.
    assert [_connect_from(h, addr, PORT) for h in (a, b)] == ["timeout", "timeout"]
    assert center.server.stats()["items"] == 0
    center.heal(*ends)
    assert [_connect_from(h, addr, PORT) for h in (a, b)] == ["ok", "ok"]
