"""A host without libfabric, made here with MEMKV_LIBFABRIC naming a library that does not exist
(the variable names the libfabric to load, e.g. AWS EFA's own under /opt/amazon/efa/lib64):
`import memkv_vllm` and `memkv serve` work, transport `rdma` is a clear error naming the path,
`auto` says so in one log line and uses TCP, `memkv serve --rdma` refuses to start, and
`memkv net selftest` reports it. Each check runs in a fresh process: a process loads libfabric
(or fails to) once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from memkv_procs import memkv_command

MISSING = "/nonexistent/libfabric.so.1"
SAYS = f"cannot load libfabric from MEMKV_LIBFABRIC={MISSING}"


@pytest.fixture(autouse=True)
def no_libfabric(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process this test starts (servers included) looks for libfabric at MISSING."""
    monkeypatch.setenv("MEMKV_LIBFABRIC", MISSING)
    monkeypatch.setenv("MEMKV_RDMA_PROVIDER", "tcp")


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=os.environ)


def test_the_python_client_imports_refuses_rdma_and_runs_auto_over_tcp(memkv_server):
    script = textwrap.dedent(f"""
        import logging
        logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
        from memkv_vllm.core.client import MemKVClient, Status
        from memkv_vllm.core.config import MemKVConfig
        try:
            MemKVClient(MemKVConfig(servers=({memkv_server.address!r},), transport="rdma"))
        except ValueError as e:
            print("RDMA ERROR", e)
        for i in range(2):
            c = MemKVClient(MemKVConfig(servers=({memkv_server.address!r},), transport="auto"))
            d = bytearray(5)
            print("AUTO", c.put([b"k"], [b"value"]) == [Status.OK],
                  c.get_into([b"k"], [d]) == [Status.OK] and d == b"value")
    """)
    out = run([sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"RDMA ERROR transport 'rdma': dlopen: {SAYS}: "), lines[0]
    assert lines[1:] == ["AUTO True True"] * 2
    said = [ln for ln in out.stderr.splitlines() if "no usable RDMA" in ln]
    assert len(said) == 1 and "using TCP" in said[0] and MISSING in said[0], out.stderr


def test_the_server_runs_without_libfabric_and_refuses_rdma_clearly(memkv_server_factory):
    srv = memkv_server_factory(memory="16M", lanes=1)
    assert srv.stats()["items"] == 0
    out = run(memkv_command() + ["serve", "--listen", "127.0.0.1:0", "--memory", "16M",
                                 "--rdma"])
    assert out.returncode == 1, out.stdout + out.stderr
    assert SAYS in out.stderr and "--rdma: cannot open libfabric" in out.stderr, out.stderr
    assert "panic" not in out.stderr.lower()


def test_selftest_reports_the_missing_library_and_still_checks_tcp():
    out = run(memkv_command() + ["net", "selftest"])
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[1].startswith("ok    tcp round trip: put and got back 3 values")
    assert lines[2].startswith(f"FAIL  libfabric: {SAYS}: "), lines[2]
    assert lines[3] == "skip  rdma round trip: no libfabric provider to run it over"
    assert lines[-1].endswith("1 failed, 1 not checked")
