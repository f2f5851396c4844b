"""The hosts fixture itself (tests/netns_hosts.py): separate network stacks that a client in the
root namespace reaches only through their veth pairs, removed without a trace."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from netns_hosts import Hosts, links, namespaces

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
