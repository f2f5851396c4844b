"""Key prefixes at startup: the scheduler adopts what every worker rank published, through this
host's files or the cluster (a real `memkv serve`, a real Redis Cluster), and stops startup naming
the rank and host that published nothing, disagrees, or left only a dead engine's entry.

"Nodes" are processes of their own (tests/board_node.py) with a host name of their own
(`unshare --uts`) and a board directory of their own, so only the cluster connects them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from memkv_vllm.core.backends import make_client
from memkv_vllm.core.config import load_config
from memkv_vllm.direct.keys import DirectKeyLayout
from memkv_vllm.direct.prefixes import (
    BOARD_MAGIC,
    CLOCK_SKEW_S,
    PrefixBoard,
    PrefixMismatch,
    adopt,
)

ROOT = Path(__file__).resolve().parents[2]
BOARD_NODE = ROOT / "tests" / "board_node.py"
P, Q = b"mkD1" + b"\x01" * 16, b"mkD1" + b"\x02" * 16


def test_agreeing_ranks_are_adopted() -> None:
    assert adopt({0: b"p", 1: b"p", 2: b"p"}, 3) == b"p"


def test_a_rank_that_published_nothing_is_named() -> None:
    with pytest.raises(PrefixMismatch, match=r"rank\(s\) \[1, 3\] published no key prefix"):
        adopt({0: b"p", 2: b"p"}, 4)


def test_disagreeing_ranks_are_named_with_their_hosts() -> None:
    with pytest.raises(PrefixMismatch, match=r"rank 0 on a: 70.*rank 2 on b: 71"):
        adopt({0: b"p", 1: b"p", 2: b"q"}, 3, {0: "a", 1: "a", 2: "b"})


def test_one_host_needs_no_cluster_and_leaves_no_files(tmp_path) -> None:
    root = tmp_path / "board"
    for rank in range(2):
        PrefixBoard("engine-1", None, root).publish(rank, P)
    assert PrefixBoard("engine-2", None, root).read(2) == {0: None, 1: None}  # engines apart
    assert PrefixBoard("engine-1", None, root).adopt(2) == P
    assert os.listdir(root) == []  # a later engine with the same id reads nothing stale
    with pytest.raises(PrefixMismatch, match=r"\[0, 1\]"):
        PrefixBoard("engine-1", None, root, wait_s=0).adopt(2)


def test_ranks_that_disagree_stop_the_start_without_waiting_for_the_rest(tmp_path) -> None:
    root = tmp_path / "board"
    PrefixBoard("engine-1", None, root).publish(0, P)
    PrefixBoard("engine-1", None, root).publish(1, Q)
    t0 = time.monotonic()
    with pytest.raises(PrefixMismatch, match=rf"disagree.*rank 0 on host \S+ \(pid {os.getpid()}"
                                             rf"\): {P.hex()}; rank 1 .*: {Q.hex()}"):
        PrefixBoard("engine-1", None, root, wait_s=30).adopt(3)  # rank 2 never publishes
    assert time.monotonic() - t0 < 10


def test_board_refuses_a_directory_others_can_write(tmp_path) -> None:
    root = tmp_path / "board"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(PrefixMismatch, match="not private"):
        PrefixBoard("e", None, root).publish(0, b"p")


def test_board_keys_cannot_collide_with_kv_keys() -> None:
    key = PrefixBoard("engine-1").key(3)
    assert key.startswith(BOARD_MAGIC) and key != PrefixBoard("engine-2").key(3)
    with pytest.raises(UnicodeDecodeError):
        key.decode()  # tier keys are UTF-8 path names (memkv_vllm.core.keys)
    layout = DirectKeyLayout(model="m", weights="w", dtype="bf16", tp_size=1, block_size=16,
                             kv_layout="x", hash_algo="sha256", hash_seed="")
    assert not layout.key(b"\x00" * 32, 0, 0).startswith(key[:4])


# ------------------------------------------------------------------ over a real cluster
@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[list[str]]:
    pytest.importorskip("redis", reason="the redis backend needs redis-py")
    from redis_procs import RedisCluster

    c = RedisCluster(primaries=3, replicas=0)
    yield c.urls
    c.stop()


@pytest.fixture(params=["memkv", "redis"])
def cluster(request: pytest.FixtureRequest) -> dict:
    """The client settings of a real cluster: one memkv server, or a Redis Cluster."""
    if request.param == "memkv":
        server = request.getfixturevalue("memkv_server")
        return {"servers": [server.address], "op_timeout_s": 5}
    return {"backend": "redis", "servers": request.getfixturevalue("redis_cluster"),
            "op_timeout_s": 5}


@pytest.fixture
def board_client(cluster: dict) -> Iterator[object]:
    c = make_client(load_config(cluster, env={}))
    yield c
    c.close()


class Node:
    """A board_node.py process; `host` None keeps this host's name; `netns` runs it in that
    network namespace."""

    def __init__(self, spec: dict, host: str | None, netns: str | None = None) -> None:
        cmd = [sys.executable, str(BOARD_NODE), json.dumps(spec)]
        if host is not None:
            if os.geteuid() != 0 or shutil.which("unshare") is None:
                pytest.skip("a host name of its own needs root and unshare (util-linux)")
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.started = self.line()

    def line(self) -> dict:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        assert out, f"board node exited ({self.proc.wait(10)})"
        return json.loads(out)

    def end(self) -> None:
        """Closes stdin (a holding node exits) and waits for the process."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(20) == 0


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        if n.proc.poll() is None:
            n.proc.kill()
            n.proc.wait(10)


