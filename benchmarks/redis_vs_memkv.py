"""memkv and Redis Cluster side by side, through the same block-client interface, in one run.

Starts `memkv serve` and a Redis Cluster (`redis-server`, --redis-primaries primaries with
--redis-replicas replicas each) on loopback, then, round by round with the order of the two
rotated (so a noisy neighbour hits both alike), for each value size:
  * put GB/s  — --threads threads each storing its share of --mib MiB with `put_ptrs`, batches
                of --batch values (what the block store's I/O threads do);
  * get GB/s  — the same values read back with `get_into_ptrs` (every byte checked once);
  * exists ms — one blocking batched presence check of --exists-keys keys (all hits).
Both clients are what the tier uses: `MemKVClient.codes` and `RedisBlockClient` (which adds
the per-value CRC-32 and the hash tags). Prints the median and the min-max spread per cell.

`--eviction` instead measures how often a lookup hit turns into a miss at load time under
eviction pressure: a writer thread keeps storing new values into a server whose memory is
--evict-memory-mb (memkv: --memory; Redis: maxmemory + allkeys-lru), while a reader probes
recently stored keys, waits --gap-ms (a scheduler step between lookup and load), and loads the
hits. memkv takes a lease on each hit (lease_ms), Redis refreshes the LRU clock (TOUCH) or not
(EXISTS).

    python benchmarks/redis_vs_memkv.py [--sizes 64K,1M] [--threads 4] [--rounds 5]
    python benchmarks/redis_vs_memkv.py --eviction [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402
from redis_procs import RedisCluster, RedisStandalone  # noqa: E402

from memkv_vllm.core.backends import make_client  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.interface import Status  # noqa: E402


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def transfer(client: object, keys: list[bytes], data: np.ndarray, threads: int, batch: int,
             put: bool) -> float:
    """GB/s of storing (or reading back) every row of `data` under `keys` with `threads` threads.
    Raises if any key fails or a read-back differs."""
    size = data.shape[1]
    out = data if put else np.zeros_like(data)
    fn: Callable = client.put_ptrs if put else client.get_into_ptrs  # type: ignore[attr-defined]
    errors: list[str] = []

    def work(t: int) -> None:
        for lo in range(t * batch, len(keys), threads * batch):
            hi = min(len(keys), lo + batch)
            st = fn(keys[lo:hi], [int(out[i].ctypes.data) for i in range(lo, hi)],
                    [size] * (hi - lo))
            if any(s != Status.OK for s in st):
                errors.append(f"{'put' if put else 'get'} statuses {sorted(set(st))}")

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    if not put and not (out == data).all():
        raise RuntimeError("read-back differs from what was stored")
    return data.nbytes / secs / 1e9


def exists_ms(client: object, keys: list[bytes], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        st = client.exists(keys)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
        assert all(s == Status.OK for s in st)
    return statistics.median(times) * 1e3


def compare(a: argparse.Namespace) -> None:
    srv = MemKVServer(memory=f"{max(512, 3 * a.mib)}M", lanes=2).start()
    cluster = RedisCluster(primaries=a.redis_primaries, replicas=a.redis_replicas)
    try:
        clients = {
            "memkv": make_client(load_config({"servers": [srv.address]}, env={})).codes,
            "redis-cluster": make_client(load_config(
                {"backend": "redis", "servers": cluster.urls}, env={})),
        }
        ekeys = [b"bench-exists/%06d" % i for i in range(a.exists_keys)]
        small = np.zeros((len(ekeys), 64), dtype=np.uint8)
        for c in clients.values():
            assert set(c.put_ptrs(ekeys, [int(small[i].ctypes.data) for i in range(len(ekeys))],
                                  [64] * len(ekeys))) == {Status.OK}
        res: dict[tuple[str, str, int], list[float]] = {}
        names = list(clients)
        for r in range(a.rounds):
            for size in a.sizes:
                n = max(1, (a.mib << 20) // size)
                data = np.random.default_rng(r).integers(0, 256, (n, size), dtype=np.uint8)
                for name in names[r % 2:] + names[:r % 2]:
                    keys = [f"bench/{r}/{size}/{i}".encode() for i in range(n)]
                    c = clients[name]
                    res.setdefault((name, "put", size), []).append(
                        transfer(c, keys, data, a.threads, a.batch, True))
                    res.setdefault((name, "get", size), []).append(
                        transfer(c, keys, data, a.threads, a.batch, False))
                    c.delete(keys)
            for name in names[r % 2:] + names[:r % 2]:
                res.setdefault((name, "exists", 0), []).append(
                    exists_ms(clients[name], ekeys, a.exists_calls))
        print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {a.rounds} "
              f"rounds, {a.mib} MiB per cell, {a.threads} threads, batches of {a.batch}; "
              f"memkv: 1 server (2 lanes); redis: {a.redis_primaries} primaries x "
              f"{a.redis_replicas} replicas")
        print("median (min-max) over rounds")
        print(f"{'value':>6} {'backend':>14} {'put GB/s':>22} {'get GB/s':>22}")
        for size in a.sizes:
            for name in names:
                print(f"{fmt_size(size):>6} {name:>14} {spread(res[(name, 'put', size)]):>22} "
                      f"{spread(res[(name, 'get', size)]):>22}")
        for name in names:
            print(f"exists of {len(ekeys)} keys, {name}: median of round medians "
                  f"{spread(res[(name, 'exists', 0)])} ms")
        for c in clients.values():
            c.close()
    finally:
        srv.kill()
        cluster.stop()


def eviction(a: argparse.Namespace) -> None:
    """Hit -> miss between lookup and load, under a writer that keeps the server full."""
    size = a.evict_value_kib << 10
    srv = MemKVServer(memory=f"{a.evict_memory_mb}M", lanes=2).start()
    red = RedisStandalone(extra=["--maxmemory", f"{a.evict_memory_mb}mb",
                                 "--maxmemory-policy", "allkeys-lru"])
    try:
        cases = [
            ("memkv, lease on hit", load_config({"servers": [srv.address]}, env={}), 2000),
            ("redis, TOUCH on hit", load_config({"backend": "redis", "servers": red.urls},
                                                env={}), 2000),
            ("redis, EXISTS", load_config({"backend": "redis", "servers": red.urls}, env={}), 0),
        ]
        print(f"\neviction pressure: {a.evict_memory_mb} MiB server memory, {a.evict_value_kib} "
              f"KiB values, writer at full speed, lookup -> load gap {a.gap_ms} ms, "
              f"{a.seconds} s per case")
        for name, cfg, lease in cases:
            hits, lost, wrong = measure_eviction(make_client(cfg).codes, size, lease, a)
            print(f"{name:>22}: {hits} lookup hits, {lost} turned into misses at load "
                  f"({100.0 * lost / max(1, hits):.2f}%), wrong bytes {wrong}")
    finally:
        srv.kill()
        red.stop()


def measure_eviction(c: object, size: int, lease_ms: int, a: argparse.Namespace
                     ) -> tuple[int, int, int]:
    stop = threading.Event()
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (64, size), dtype=np.uint8)
    written: list[int] = []  # indices of stored keys, in order

    def writer() -> None:
        i = 0
        while not stop.is_set():
            keys = [b"ev/%d" % (i + j) for j in range(8)]
            c.put_ptrs(keys, [int(pool[(i + j) % 64].ctypes.data) for j in range(8)],  # type: ignore[attr-defined]
                       [size] * 8)
            written.extend(range(i, i + 8))
            i += 8

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    hits = lost = wrong = 0
    buf = np.zeros((16, size), dtype=np.uint8)
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        if len(written) < 64:
            time.sleep(0.01)
            continue
        # Keys a little older than the newest: the ones an engine would look up.
        recent = written[-min(len(written), 4096):]
        idx = [recent[int(x)] for x in rng.integers(0, len(recent), 16)]
        keys = [b"ev/%d" % i for i in idx]
        st = c.exists(keys, lease_ms)  # type: ignore[attr-defined]
        hit = [k for k, s in zip(keys, st, strict=True) if Status.is_ok(s)]
        hit_idx = [i for i, s in zip(idx, st, strict=True) if Status.is_ok(s)]
        time.sleep(a.gap_ms / 1e3)
        if not hit:
            continue
        got = c.get_into_ptrs(hit, [int(buf[j].ctypes.data) for j in range(len(hit))],  # type: ignore[attr-defined]
                              [size] * len(hit))
        hits += len(hit)
        for j, (i, s) in enumerate(zip(hit_idx, got, strict=True)):
            if not Status.is_ok(s):
                lost += 1
            elif not (buf[j] == pool[i % 64]).all():
                wrong += 1
    stop.set()
    t.join(30)
    c.close()  # type: ignore[attr-defined]
    return hits, lost, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M",
                    type=lambda s: [parse_size(x) for x in s.split(",")])
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per cell and round")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--exists-keys", type=int, default=1000)
    ap.add_argument("--exists-calls", type=int, default=20)
    ap.add_argument("--redis-primaries", type=int, default=3)
    ap.add_argument("--redis-replicas", type=int, default=0)
    ap.add_argument("--eviction", action="store_true")
    ap.add_argument("--evict-memory-mb", type=int, default=64)
    ap.add_argument("--evict-value-kib", type=int, default=256)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    (eviction if a.eviction else compare)(a)


if __name__ == "__main__":
    main()
