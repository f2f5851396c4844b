"""Block store throughput at 16 blocks per job over loopback TCP, against the same run's
8-connection loopback TCP ceiling, for each client setting.

For every pair of `connections_per_server` (--conns) and `io_threads` (--io-threads) it starts a
fresh client on one local `memkv serve` (--lanes 8) and measures, in GB/s (10^9 bytes/s) of
value bytes, best of --repeat rounds:
  * new    — `BlockStore` over the native client's submitted operations and completion queue
             (one harvester thread; what the tier and direct mode run);
  * old    — the same store over the client's blocking calls, one Python I/O thread per
             operation in flight (`n_read_threads + n_write_threads` threads, the store before
             the completion queue);
  * raw    — the client alone: one blocking call moving the whole volume (native fan-out over
             its connections, no store);
each for stores and for loads, of --volume bytes cut into jobs of --blocks values of --value
bytes, all jobs submitted at once (a stream; "1 job": one at a time, submit to completion).
Shares are of the TCP ceiling measured just before each row (a loaded box moves): --ceiling-conns
(8) loopback connections between threads of this process moving the same volume
(benchmarks/tcp_ceiling.py). At the end: `memkv bench`'s figures for as many native threads (its
own TCP ceiling, and memkv's put / get without Python), and new / old over every cell.

    python benchmarks/store_async.py [--quick] [--conns 2,4,8] [--io-threads 4,8,16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer, memkv_command  # noqa: E402
from tcp_ceiling import gbps, tcp_ceiling  # noqa: E402

from memkv_vllm.core.client import CodesClient, MemKVClient  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.interface import ProbeHandle  # noqa: E402
from memkv_vllm.core.store import BlockStore, StoreOptions  # noqa: E402


class Blocking:
    """The client's blocking calls only: the store then runs them on its own I/O threads."""

    def __init__(self, codes: CodesClient) -> None:
        self._c = codes

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> ProbeHandle:
        return self._c.submit_exists(keys, lease_ms)

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> bytes:
        return self._c.get_into_ptrs(keys, ptrs, sizes)

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]) -> bytes:
        return self._c.put_ptrs(keys, ptrs, sizes)

    def delete(self, keys: Sequence[bytes]) -> bytes:
        return self._c.delete(keys)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("IB")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