def spawn(nodes: list[Node], tmp_path: Path, host: str | None, netns: str | None = None,
          **spec: object) -> Node:
    spec.setdefault("root", str(tmp_path / f"board-{host}"))
    n = Node(spec, host, netns)
    nodes.append(n)
    return n


@pytest.mark.slow
def test_two_nodes_agree_through_the_cluster(cluster, board_client, nodes, tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    b = spawn(nodes, tmp_path, "nodeb", config=cluster, engine=eid,
              publish={"2": P.hex(), "3": P.hex()}, hold=True)
    a = spawn(nodes, tmp_path, "nodea", config=cluster, engine=eid,
              publish={"0": P.hex(), "1": P.hex()}, adopt=4, wait_s=5)
    assert a.line()["adopted"] == P.hex()
    a.end()
    b.end()
    # The scheduler removed the entries from the cluster once read.
    assert PrefixBoard(eid, board_client, tmp_path / "empty").read(4) == dict.fromkeys(range(4))


@pytest.mark.slow
def test_a_node_on_a_network_stack_of_its_own_reaches_the_board_through_its_link(
        net_hosts, memkv_server_factory, nodes, tmp_path) -> None:
    """Node B in a network namespace whose only way out is its veth pair; the server listens
    on the root namespace's end of that pair, where node A (the scheduler's) finds it too."""
    b_host = net_hosts.add()
    server = memkv_server_factory(memory="32M", lanes=1, listen=f"{b_host.peer}:0")
    cfg = {"servers": [server.address], "connect_timeout_s": 1, "op_timeout_s": 5}
    eid = f"e-{uuid.uuid4().hex}"
    b = spawn(nodes, tmp_path, "nodeb", b_host.ns, config=cfg, engine=eid,
              publish={"1": P.hex()}, hold=True)
    a = spawn(nodes, tmp_path, "nodea", config=cfg, engine=eid, publish={"0": P.hex()},
              adopt=2, wait_s=5)
    assert a.line()["adopted"] == P.hex()
    a.end()
    b.end()


@pytest.mark.slow
def test_a_rank_on_another_node_that_disagrees_is_named_with_its_host(
        cluster, nodes, tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    b = spawn(nodes, tmp_path, "nodeb", config=cluster, engine=eid, publish={"1": Q.hex()},
              hold=True)
    a = spawn(nodes, tmp_path, "nodea", config=cluster, engine=eid, publish={"0": P.hex()},
              adopt=2, wait_s=5)
    err = a.line()["error"]
    assert "disagree" in err
    assert f"rank 0 on host nodea (pid {a.started['pid']}): {P.hex()}" in err
    assert f"rank 1 on host nodeb (pid {b.started['pid']}): {Q.hex()}" in err
    b.end()


@pytest.mark.slow
def test_a_node_that_publishes_nothing_is_named_after_a_bounded_wait(
        cluster, nodes, tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    a = spawn(nodes, tmp_path, "nodea", config=cluster, engine=eid,
              publish={"0": P.hex(), "1": P.hex()}, adopt=4, wait_s=1.0)
    out = a.line()
    err = out["error"]
    assert "rank(s) [2, 3] published no live key prefix within 1 s" in err
    assert "rank 2: no entry, its node published nothing" in err
    assert "rank 0 on host nodea" in err and "this scheduler runs on host nodea" in err
    assert 1.0 <= out["seconds"] < 1.0 + 2.0  # the wait, plus the last poll's reads
    a.end()


@pytest.mark.slow
def test_a_dead_engines_entry_on_this_host_is_stale(cluster, board_client, nodes,
                                                    tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    root = tmp_path / "board"
    dead = spawn(nodes, tmp_path, None, config=cluster, engine=eid, root=str(root),
                 publish={"1": P.hex()})
    dead.end()  # published, then died before any scheduler read it
    board = PrefixBoard(eid, board_client, root, wait_s=0.3)
    board.publish(0, P)
    with pytest.raises(PrefixMismatch,
                       match=rf"rank 1: only an entry from host \S+ \(pid {dead.started['pid']}"
                             rf"\), stale: its process {dead.started['pid']} has exited"):
        board.adopt(2)


@pytest.mark.slow
def test_a_dead_engines_entry_from_another_host_is_stale_and_a_live_one_replaces_it(
        cluster, board_client, nodes, tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    dead = spawn(nodes, tmp_path, "nodeb", config=cluster, engine=eid, publish={"1": P.hex()})
    dead.end()
    # An engine started after the dead one's entry was written (beyond any clock skew).
    since = time.time() + CLOCK_SKEW_S + 1
    board = PrefixBoard(eid, board_client, tmp_path / "a", wait_s=0.3, since=since)
    board.publish(0, P)
    with pytest.raises(PrefixMismatch, match=r"rank 1: only an entry from host nodeb .*stale: "
                                             r"published \d+ s before this engine started"):
        board.adopt(2)
    # The same engine id again, every rank live: adopted, the stale entry overwritten.
    board.publish(0, P)
    live = spawn(nodes, tmp_path, "nodeb", config=cluster, engine=eid, publish={"1": P.hex()},
                 hold=True)
    assert PrefixBoard(eid, board_client, tmp_path / "a", wait_s=5, since=since - 60
                       ).adopt(2) == P
    live.end()


def test_an_entry_past_its_lease_has_expired(board_client, tmp_path) -> None:
    eid = f"e-{uuid.uuid4().hex}"
    PrefixBoard(eid, board_client, tmp_path / "b", lease_s=0.01).publish(1, P)
    time.sleep(0.05)  # the lease runs on the wall clock: nothing to poll
    board = PrefixBoard(eid, board_client, tmp_path / "a", wait_s=0)
    board.publish(0, P)
    with pytest.raises(PrefixMismatch, match=r"rank 1: only an entry .* expired: published \d+ s "
                                             r"ago, lease 0.01 s"):
        board.adopt(2)


def test_a_cluster_that_cannot_be_read_adopts_the_local_ranks_unchecked(tmp_path, caplog) -> None:
    """A partition at startup: the ranks found on this host are adopted, the others logged."""
    unreachable = make_client(load_config({"servers": ["127.0.0.1:1"], "connect_timeout_s": 0.2,
                                           "op_timeout_s": 0.5}, env={}))
    try:
        board = PrefixBoard("e-part", unreachable, tmp_path / "a", wait_s=0.2)
        board.publish(0, P)
        assert board.adopt(2) == P
    finally:
        unreachable.close()
    assert re.search(r"could not be read for rank\(s\) \[1\] \(1: (REFUSED|UNAVAILABLE)\)",
                     caplog.text)
