"""The disk tier (`memkv serve --disk`) on real filesystems, tmpfs and ext4 in a loop file: values
evicted from DRAM come back byte-exact, leases hold across the spill, flipped bytes and torn
writes are misses and never bytes, a restart serves what was on disk, and a full or failing
filesystem degrades the server to DRAM without stopping it."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from disk_fs import ext4_loop, filesystem, loop_unavailable
from memkv_procs import MemKVServer

pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402

MIB = 1 << 20
V = MIB  # value size: a KV block of a small model


def value(i: int, size: int = V) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def key(i: int) -> bytes:
    return f"disk/block/{i}".encode()


def serve(
    disk: Path, memory: str = "48M", disk_size: str = "128M", extra: list[str] | None = None
) -> MemKVServer:
    # A 16 MiB spill queue (of the 48): room for a burst of 1 MiB spills on a busy test box, so
    # that the counts below do not hang on the writer thread's scheduling.
    args = ["--disk", str(disk), "--disk-size", disk_size, "--disk-queue", "16M"] + (extra or [])
    return MemKVServer(memory=memory, lanes=1, metrics=True, extra=args).start()


def client(srv: MemKVServer) -> MemKVClient:
    return MemKVClient(MemKVConfig(servers=(srv.address,), transport="tcp"))


def put_range(c: MemKVClient, lo: int, hi: int) -> None:
    for i in range(lo, hi):
        assert c.put([key(i)], [value(i)]) == [Status.OK]


def disk_stats(srv: MemKVServer) -> dict:
    return srv.stats()["tiers"]["disk"]


def settled(srv: MemKVServer, timeout: float = 30.0) -> dict:
    """The disk tier's stats once its spill queue is empty."""
    deadline = time.monotonic() + timeout
    while True:
        d = disk_stats(srv)
        if d["queued_bytes"] == 0:
            return d
        assert time.monotonic() < deadline, f"spill queue never drained: {d}"
        time.sleep(0.05)


def read_back(c: MemKVClient, n: int, size: int = V) -> tuple[list[int], list[int]]:
    """GETs keys 0..n: (hits, misses). Every hit must be byte-exact: a wrong byte fails here."""
    hits, misses = [], []
    buf = np.empty(size, dtype=np.uint8)
    for i in range(n):
        st = c.get_into([key(i)], [buf])[0]
        if st == Status.OK:
            assert np.array_equal(buf, value(i, size)), f"key {i}: wrong bytes served"
            hits.append(i)
        else:
            assert st == Status.NOT_FOUND, (i, st)
            misses.append(i)
    return hits, misses


@pytest.fixture(params=["tmpfs", "ext4"])
def disk_dir(request: pytest.FixtureRequest):
    with filesystem(request.param) as d:
        yield d / "tier"


def test_values_evicted_from_dram_come_back_byte_exact(disk_dir: Path) -> None:
    srv = serve(disk_dir)
    try:
        c = client(srv)
        put_range(c, 0, 96)  # three times DRAM
        d = settled(srv)
        # Every value DRAM evicted was written, or dropped and counted (a queue full while the
        # writer is behind: how many depends on this box's load, not on the tier).
        evicted = srv.stats()["tiers"]["dram"]["evictions"]
        dropped = sum(d["spill_dropped"].values())
        assert evicted >= 60 and d["spills"] + dropped == evicted, d
        assert d["spills"] >= 20, d
        hits, misses = read_back(c, 96)
        assert len(hits) >= 96 - dropped, f"misses {misses}, stats {d}"
        spilled = d["spills"]
        d = disk_stats(srv)
        assert d["hits"] >= spilled and d["read_bytes"] >= spilled * V
        # Second reads promote back to DRAM.
        read_back(c, 8)
        assert disk_stats(srv)["promotions"] >= 1
        c.close()
    finally:
        srv.kill()


def test_a_lease_taken_on_disk_outlives_a_flood_of_three_disks(disk_dir: Path) -> None:
    srv = serve(disk_dir, disk_size="48M")
    try:
        c = client(srv)
        put_range(c, 0, 40)
        settled(srv)
        assert c.exists_lengths([key(0)], lease_ms=120_000) == [(Status.OK, V)]
        spills = disk_stats(srv)["spills"]
        put_range(c, 1000, 1150)
        d = settled(srv)
        # Eviction passes over the leased segment: one lease does not stop the tier.
        assert d["spill_dropped"]["leased"] == 0 and d["spills"] >= spills + 60, d
        assert d["file_bytes"] <= 48 * MIB, d
        buf = np.empty(V, dtype=np.uint8)
        assert c.get_into([key(0)], [buf]) == [Status.OK]
        assert np.array_equal(buf, value(0))
        c.close()
    finally:
        srv.kill()


