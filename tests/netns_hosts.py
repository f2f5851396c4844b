"""Hosts as separate network stacks: one Linux network namespace per host, joined to the root
namespace (where the test's client runs) by a veth pair. The only addresses are the two ends of
each pair (10.231.S.4i+1 in the root namespace, 10.231.S.4i+2 in the host's, a /30 each, S picked
free per test run) and a hub's address (below), so nothing here can reach another machine.
`join()` links two hosts directly (a pair of their own, the next /30), for hosts that talk to each
other, such as the nodes of one vLLM engine.

Faults are made with the kernel's own tools: `blackhole()` adds a blackhole route in the host's
namespace towards the client, so the server's packets (SYN-ACKs, replies, ACKs) vanish without an
RST and the client's connects and reads hang until its deadlines, as in a partition; `heal()`
removes it. `hub()` gives a server one address that several hosts reach over pairs of their
own. Needs root and iproute2 (`ip netns`); `Hosts.available()` says why not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from memkv_procs import MemKVServer

PORT = 7390  # each namespace has its own ports: every host's server listens on the same one
_TAG = re.compile(r"^mkvh(\d+)x\d+$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]


def links() -> list[str]:
    return re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link").stdout, re.M)


class Host:
    """One namespace: `addr` is its end of the veth pair, `peer` the root namespace's end."""

    def __init__(self, ns: str, link: str, addr: str, peer: str) -> None:
        self.ns, self.link, self.addr, self.peer = ns, link, addr, peer
        self.server: MemKVServer | None = None
        self.blackholed = False

    def cmd(self, *args: str) -> list[str]:
        """`args` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *args]

    def serve(self, memory: str = "64M", lanes: int = 1) -> MemKVServer:
        """Starts (or, after `stop_server`, restarts empty) this host's memkv server on
        `addr`:PORT. `ip netns exec` execs the server, so its pid is the server's."""
        self.server = MemKVServer(memory=memory, lanes=lanes, listen=f"{self.addr}:{PORT}",
                                  wrapper=["ip", "netns", "exec", self.ns]).start()
        return self.server

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server = None

    @property
    def address(self) -> str:
        return f"{self.addr}:{PORT}"

    def blackhole(self, *dests: str) -> None:
        """Drops, silently, every packet this host sends to `dests` (by default the client's
        end). The route sits with the sender of the packets that vanish: in the host that sends
        to them, a blackhole route fails connects at once (EINVAL), which no partition does."""
        for dest in dests or (self.peer,):
            _ip("netns", "exec", self.ns, "ip", "route", "add", "blackhole", f"{dest}/32")
        self.blackholed = True

    def heal(self, *dests: str) -> None:
        for dest in dests or (self.peer,):
            _ip("netns", "exec", self.ns, "ip", "route", "del", "blackhole", f"{dest}/32")
        self.blackholed = False


class Hosts:
    """Makes hosts on demand; `close()` stops their servers and removes every namespace and
    link it made (deleting a namespace destroys the veth end inside it, and with it the pair)."""

    def __init__(self) -> None:
        self.tag = f"mkvh{os.getpid()}"
        self.hosts: list[Host] = []
        self._slots = 0  # /30s handed out: one per host, one per join
        self._remove_leftovers()
        self.subnet = self._free_subnet()

    @staticmethod
    def available() -> str | None:
        """None, or why network namespaces cannot be made here."""
        if shutil.which("ip") is None:
            return "needs iproute2's `ip` (apt-get install iproute2)"
        if os.geteuid() != 0:
            return "needs root to make network namespaces (ip netns add)"
        probe = f"mkvprobe{os.getpid()}"
        p = _ip("netns", "add", probe, check=False)
        if p.returncode != 0:
            return f"`ip netns add` is refused here: {p.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    @staticmethod
    def _remove_leftovers() -> None:
        """Namespaces of test runs whose process is gone (killed before its cleanup)."""
        for ns in namespaces():
            m = _TAG.match(ns)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                _ip("netns", "del", ns, check=False)

    @staticmethod
    def _free_subnet() -> int:
        """A third octet S whose 10.231.S.0/24 no address of the root namespace uses (several
        test runs at once each get their own)."""
        used = set(re.findall(r"inet 10\.231\.(\d+)\.", _ip("-o", "-4", "addr").stdout))
        start = os.getpid() % 250
        for i in range(250):
            s = (start + i) % 250
            if str(s) not in used:
                return s
        raise RuntimeError("no free 10.231.S.0/24 for test hosts")

    def _slot(self) -> int:
        i = self._slots
        if i >= 63:
            raise ValueError("at most 63 hosts and joins per test")
        self._slots += 1
        return i

    def add(self) -> Host:
        i, n = self._slot(), len(self.hosts)
        ns, link = f"{self.tag}x{n}", f"mkv{os.getpid() % 100000}x{n}"
        peer, addr = f"10.231.{self.subnet}.{4 * i + 1}", f"10.231.{self.subnet}.{4 * i + 2}"
        _ip("netns", "add", ns)
        host = Host(ns, link, addr, peer)
        self.hosts.append(host)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth1", "netns", ns)
        _ip("addr", "add", f"{peer}/30", "dev", link)
        _ip("link", "set", link, "up")
        for args in (("addr", "add", f"{addr}/30", "dev", "eth1"), ("link", "set", "eth1", "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", ns, "ip", *args)
        return host

    def join(self, a: Host, b: Host) -> tuple[str, str, str]:
        """Links `a` and `b` by a veth pair of their own, which goes with their namespaces;
        returns its name (the same in both) and their addresses on it (10.231.S.4i+1 in `a`,
        4i+2 in `b`)."""
        i = self._slot()
        link = f"mkj{i}"
        ends = f"10.231.{self.subnet}.{4 * i + 1}", f"10.231.{self.subnet}.{4 * i + 2}"
        _ip("link", "add", link, "netns", a.ns, "type", "veth", "peer", "name", link, "netns", b.ns)
        for host, addr in zip((a, b), ends, strict=True):
            _ip("netns", "exec", host.ns, "ip", "addr", "add", f"{addr}/30", "dev", link)
            _ip("netns", "exec", host.ns, "ip", "link", "set", link, "up")
        return link, *ends

    def hub(self, center: Host, spokes: Sequence[Host]) -> tuple[str, list[str]]:
        """Links each of `spokes` to `center` by a pair of its own and gives `center` one
        address (a /32 on its loopback, from a /30 of its own) that every spoke reaches, routed
        over its pair: a server that hosts on separate links all name alike, as the nodes of one
        engine must (the same `servers`). Returns that address and the spokes' ends of their
        pairs (where `center`'s replies go: what `center.blackhole` cuts off)."""
        addr = f"10.231.{self.subnet}.{4 * self._slot() + 1}"
        _ip("netns", "exec", center.ns, "ip", "addr", "add", f"{addr}/32", "dev", "lo")
        ends = []
        for spoke in spokes:
            _, there, here = self.join(center, spoke)
            _ip("netns", "exec", spoke.ns, "ip", "route", "add", f"{addr}/32", "via", there)
            ends.append(here)
        return addr, ends

    def close(self) -> None:
        for h in self.hosts:
            h.stop_server()
        for h in self.hosts:
            _ip("netns", "del", h.ns, check=False)
            if h.link in links():  # normally gone with the namespace
                _ip("link", "del", h.link, check=False)
        self.hosts = []
