"""The disk tier at a graceful stop (`memkv serve --disk ... --disk-flush-timeout`): SIGTERM
writes the values only DRAM holds to disk, so that the restarted server serves them byte-exact,
and the flush ends at its timeout however much DRAM holds."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from disk_fs import filesystem
from memkv_procs import MemKVServer
from test_disk_tier import (
    V,
    client,
    disk_stats,
    key,
    put_range,
    read_back,
    serve,
    settled,
    value,
)

pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402


@pytest.fixture(params=["tmpfs", "ext4"])
def disk_dir(request: pytest.FixtureRequest):
    with filesystem(request.param) as d:
        yield d / "tier"


def flush_field(log: str, name: str) -> int:
    m = re.search(rf"disk tier: flush.*\b{name}=(\d+)", log)
    assert m, f"no {name} in the flush's log line: {log}"
    return int(m.group(1))


def hit(c: MemKVClient, i: int) -> bool:
    """Whether key i hits; a hit must be byte-exact."""
    buf = np.empty(V, dtype=np.uint8)
    st = c.get_into([key(i)], [buf])[0]
    assert st in (Status.OK, Status.NOT_FOUND), (i, st)
    assert st != Status.OK or np.array_equal(buf, value(i)), f"key {i}: wrong bytes served"
    return st == Status.OK


def test_a_graceful_stop_writes_dram_to_disk_and_the_restart_serves_it(disk_dir: Path) -> None:
    srv = serve(disk_dir)
    c = client(srv)
    put_range(c, 0, 20)  # all in DRAM (32 MiB of lanes)
    assert disk_stats(srv)["items"] == 0
    put_range(c, 100, 150)  # pushes some of those to disk, and keeps the newest in DRAM
    settled(srv)
    buf = np.empty(V, dtype=np.uint8)
    for _ in range(2):  # a second disk hit promotes: the DRAM copy is on disk already
        assert c.get_into([key(0)], [buf]) == [Status.OK]
    assert disk_stats(srv)["promotions"] == 1
    settled(srv)  # the value the promotion evicted is written before the flush counts
    every = list(range(0, 20)) + list(range(100, 150))
    answers = c.exists_lengths([key(i) for i in every])
    present = {i for i, (st, _) in zip(every, answers, strict=True) if st == Status.OK}
    in_dram = srv.stats()["tiers"]["dram"]["items"]
    c.close()
    assert srv.stop() == 0
    log = srv.log()
    assert "disk tier: flushed" in log, log
    assert flush_field(log, "written") == in_dram - 1
    assert flush_field(log, "already_on_disk") == 1
    srv = serve(disk_dir)
    try:
        c = client(srv)
        hits = {i for i in every if hit(c, i)}
        assert hits == present, f"lost {sorted(present - hits)}"
        assert srv.stats()["tiers"]["dram"]["items"] == 0, "served from disk, not kept in DRAM"
        c.close()
    finally:
        srv.kill()


def test_without_a_flush_timeout_a_stop_writes_nothing(disk_dir: Path) -> None:
    srv = serve(disk_dir, extra=["--disk-flush-timeout", "0"])
    c = client(srv)
    put_range(c, 0, 10)
    c.close()
    assert srv.stop() == 0
    srv = serve(disk_dir)
    try:
        assert disk_stats(srv)["recovered_items"] == 0
    finally:
        srv.kill()


def test_the_flush_ends_at_its_timeout_and_what_it_wrote_is_served() -> None:
    with filesystem("tmpfs") as d:
        tier = d / "tier"
        # 300 MiB of values in DRAM: copying them through the spill queue takes far longer
        # than the 20 ms allowed.
        srv = MemKVServer(memory="384M", lanes=2, extra=[
            "--disk", str(tier), "--disk-size", "1G", "--disk-queue", "16M",
            "--disk-flush-timeout", "0.02"]).start()
        c = client(srv)
        put_range(c, 0, 300)
        assert disk_stats(srv)["items"] == 0
        c.close()
        assert srv.proc is not None
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        took = time.monotonic() - t
        log = srv.log()
        written, left = flush_field(log, "written"), flush_field(log, "left")
        assert "timed_out=true" in log and left > 0 and written + left == 300, log
        # The drain has nothing to wait for, so the stop is the flush's 20 ms and the exit.
        assert took < 5, f"stop took {took:.1f} s"
        srv = serve(tier, disk_size="1G")
        try:
            c = client(srv)
            # Records that were mid-write at the exit are whole or dropped at recovery: never
            # fewer than the flush counted, never a wrong byte.
            assert written <= disk_stats(srv)["recovered_items"] < 300
            hits, _ = read_back(c, 300)
            assert len(hits) >= written
            c.close()
        finally:
            srv.kill()