def test_leases_on_disk_hold_at_most_their_share_of_it_and_say_when_refused(
    disk_dir: Path,
) -> None:
    # 64 MiB of disk in 1 MiB segments, of which leases may hold a quarter.
    srv = serve(disk_dir, disk_size="64M", extra=["--max-leased-fraction", "0.25"])
    try:
        c = client(srv)
        put_range(c, 0, 96)
        settled(srv)
        lengths = c.exists_lengths([key(i) for i in range(96)], lease_ms=120_000)
        answers = dict(zip(range(96), lengths, strict=True))
        refused = [i for i, (st, _) in answers.items() if st == Status.OK_NO_LEASE]
        leased = [i for i, (st, _) in answers.items() if st == Status.OK]
        d = disk_stats(srv)
        # DRAM refuses past its own bound (a quarter of its lanes) with the same status.
        assert d["lease_denied"] > 0 and len(refused) >= d["lease_denied"], d
        assert 0 < d["leased_bytes"] <= 16 * MIB, d
        put_range(c, 1000, 1200)  # three times the disk, every unleased segment evicted
        d = settled(srv)
        assert d["file_bytes"] <= 64 * MIB and d["spill_dropped"]["leased"] == 0, d
        hits, _ = read_back(c, 96)
        assert set(leased) <= set(hits), f"leased values lost: {set(leased) - set(hits)}"
        assert disk_stats(srv)["leased_bytes"] == 0, "the loads released their leases"
        c.close()
    finally:
        srv.kill()


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def test_flipped_bytes_in_the_files_are_misses_never_bytes(disk_dir: Path) -> None:
    srv = serve(disk_dir)
    try:
        c = client(srv)
        put_range(c, 0, 96)
        settled(srv)
        segs = segments(disk_dir)
        assert len(segs) >= 3
        # The first record of each segment: its value starts after one header block.
        for s in segs:
            flip(s, 4096 + 12345)
        hits, misses = read_back(c, 96)
        d = disk_stats(srv)
        assert d["corrupt"] >= len(segs) - 1, d
        assert len(misses) >= d["corrupt"]
        # Dropped at the mismatch: asked again, it is a plain miss, not another checksum error.
        assert read_back(c, 96)[1] == misses
        assert disk_stats(srv)["corrupt"] == d["corrupt"]
        c.close()
    finally:
        srv.kill()


def test_a_restart_serves_the_blocks_it_had_on_disk(disk_dir: Path) -> None:
    # Without the flush at stop (test_disk_flush), the restart has exactly what was spilled.
    srv = serve(disk_dir, extra=["--disk-flush-timeout", "0"])
    c = client(srv)
    put_range(c, 0, 96)
    spilled = settled(srv)["items"]
    c.close()
    assert srv.stop() == 0
    srv = serve(disk_dir)
    try:
        d = disk_stats(srv)
        assert d["recovered_items"] == spilled, d
        assert "values indexed from 1 directories" in srv.log()
        c = client(srv)
        hits, _ = read_back(c, 96)
        assert len(hits) >= spilled
        assert disk_stats(srv)["hits"] >= spilled
        c.close()
    finally:
        srv.kill()


def test_kill_9_mid_writes_loses_at_most_values_in_flight_and_serves_no_torn_one(
    disk_dir: Path,
) -> None:
    srv = serve(disk_dir)
    c = client(srv)
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            if c.put([key(i)], [value(i)]) != [Status.OK]:
                break
            written.append(i)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 30
    while disk_stats(srv)["spills"] < 40:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.kill()  # SIGKILL while values stream in and spill out
    stop.set()
    t.join()
    c.close()
    # A torn value under a valid header too: the newest segment's last record loses its tail
    # (as a write cut by a crash leaves it), and the file is cut mid-record after it.
    # The newest segment holding a whole value: the kill may land just after a segment was
    # opened, before any record reached it.
    # (A header block and the value: a segment of 2 MiB takes one 1 MiB record.)
    newest = [s for s in segments(disk_dir) if s.stat().st_size >= V + 4096][-1]
    size = newest.stat().st_size
    with open(newest, "r+b") as f:
        f.seek(size - 8192)
        f.write(b"\0" * 8192)
        f.truncate(size + 4096 - 100)  # and a partial block past the last whole record
    srv = serve(disk_dir)
    try:
        c = client(srv)
        hits, _ = read_back(c, len(written))
        d = disk_stats(srv)
        assert d["recovered_items"] >= 20 and len(hits) >= 20, d
        assert d["corrupt"] <= 1
        assert "torn or unreadable record" in srv.log()
        c.close()
    finally:
        srv.kill()


