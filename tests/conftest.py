"""Shared fixtures: real `memkv serve` processes on free loopback ports, stopped after each test."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memkv_procs import MemKVServer  # noqa: E402
from netns_hosts import Hosts  # noqa: E402


@pytest.fixture
def memkv_server_factory() -> Iterator[Callable[..., MemKVServer]]:
    """Starts servers on demand:
    ``factory(memory='256M', lanes=4, auth_key=None, metrics=False)``."""
    started: list[MemKVServer] = []

    def make(**kw: object) -> MemKVServer:
        s = MemKVServer(**kw).start()  # type: ignore[arg-type]
        started.append(s)
        return s

    yield make
    for s in started:
        s.kill()


@pytest.fixture(params=["tcp", "rdma", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test over each data path: TCP, RDMA over libfabric's tcp provider on loopback
    (servers started after this fixture serve RDMA; `client_for(..., transport=...)` uses it),
    and the same-host path (every server serves it; buffers that are no memfd or /dev/shm
    mapping move over its unix socket, `tests/test_shm.py` covers the server's copies)."""
    if request.param == "rdma":
        monkeypatch.setenv("MEMKV_RDMA", "true")
        monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")
        monkeypatch.setenv("MEMKV_RDMA_DEVICES", "lo")
    return request.param


@pytest.fixture
def memkv_server(memkv_server_factory: Callable[..., MemKVServer]) -> MemKVServer:
    return memkv_server_factory()


@pytest.fixture
def memkv_cluster2(memkv_server_factory: Callable[..., MemKVServer]) -> list[MemKVServer]:
    return [memkv_server_factory(), memkv_server_factory()]


@pytest.fixture
def net_hosts() -> Iterator[Hosts]:
    """Hosts as separate network stacks (tests/netns_hosts.py): ``net_hosts.add()`` makes one,
    each removed after the test, also when it fails. Skips without root or `ip netns`."""
    why = Hosts.available()
    if why is not None:
        pytest.skip(f"hosts as network namespaces: {why}")
    hosts = Hosts()
    try:
        yield hosts
    finally:
        hosts.close()
