#!/usr/bin/env python3
"""The disk tier's GET rate against the raw direct-I/O read rate of the same files, in one run.

For each value size a server (`memkv serve --disk`) gets values worth several times its DRAM, so
most spill to its segment files; it is then restarted for each thread count (an empty DRAM, every
value on disk, no hit counted yet: each GET below is a disk read, none a promotion). Then:

  tier     T client threads GET the values one key per request (a disk-tier read: O_DIRECT
           preads from the read pool into lane memory, every chunk checked, then sent over TCP)
  ceiling  the same segment files read with O_DIRECT preads into aligned buffers, nothing
           else: the better of T threads reading whole values and 1 MiB reads at the tier's
           depth (T values at a time, each split over the read pool): what the device and
           filesystem give

and prints both in GB/s with their ratio (tier / ceiling). A third figure, `dram`, is GETs of values
back in DRAM (promoted on their second hit), the network path's own ceiling on this host: where
it is below the disk ceiling, no disk tier can reach the disk's.

  .venv/bin/python benchmarks/disk_tier.py --dir /mnt/nvme/bench [--sizes 1,4,16,64]
      [--threads 1,2,4,8] [--volume 2048] [--memory 256] [--json out.json] [--out DIR]
  bash scripts/gpu-run.sh python benchmarks/disk_tier.py --quick --dir /local/disk/bench --out DIR

--dir must be on the filesystem to measure (tmpfs measures memory copies, not a device); the
run prints which filesystem and device it is. Sizes are MiB; --volume is MiB of values per size.
--quick is 1 and 16 MiB values at 1 and 4 threads over 512 MiB (a few minutes at most on a
local NVMe). --out DIR writes disk_tier.json (the rows, with the host and filesystem) and
disk_tier.txt (what was printed) there. The server binary is $MEMKV_BIN or the `memkv` next to
this interpreter.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memkv_procs import MemKVServer  # noqa: E402
from vs_peers import run_threads  # noqa: E402

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402

MIB = 1 << 20
BLOCK = 4096


def key(i: int) -> bytes:
    return f"bench/disk/{i}".encode()


def gets(srv: MemKVServer, keys: list[int], size: int, threads: int) -> tuple[float, int]:
    """GB/s of GETs of `keys` (thread t takes every t-th) over `threads` clients, and how many
    hit."""
    clients = [MemKVClient(MemKVConfig(servers=(srv.address,))) for _ in range(threads)]
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(threads)]
    hits = [0] * threads

    def work(t: int) -> None:
        for i in keys[t::threads]:
            if clients[t].get_into([key(i)], [bufs[t]]) == [Status.OK]:
                hits[t] += 1

    took = run_threads(threads, work)
    for c in clients:
        c.close()
    return sum(hits) * size / took / 1e9, sum(hits)


def raw_ceiling(files: list[Path], size: int, threads: int) -> float:
    """GB/s of O_DIRECT preads of `size` bytes over the whole of `files`, `threads` at once."""
    io = (size + BLOCK - 1) // BLOCK * BLOCK
    pieces = []
    for f in files:
        n = f.stat().st_size
        pieces += [(f, off) for off in range(0, n - n % BLOCK, io)]
    done = [0] * threads

    def work(t: int) -> None:
        buf = mmap.mmap(-1, io)  # page-aligned, as O_DIRECT wants
        fds: dict[Path, int] = {}
        try:
            for f, off in pieces[t::threads]:
                if f not in fds:
                    fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
                done[t] += os.preadv(fds[f], [buf], off)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    took = run_threads(threads, work)
    return sum(done) / took / 1e9


def where(path: Path) -> dict:
    """The filesystem and device `path` is on (the longest mount point above it)."""
    best = ("", "?", "?")
    here = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fs = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        inside = here == mnt or here.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > len(best[0]):
            best = (mnt, fs, dev)
    return {"mount": best[0], "fs": best[1], "device": best[2]}


def run_size(
    base: Path, size_mib: int, threads: list[int], volume_mib: int, memory_mib: int,
    say: Callable[[str], None],
) -> list:
    memory = f"{memory_mib}M"
    size = size_mib * MIB
    n = max(8, volume_mib // size_mib)
    disk = base / f"v{size_mib}"
    shutil.rmtree(disk, ignore_errors=True)
    args = [
        "--disk",
        str(disk),
        "--disk-size",
        f"{2 * volume_mib + 4 * size_mib}M",
        "--disk-queue",
        f"{memory_mib // 4}M",
        "--disk-read-threads",
        "8",
    ]
    srv = MemKVServer(memory=memory, lanes=1, extra=args).start()
    c = MemKVClient(MemKVConfig(servers=(srv.address,)))
    data = np.random.default_rng(size_mib).integers(0, 256, size, dtype=np.uint8)
    for i in range(n):
        # A queue full drops a spill; paced puts keep the bench's data set whole.
        assert c.put([key(i)], [data]) == [Status.OK]
        while srv.stats()["tiers"]["disk"]["queued_bytes"] > memory_mib * MIB // 8:
            time.sleep(0.01)
    while srv.stats()["tiers"]["disk"]["queued_bytes"]:
        time.sleep(0.05)
    c.close()
    srv.stop()
    rows = []
    for t in threads:
        srv = MemKVServer(memory=memory, lanes=1, extra=args).start()
        try:
            on_disk = srv.stats()["tiers"]["disk"]["items"]
            keys = list(range(n))
            tier, hits = gets(srv, keys, size, t)
            # DRAM: as many values as fit half of it, read twice (the second hit promotes),
            # then timed over enough repeats that every thread has work.
            fit = keys[: max(1, memory_mib // 2 // size_mib)]
            gets(srv, fit, size, 1)
            gets(srv, fit, size, 1)
            dram, _ = gets(srv, fit * max(1, 4 * t * 32 // len(fit) // size_mib), size, t)
            files = sorted(disk.glob("*.seg"))
            # The tier splits a value into 1 MiB reads, several in flight: the ceiling is the
            # better of reads of the whole value on T threads and 1 MiB reads at the tier's
            # depth (T values, each over up to 9 readers: the read pool's 8 and the caller).
            depth = t * min(9, max(1, size_mib))
            ceiling = max(raw_ceiling(files, size, t), raw_ceiling(files, MIB, depth))
        finally:
            srv.stop()
        row = {
            "size_mib": size_mib,
            "threads": t,
            "values": n,
            "on_disk": on_disk,
            "disk_hits": hits,
            "tier_gbps": round(tier, 3),
            "ceiling_gbps": round(ceiling, 3),
            "ratio": round(tier / ceiling, 3),
            "dram_gbps": round(dram, 3),
        }
        rows.append(row)
        say(
            f"{size_mib:>4} MiB x{t}: tier {tier:6.2f} GB/s  ceiling {ceiling:6.2f} GB/s  "
            f"ratio {tier / ceiling:5.1%}  (dram {dram:6.2f} GB/s; {hits}/{n} from disk)"
        )
    shutil.rmtree(disk, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="where the segment files go")
    p.add_argument("--sizes", default="1,4,16,64", help="value sizes, MiB")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--volume", type=int, default=2048, help="MiB of values per size")
    p.add_argument("--memory", type=int, default=256, help="the server's --memory, MiB")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="1,16 MiB x 1,4 threads over 512 MiB")
    p.add_argument("--out", type=Path, help="directory for disk_tier.json and disk_tier.txt")
    a = p.parse_args()
    if a.quick:
        a.sizes, a.threads, a.volume = "1,16", "1,4", 512
    a.dir.mkdir(parents=True, exist_ok=True)
    fs = where(a.dir)
    printed: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        printed.append(line)

    say(f"{os.uname().nodename}: {a.dir} on {fs['fs']} ({fs['device']}, mounted at "
        f"{fs['mount']}); {os.cpu_count()} CPUs")
    if fs["fs"] == "tmpfs":
        say("warning: tmpfs measures memory copies, not a device")
    threads = [int(t) for t in a.threads.split(",")]
    t0 = time.monotonic()
    rows = []
    for s in a.sizes.split(","):
        rows += run_size(a.dir, int(s), threads, a.volume, a.memory, say)
    ratios = sorted(r["ratio"] for r in rows)
    say(f"tier / ceiling: {ratios[0]:.1%} to {ratios[-1]:.1%}, median "
        f"{ratios[len(ratios) // 2]:.1%} (target >= 85%); {time.monotonic() - t0:.0f} s")
    result = {"host": os.uname().nodename, "dir": str(a.dir), **fs, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "disk_tier.json").write_text(json.dumps(result, indent=1) + "\n")
        (a.out / "disk_tier.txt").write_text("\n".join(printed) + "\n")


if __name__ == "__main__":
    main()