def scrape(srv: MemKVServer) -> dict[str, str]:
    port = next(
        int(line.split(" metrics=127.0.0.1:")[1].split()[0])
        for line in srv.log().splitlines()
        if " metrics=127.0.0.1:" in line
    )
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")


def test_the_stats_and_metrics_show_each_tier(disk_dir: Path) -> None:
    srv = serve(disk_dir)
    try:
        c = client(srv)
        put_range(c, 0, 64)
        settled(srv)
        read_back(c, 64)
        tiers = srv.stats()["tiers"]
        want = {"bytes", "items", "hits", "spills", "promotions", "read_bytes"}
        for t in ("dram", "disk"):
            assert want <= tiers[t].keys()
        assert tiers["dram"]["hits"] > 0 and tiers["disk"]["hits"] > 0
        assert tiers["disk"]["read_gbps"] > 0
        m = scrape(srv)
        assert int(m['memkv_tier_hits_total{tier="disk"}']) == tiers["disk"]["hits"]
        assert int(m['memkv_tier_spills_total{tier="disk"}']) == tiers["disk"]["spills"]
        assert int(m['memkv_tier_items{tier="dram"}']) == srv.stats()["items"]
        assert m['memkv_disk_spill_dropped_total{reason="queue_full"}'] is not None
        assert m["memkv_disk_degraded_dirs"] == "0"
        c.close()
    finally:
        srv.kill()


def test_a_full_filesystem_cuts_the_tier_to_what_it_holds_and_the_server_goes_on() -> None:
    why = loop_unavailable()
    if why:
        pytest.skip(why)
    with ext4_loop(48) as (mnt, _):
        srv = serve(mnt / "tier", disk_size="1G")  # far more than the filesystem holds
        try:
            c = client(srv)
            # In steps that the spill queue takes whole, so the filesystem fills however slow
            # this machine writes (a full queue drops spills instead, by design).
            for lo in range(0, 200, 10):
                put_range(c, lo, lo + 10)
                d = settled(srv)
            assert d["disk_full"] >= 1 and d["spill_dropped"]["disk_full"] >= 1, d
            assert d["capacity_bytes"] < 48 * MIB
            assert "filesystem full" in srv.log()
            assert srv.alive()
            hits, _ = read_back(c, 200)
            assert len(hits) >= 40
            assert d["degraded_dirs"] == 0, "a full filesystem keeps its values and evicts"
            c.close()
        finally:
            srv.kill()


def test_a_filesystem_turned_read_only_under_traffic_degrades_to_dram() -> None:
    why = loop_unavailable()
    if why:
        pytest.skip(why)
    with ext4_loop(128) as (mnt, dev):
        trigger = Path(f"/sys/fs/ext4/{dev}/trigger_fs_error")
        if not trigger.exists():
            pytest.skip("this kernel's ext4 cannot be told to fail")
        srv = serve(mnt / "tier")
        try:
            c = client(srv)
            put_range(c, 0, 64)
            settled(srv)
            trigger.write_text("memkv test\n")  # errors=remount-ro: the filesystem turns read-only
            put_range(c, 64, 160)
            d = settled(srv)
            assert d["degraded_dirs"] == 1 and d["write_errors"] >= 1, d
            assert "takes no more values" in srv.log()
            assert srv.alive()
            # DRAM still serves what it holds, and the disk what was written before.
            hits, _ = read_back(c, 160)
            assert set(range(140, 160)) <= set(hits)
            c.close()
        finally:
            srv.kill()


def test_four_times_dram_through_the_disk_tier_keeps_rss_bounded(disk_dir: Path) -> None:
    from memkv_procs import proc_status

    srv = serve(disk_dir, extra=["--disk-index-memory", "16M"])
    try:
        assert srv.proc is not None
        c = client(srv)
        put_range(c, 0, 8)
        start_kb = proc_status(srv.proc.pid, "VmRSS")
        rng = np.random.default_rng(7)
        for round_ in range(2):
            put_range(c, 0, 128)  # four times DRAM, overwrites in the second round
            settled(srv)
            buf = np.empty(V, dtype=np.uint8)
            for i in rng.permutation(128)[:64]:
                st = c.get_into([key(int(i))], [buf])[0]
                assert st == Status.NOT_FOUND or np.array_equal(buf, value(int(i))), (round_, i)
        grown = (proc_status(srv.proc.pid, "VmRSS") - start_kb) << 10
        # Spills are staged in a fixed region inside --memory and reads land in lane memory:
        # pushing 256 MiB through a 32 MiB server grows nothing but the small disk index.
        assert grown < 32 * MIB, f"RSS grew by {grown / MIB:.1f} MiB"
        d = disk_stats(srv)
        assert d["spills"] >= 32 and d["index_bytes"] <= 16 * MIB, d
        c.close()
    finally:
        srv.kill()
