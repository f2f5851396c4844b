#!/usr/bin/env python3
"""memkv against Mooncake Store and Redis: same values, same client threads, one run, loopback.

For each value size and thread count, every round measures each store once, back to back
(memkv, Mooncake, Redis, their order rotated per round), so a noisy neighbour hits all of them
alike; the table gives the median over rounds and the range. Each client thread overwrites its
own 4 keys round-robin, one value per request, from/into caller memory:

  memkv    `memkv serve` (this checkout), Python client `put_ptrs` / `get_into_ptrs`
  mooncake Mooncake Store over TCP: `mooncake_master` (HTTP metadata server embedded) and a
           `mooncake_client` storage process holding the memory; this process is a client
           without memory of its own, zero-copy `batch_upsert_from` / `batch_get_into` on
           registered buffers
  redis    Debian's `redis-server` (`--save "" --appendonly no`), redis-py SET / GET (GET
           copies the reply into the caller's buffer, as a cache client must)

Bytes are verified: after each timed GET phase every thread's buffers (the last value each of
its keys returned) are compared with what was PUT, outside the clock; a mismatch aborts.
The batched existence check asks for 1,000 keys (half present) in one call: memkv through the
Python client (`MemKVClient.exists`) and through its native call alone, Mooncake's
`batch_is_exist`, a Redis pipeline of 1,000 EXISTS; the median of --exists-calls calls.

Getting the peers (Debian/Ubuntu; nothing here touches a shared environment):

  apt-get install redis-server libibverbs1 librdmacm1   # Mooncake's library loads libibverbs
                                                        # even for TCP
  python3 -m venv .venv-peers
  .venv-peers/bin/pip install mooncake-transfer-engine-non-cuda redis numpy pyyaml matplotlib
  # memkv's Python module comes from this checkout (its extension built: maturin develop):
  .venv-peers/bin/python benchmarks/vs_peers.py \
      [--sizes 1M,4M,16M,64M] [--threads 1,2,4] [--volume 512M] [--rounds 3] [--json out.json]

Every server it starts (memkv serve; mooncake_master, mooncake_client and redis-server each in
its own process group) listens on 127.0.0.1 and is stopped before it exits;
MC_TCP_BIND_ADDRESS=127.0.0.1 keeps Mooncake's transfer engine on loopback. --plot needs
matplotlib in the same environment.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# Child processes (memkv serve via `python -m memkv_vllm.cli`, vLLM) import this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
KEYS_PER_THREAD = 4
SYSTEMS = ("memkv", "mooncake", "redis")


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


class Procs:
    """Processes started here, each in its own process group; stop() ends them all."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        log = (self.logdir / f"{name}.log").open("w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(env or {})})
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.procs.clear()


# -- the three stores behind one interface: put(tid, i) / get(tid, i) of a thread's i-th key --


