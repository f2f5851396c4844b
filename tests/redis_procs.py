"""Real Redis Cluster and standalone Redis processes on free loopback ports (tests, benchmarks).

Everything runs from the distribution's `redis-server` and `redis-cli`, or `valkey-server` and
`valkey-cli` for flavor "valkey" (scripts/test.sh --setup installs both): no container, one
temporary directory per process for its cluster config, every process killed at `stop()`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

FLAVORS = ("redis", "valkey")


def redis_binaries(flavor: str = "redis") -> tuple[str, str]:
    """(<flavor>-server, <flavor>-cli), or the calling test is skipped with the command that
    installs them. A clean machine gets them from `bash scripts/test.sh --setup`."""
    server, cli = shutil.which(f"{flavor}-server"), shutil.which(f"{flavor}-cli")
    if server is None or cli is None:
        pytest.skip(f"{flavor}-server / {flavor}-cli not installed (bash scripts/test.sh --setup "
                    f"installs them: apt-get install {flavor}-server)")
    return server, cli


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports whose +10000 (the cluster bus port) is free too."""
    out: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(out) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                s.close()
                continue
            bus = socket.socket()
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                s.close()
                continue
            finally:
                bus.close()
            held.append(s)
            out.append(port)
    finally:
        for s in held:
            s.close()
    return out


def poll(cond, timeout: float, what: str, interval: float = 0.05):  # noqa: ANN001, ANN201
    """Wait until `cond()` is truthy and return it; AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class RedisNode:
    """One `redis-server` (or `valkey-server`) process, cluster-enabled or standalone."""

    def __init__(self, port: int, cluster: bool, extra: list[str] | None = None,
                 node_timeout_ms: int = 1000, password: str | None = None,
                 cli_args: list[str] | None = None, flavor: str = "redis") -> None:
        self.port = port
        self.password = password
        self.cli_args = cli_args or []  # e.g. --tls --cacert ... for a TLS-only server
        self.dir = Path(tempfile.mkdtemp(prefix=f"redis-{port}-"))
        server, self.cli = redis_binaries(flavor)
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log")]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(node_timeout_ms),
                     # a replica takes over as soon as its primary is judged failed
                     "--cluster-replica-validity-factor", "0"]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args + (extra or []), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cmd(self, *args: str, timeout: float = 10.0) -> str:
        """One redis-cli command against this node; its stdout (raises on failure)."""
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        p = subprocess.run([self.cli, "-p", str(self.port), *self.cli_args, *auth, *args],
                           capture_output=True,
                           text=True, timeout=timeout)
        if p.returncode != 0:
            # redis-cli --cluster prints its errors on stdout.
            raise RuntimeError(f"redis-cli {' '.join(args)}: {p.stderr.strip()}"
                               f"{p.stdout.strip()[-2000:]}")
        return p.stdout

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ping(self) -> bool:
        try:
            return self.alive() and self.cmd("PING", timeout=2).strip() == "PONG"
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def info(self, section: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.cmd("INFO", section).splitlines():
            k, sep, v = line.strip().partition(":")
            if sep:
                out[k] = v
        return out

    def kill(self) -> None:
        """SIGKILL: the abrupt death of a node."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """`primaries` primaries with `replicas` replicas each, made by `<flavor>-cli --cluster
    create`."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 extra: list[str] | None = None, flavor: str = "redis") -> None:
        self.flavor = flavor
        self.nodes: list[RedisNode] = []
        try:
            for port in free_ports(primaries * (1 + replicas)):
                self.nodes.append(RedisNode(port, True, extra, node_timeout_ms, flavor=flavor))
            for n in self.nodes:
                poll(n.ping, 20, f"redis-server on {n.port}")
            cli = self.nodes[0].cli
            p = subprocess.run([cli, "--cluster", "create",
                                *[n.address for n in self.nodes],
                                "--cluster-replicas", str(replicas), "--cluster-yes"],
                               capture_output=True, text=True, timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {p.stdout}{p.stderr}")
            self.wait_healthy()
            # Replicas reach every node's slot map (what clients load) a little later.
            poll(lambda: all(self._slot_map_has_replicas(n, replicas) for n in self.nodes), 30,
                 "every node to list the replicas in CLUSTER SLOTS", interval=0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [f"redis://{n.address}" for n in self.nodes]

    def live(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.alive()]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every live node says cluster_state:ok and knows all 16384 slots as assigned."""
        def ok() -> bool:
            for n in self.live():
                try:
                    i = _cluster_info(n)
                except (RuntimeError, subprocess.TimeoutExpired):
                    return False
                if i.get("cluster_state") != "ok" or i.get("cluster_slots_ok") != "16384":
                    return False
            return True
        poll(ok, timeout, "cluster_state:ok on every live node", interval=0.1)

    @staticmethod
    def _slot_map_has_replicas(node: RedisNode, replicas: int) -> bool:
        import redis

        with redis.Redis(port=node.port, password=node.password) as r:
            ranges = r.execute_command("CLUSTER", "SLOTS")
        # each range: [start, end, primary, replica...]
        return bool(ranges) and all(len(rng) - 3 >= replicas for rng in ranges)

    def primaries(self) -> list[RedisNode]:
        return [n for n in self.live() if n.info("replication").get("role") == "master"]

    def replicas_caught_up(self) -> bool:
        """Every live primary's replicas have acknowledged its whole replication stream."""
        for p in self.primaries():
            info = p.info("replication")
            off = int(info["master_repl_offset"])
            acked = [int(v.split("offset=")[1].split(",")[0]) for k, v in info.items()
                     if k.startswith("slave") and "offset=" in v]
            if not acked or min(acked) < off:
                return False
        return True

    def replica_of(self, primary: RedisNode) -> RedisNode:
        for n in self.live():
            info = n.info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary.port:
                return n
        raise AssertionError(f"no replica of {primary.port}")

    def node_id(self, node: RedisNode) -> str:
        return node.cmd("CLUSTER", "MYID").strip()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def _cluster_info(n: RedisNode) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in n.cmd("CLUSTER", "INFO").splitlines():
        k, sep, v = line.strip().partition(":")
        if sep:
            out[k] = v
    return out


class RedisStandalone:
    """One standalone `redis-server` (e.g. with maxmemory + allkeys-lru for eviction tests)."""

    def __init__(self, extra: list[str] | None = None, password: str | None = None,
                 tls: tuple[str, str] | None = None, flavor: str = "redis") -> None:
        """`tls` = (certificate, key) files: the server then listens with TLS only, the
        certificate being its own CA."""
        port = free_ports(1)[0]
        cli: list[str] = []
        if tls:
            extra = [*(extra or []), "--port", "0", "--tls-port", str(port), "--tls-cert-file",
                     tls[0], "--tls-key-file", tls[1], "--tls-ca-cert-file", tls[0],
                     "--tls-auth-clients", "no"]
            cli = ["--tls", "--cacert", tls[0]]
        self.node = RedisNode(port, False, extra, password=password, cli_args=cli, flavor=flavor)
        self.scheme = "rediss" if tls else "redis"
        try:
            poll(self.node.ping, 20, f"redis-server on {self.node.port}")
        except BaseException:
            self.node.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [f"{self.scheme}://{self.node.address}"]

    def stop(self) -> None:
        self.node.stop()