class Workload:
    """`n` values of `value` bytes in one host buffer, cut into jobs of `blocks` values."""

    def __init__(self, volume: int, value: int, blocks: int) -> None:
        self.n = max(blocks, volume // value // blocks * blocks)
        self.value, self.blocks = value, blocks
        self.mem = np.random.default_rng(0).integers(0, 255, (self.n, value), dtype=np.uint8)
        self.ptrs = [int(self.mem[i].ctypes.data) for i in range(self.n)]
        self.nbytes = self.n * value

    def jobs(self) -> list[tuple[list[bytes], list[int], list[int]]]:
        out = []
        for lo in range(0, self.n, self.blocks):
            idx = range(lo, lo + self.blocks)
            out.append(([f"b/{i}".encode() for i in idx], [self.ptrs[i] for i in idx],
                        [self.value] * self.blocks))
        return out


def run_store(st: BlockStore, w: Workload, load: bool, stream: bool) -> float:
    """Seconds to move the workload through `st`."""
    jobs = w.jobs()
    submit = st.submit_load if load else st.submit_store
    t0 = time.perf_counter()
    if stream:
        for j, job in enumerate(jobs):
            submit(j, *job)
        assert st.drain(600)
        done = st.poll()
    else:
        done = []
        for j, job in enumerate(jobs):
            submit(j, *job)
            assert st.drain(600)
            done += st.poll()
    secs = time.perf_counter() - t0
    bad = [c for c in done if not c.ok]
    assert len(done) == len(jobs) and not bad, f"{len(bad)} of {len(jobs)} jobs failed"
    return secs


def measure(address: str, conns: int, io_threads: int, w: Workload, repeat: int,
            modes: Sequence[str]) -> dict[str, list[float]]:
    """GB/s per mode: [store, load, store 1 job, load 1 job] (raw: [store, load])."""
    cfg = load_config({"servers": [address], "connections_per_server": conns,
                       "io_threads": io_threads})
    client = MemKVClient.from_config(cfg)
    out: dict[str, list[float]] = {}
    secs: dict[tuple[str, bool], tuple[list[float], list[float]]] = {
        (m, stream): ([], []) for m in modes for stream in (True, False)}
    try:
        # Rounds outside, modes inside: a box whose load changes meanwhile moves both alike.
        for _, (mode, stream) in itertools.product(range(repeat), secs):
            # A fresh store per round: it would skip storing values it knows are stored.
            face = client.codes if mode == "new" else Blocking(client.codes)
            st = BlockStore(face, StoreOptions(max_store_backlog_bytes=2 * w.nbytes))
            st.register_buffer(int(w.mem.ctypes.data), w.nbytes, owner=w.mem)
            try:
                secs[mode, stream][0].append(run_store(st, w, False, stream))
                secs[mode, stream][1].append(run_store(st, w, True, stream))
            finally:
                st.close()
        for (mode, _), (put, get) in secs.items():
            out.setdefault(mode, []).extend([gbps(w.nbytes, min(put)), gbps(w.nbytes, min(get))])
        keys = [f"raw/{i}".encode() for i in range(w.n)]
        sizes = [w.value] * w.n
        put, get = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            client.codes.put_ptrs(keys, w.ptrs, sizes)
            put.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.codes.get_into_ptrs(keys, w.ptrs, sizes)
            get.append(time.perf_counter() - t0)
        out["raw"] = [gbps(w.nbytes, min(put)), gbps(w.nbytes, min(get))]
    finally:
        client.close()
    return out


def memkv_bench(value: int, volume: int, threads: int, repeat: int) -> dict[str, float]:
    """`memkv bench`'s row for `threads` client threads and values of `value` bytes (its own
    in-process server): its loopback TCP ceiling over as many native connections, and memkv's
    put / get from native threads."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        subprocess.run(memkv_command() + [
            "bench", "--sizes", f"{value >> 10}K", "--threads", str(threads), "--volume",
            f"{volume >> 20}M", "--repeat", str(repeat), "--json", str(out)],
            check=True, capture_output=True, timeout=900)
        row = json.loads(out.read_text())["rows"][0]
    return {k: float(row[k]) for k in ("tcp", "put", "get")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller volume and one round (a check that it runs, not a figure)")
    p.add_argument("--conns", default="2,4,8", help="connections_per_server values")
    p.add_argument("--io-threads", default="4,8,16", help="io_threads values")
    p.add_argument("--volume", default="512M", help="bytes per measurement and direction")
    p.add_argument("--value", default="2M", help="bytes per value (llama-8B: 2 MiB per block)")
    p.add_argument("--blocks", type=int, default=16, help="values per job")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ceiling-conns", type=int, default=8)
    p.add_argument("--modes", default="new,old", help="new, old or both")
    p.add_argument("--lanes", type=int, default=8, help="memkv serve --lanes")
    a = p.parse_args()
    volume = parse_size("64M" if a.quick else a.volume)
    repeat = 1 if a.quick else a.repeat
    w = Workload(volume, parse_size(a.value), a.blocks)
    modes = a.modes.split(",")
    # Rounds overwrite the same keys: room for them twice over, and for the raw run's.
    server = MemKVServer(memory=f"{(4 * w.nbytes >> 20) + 64}M", lanes=a.lanes).start()
    try:
        print(f"{w.n} values of {w.value} B in jobs of {w.blocks} ({w.nbytes / 1e9:.2f} GB per "
              f"direction), best of {repeat}; GB/s and share of the row's TCP ceiling "
              f"({a.ceiling_conns} loopback connections, measured before the row)")
        cols = ["store", "load", "store 1 job", "load 1 job"]
        print(f"{'conns':>5} {'io':>3} {'mode':>4} {'TCP':>6} | "
              + " | ".join(f"{c:>13}" for c in cols))
        new_over_old: list[float] = []
        for conns, io in itertools.product(map(int, a.conns.split(",")),
                                           map(int, a.io_threads.split(","))):
            ceiling = tcp_ceiling(w.nbytes, max(3, repeat), a.ceiling_conns)
            r = measure(server.address, conns, io, w, repeat, modes)
            for mode, v in r.items():
                cells = [f"{x:6.2f} ({x / ceiling:4.0%})" for x in v]
                print(f"{conns:5d} {io:3d} {mode:>4} {ceiling:6.2f} | "
                      + " | ".join(f"{c:>13}" for c in cells), flush=True)
            if "new" in r and "old" in r:
                new_over_old += [n / o for n, o in zip(r["new"], r["old"], strict=True)]
        print("new = completion queue (one harvester thread), old = a Python thread per "
              "operation in flight, raw = one blocking client call for the whole volume")
        mb = memkv_bench(w.value, w.nbytes, a.ceiling_conns, max(3, repeat))
        print(f"memkv bench, {a.ceiling_conns} native threads and connections, values of "
              f"{w.value} B: TCP ceiling {mb['tcp']:.2f} GB/s, memkv put {mb['put']:.2f}, "
              f"get {mb['get']:.2f}")
        if new_over_old:
            print(f"new / old over all rows and columns: min {min(new_over_old):.2f}, "
                  f"median {sorted(new_over_old)[len(new_over_old) // 2]:.2f}, "
                  f"max {max(new_over_old):.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