class Store:
    name = ""

    def prepare(self, size: int, threads: int, src: list[list[np.ndarray]],
                dst: list[list[np.ndarray]]) -> None:
        """Bind the caller buffers of this size/thread point (before any clock starts)."""
        self.size, self.src, self.dst = size, src, dst

    def key(self, tid: int, i: int) -> str:
        return f"bench/{self.size}/{tid}/{i}"

    def put(self, tid: int, i: int) -> None:
        raise NotImplementedError

    def get(self, tid: int, i: int) -> None:
        raise NotImplementedError

    def exists(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemKV(Store):
    name = "memkv"

    def __init__(self, procs: Procs, memory: str) -> None:
        from memkv_procs import MemKVServer

        from memkv_vllm.core.client import MemKVClient, Status
        from memkv_vllm.core.config import load_config

        self.server = MemKVServer(memory=memory, lanes=2).start()
        cfg = load_config(overrides={"servers": [self.server.address]})
        self.client = MemKVClient(cfg)
        self.ok = Status.OK

    def put(self, tid: int, i: int) -> None:
        b = self.src[tid][i]
        (s,) = self.client.put_ptrs([self.key(tid, i).encode()], [b.ctypes.data], [b.nbytes])
        if s != self.ok:
            raise RuntimeError(f"memkv put: {s!r}")

    def get(self, tid: int, i: int) -> None:
        b = self.dst[tid][i]
        (s,) = self.client.get_into_ptrs([self.key(tid, i).encode()], [b.ctypes.data],
                                         [b.nbytes])
        if s != self.ok:
            raise RuntimeError(f"memkv get: {s!r}")

    def exists(self, keys: list[str]) -> list[bool]:
        return [s == self.ok for s in self.client.exists([k.encode() for k in keys])]

    def exists_native(self, keys: list[bytes]) -> object:
        return self.client._c.exists(keys, 0)  # the extension's call, without the wrapper

    def close(self) -> None:
        self.client.close()
        self.server.kill()


SHM = Path("/dev/shm")
LOCAL_BUFFER = 16 << 20  # Mooncake client's local buffer (bytes)


class Mooncake(Store):
    name = "mooncake"

    def __init__(self, procs: Procs, memory: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        bindir = Path(sys.executable).parent
        rpc, http = free_port(), free_port()
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        os.environ.update(env)
        master = procs.start("mooncake_master", [
            str(bindir / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--eviction_high_watermark_ratio=0.95"], env)
        wait_port(rpc, master, "mooncake_master")
        wait_port(http, master, "mooncake_master's metadata server")
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        self.master = f"127.0.0.1:{rpc}"
        storage_port = free_port()
        storage = procs.start("mooncake_client", [
            str(bindir / "mooncake_client"), "--host=127.0.0.1", f"--port={storage_port}",
            f"--global_segment_size={memory}B", f"--metadata_server={self.metadata}",
            f"--master_server_address={self.master}", "--protocol=tcp"], env)
        wait_port(storage_port, storage, "mooncake_client (storage)")
        self.store = MooncakeDistributedStore()
        shm_before = set(os.listdir(SHM))
        rc = self.store.setup("127.0.0.1", self.metadata, 0, LOCAL_BUFFER, "tcp", "", self.master)
        # The client maps its local buffer from a /dev/shm file that close() leaves behind.
        self.shm = [SHM / n for n in set(os.listdir(SHM)) - shm_before
                    if (SHM / n).stat().st_size == LOCAL_BUFFER]
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed ({rc})")
        self.registered: list[int] = []

    def prepare(self, size, threads, src, dst) -> None:  # type: ignore[no-untyped-def]
        super().prepare(size, threads, src, dst)
        for bufs in (*src, *dst):
            for b in bufs:
                if b.ctypes.data not in self.registered:
                    if self.store.register_buffer(b.ctypes.data, b.nbytes) != 0:
                        raise RuntimeError("Mooncake register_buffer failed")
                    self.registered.append(b.ctypes.data)

    def release(self) -> None:
        for p in self.registered:
            self.store.unregister_buffer(p)
        self.registered.clear()

    def put(self, tid: int, i: int) -> None:
        b = self.src[tid][i]
        (rc,) = self.store.batch_upsert_from([self.key(tid, i)], [b.ctypes.data], [b.nbytes])
        if rc != 0:
            raise RuntimeError(f"Mooncake upsert: {rc}")

    def get(self, tid: int, i: int) -> None:
        b = self.dst[tid][i]
        (n,) = self.store.batch_get_into([self.key(tid, i)], [b.ctypes.data], [b.nbytes])
        if n != b.nbytes:
            raise RuntimeError(f"Mooncake get: {n}")

    def exists(self, keys: list[str]) -> list[bool]:
        return [r == 1 for r in self.store.batch_is_exist(keys)]

    def close(self) -> None:
        self.release()
        self.store.close()
        for f in self.shm:
            f.unlink(missing_ok=True)


class Redis(Store):
    name = "redis"

    def __init__(self, procs: Procs, memory: str) -> None:
        import redis

        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        port = free_port()
        p = procs.start("redis-server", [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--maxmemory", memory.replace("G", "gb").replace("M", "mb"),
            "--maxmemory-policy", "allkeys-lru",  # a cache that evicts, as memkv and Mooncake do
            "--proto-max-bulk-len", "1gb", "--protected-mode", "yes"])
        wait_port(port, p, "redis-server")
        self.pool = redis.ConnectionPool(host="127.0.0.1", port=port)
        self._r = redis.Redis(connection_pool=self.pool)  # thread-safe: a connection per call

    def put(self, tid: int, i: int) -> None:
        self._r.set(self.key(tid, i), memoryview(self.src[tid][i]))

    def get(self, tid: int, i: int) -> None:
        v = self._r.get(self.key(tid, i))
        b = self.dst[tid][i]
        if v is None or len(v) != b.nbytes:
            raise RuntimeError("Redis get: missing or short value")
        ctypes.memmove(b.ctypes.data, v, b.nbytes)

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(x) for x in pipe.execute()]

    def close(self) -> None:
        self.pool.disconnect()


# -- measurement --


def run_threads(threads: int, fn: Callable[[int], None]) -> float:
    """Run fn(tid) on `threads` threads released together; wall seconds."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def body(tid: int) -> None:
        barrier.wait()
        try:
            fn(tid)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def measure(store: Store, threads: int, ops: int) -> tuple[float, float]:
    """(put GB/s, get GB/s) for `ops` values per thread; gets verified after the clock."""
    size = store.size

    def puts(tid: int) -> None:
        for n in range(ops):
            store.put(tid, n % KEYS_PER_THREAD)

    def gets(tid: int) -> None:
        for n in range(ops):
            store.get(tid, n % KEYS_PER_THREAD)

    total = threads * ops * size
    put_s = run_threads(threads, puts)
    for tid in range(threads):
        for b in store.dst[tid]:
            b[:] = 0
    get_s = run_threads(threads, gets)
    for tid in range(threads):
        for i in range(min(ops, KEYS_PER_THREAD)):
            if not np.array_equal(store.dst[tid][i], store.src[tid][i]):
                raise RuntimeError(f"{store.name}: wrong bytes for thread {tid} key {i}")
    return total / put_s / 1e9, total / get_s / 1e9


def exists_latency(store: Store, calls: int) -> float:
    """Median seconds of a batched existence check of 1,000 keys, half of them present."""
    present = [store.key(t, i) for t in range(len(store.src)) for i in range(KEYS_PER_THREAD)]
    keys = (present * 500)[:500] + [f"absent/{n}" for n in range(500)]
    want = [True] * 500 + [False] * 500
    if store.exists(keys) != want:
        raise RuntimeError(f"{store.name}: wrong existence answers")
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        store.exists(keys)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--volume", default="512M", help="bytes moved per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", default="2G", help="memory of each store")
    ap.add_argument("--exists-calls", type=int, default=51)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="", help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    volume = parse_size(args.volume)
    names = [s for s in SYSTEMS if s in args.systems.split(",")]
    mem_bytes = parse_size(args.memory)
    if max(thread_counts) * KEYS_PER_THREAD * max(sizes) > mem_bytes // 2:
        sys.exit("--memory is too small for the largest size x threads x 4 keys")

    # SIGTERM unwinds through the finally block below, which stops every server started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="vs-peers-") as tmp:
        procs = Procs(Path(tmp))
        stores: dict[str, Store] = {}
        try:
            ctor = {"memkv": MemKV, "mooncake": Mooncake, "redis": Redis}
            for n in names:
                stores[n] = ctor[n](procs, args.memory)
            rows = run_points(stores, sizes, thread_counts, volume, args.rounds)
            ex = {n: exists_latency(s, args.exists_calls) for n, s in stores.items()}
            if "memkv" in stores:
                m = stores["memkv"]
                assert isinstance(m, MemKV)
                keys = [f"absent/{i}".encode() for i in range(1000)]
                times = []
                for _ in range(args.exists_calls):
                    t0 = time.perf_counter()
                    m.exists_native(keys)
                    times.append(time.perf_counter() - t0)
                ex["memkv native call"] = statistics.median(times)
        finally:
            for s in stores.values():
                try:
                    s.close()
                except Exception as e:  # noqa: BLE001 (shutdown continues)
                    print(f"closing {s.name}: {e}", file=sys.stderr)
            procs.stop()
    print_report(rows, ex, names, args)
    if args.plot:
        plot(rows, names, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "exists_s": ex},
                                              indent=1))
    return 0


def run_points(stores: dict[str, Store], sizes: list[int], thread_counts: list[int],
               volume: int, rounds: int) -> list[dict]:
    rows = []
    for size in sizes:
        for threads in thread_counts:
            rng = np.random.default_rng(size + threads)
            src = [[rng.integers(0, 256, size, dtype=np.uint8) for _ in range(KEYS_PER_THREAD)]
                   for _ in range(threads)]
            dst = [[np.zeros(size, np.uint8) for _ in range(KEYS_PER_THREAD)]
                   for _ in range(threads)]
            for s in stores.values():
                s.prepare(size, threads, src, dst)
            ops = max(KEYS_PER_THREAD, volume // (size * threads))
            res: dict[str, list[tuple[float, float]]] = {n: [] for n in stores}
            order = list(stores)
            for r in range(rounds):
                k = r % len(order)
                for n in order[k:] + order[:k]:
                    res[n].append(measure(stores[n], threads, ops))
            for s in stores.values():
                if isinstance(s, Mooncake):
                    s.release()
            row: dict = {"size": size, "threads": threads}
            for n, v in res.items():
                for j, op in enumerate(("put", "get")):
                    xs = [x[j] for x in v]
                    row[f"{n}_{op}"] = [statistics.median(xs), min(xs), max(xs)]
            rows.append(row)
            print(" ".join([f"{fmt_size(size):>7} x{threads}"] + [
                f"{n} put {row[f'{n}_put'][0]:.2f} get {row[f'{n}_get'][0]:.2f}" for n in res]),
                flush=True)
    return rows


def print_report(rows: list[dict], ex: dict[str, float], names: list[str],
                 args: argparse.Namespace) -> None:
    print(f"\nGB/s (1e9 B/s), median of {args.rounds} interleaved rounds (min-max); "
          f"{args.volume} per measurement")
    head = ["value", "thr"] + [f"{n} {op}" for op in ("put", "get") for n in names]
    print(" | ".join(head))
    for row in rows:
        cells = [fmt_size(row["size"]), str(row["threads"])]
        for op in ("put", "get"):
            for n in names:
                m, lo, hi = row[f"{n}_{op}"]
                cells.append(f"{m:.2f} ({lo:.2f}-{hi:.2f})")
        print(" | ".join(cells))
    if "memkv" in names:
        for n in names[1:]:
            worst = min(row[f"memkv_{op}"][0] / row[f"{n}_{op}"][0]
                        for row in rows for op in ("put", "get"))
            print(f"memkv / {n}: lowest ratio over all put/get cells {worst:.2f}x")
    print(f"\nbatched existence check of 1,000 keys, median of {args.exists_calls} calls:")
    for n, s in ex.items():
        print(f"  {n:18s} {s * 1e6:8.0f} us")


def plot(rows: list[dict], names: list[str], args: argparse.Namespace) -> None:
    from memkv_vllm.plots import pyplot

    try:
        plt = pyplot()
    except SystemExit as e:  # the measurements are printed already: say why there is no chart
        print(f"no plot from {sys.executable}: {e}")
        return
    labels = [f"{fmt_size(r['size'])} x{r['threads']}" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(rows) * 0.9), 6), sharex=True)
    width = 0.8 / len(names)
    for ax, op in zip(axes, ("put", "get"), strict=True):
        for j, n in enumerate(names):
            med = [r[f"{n}_{op}"][0] for r in rows]
            err = [[m - r[f"{n}_{op}"][1] for m, r in zip(med, rows, strict=True)],
                   [r[f"{n}_{op}"][2] - m for m, r in zip(med, rows, strict=True)]]
            ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))], med,
                   width, yerr=err, capsize=2, label=n)
        ax.set_ylabel(f"{op} GB/s")
        ax.legend(fontsize=8)
    axes[1].set_xticks(range(len(rows)), labels, rotation=45, fontsize=8)
    fig.suptitle(f"value size x client threads; median of {args.rounds} interleaved rounds, "
                 "bars min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
