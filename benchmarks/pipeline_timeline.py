"""Where a direct-mode job's time goes: one store and one load job through KVOffloader and a local
`memkv serve`, with the time of each stage of each batch since the job's submit.

The stages are read off the offloader's collaborators through their public methods (the mover's
ready marker, gather / scatter and the fences they return, the block store's submit and poll),
wrapped on the instances this script builds; next to
them, the same values moved by the native client alone (one blocking call, and the store's cut:
operations of `--blocks-per-op` values, `--io-threads` in flight, on one completion queue), and
the 8-connection loopback ceiling of the same bytes. Times in microseconds (us).

    python benchmarks/pipeline_timeline.py [--blocks 16] [--repeat 5] [--blocks-per-op 8]
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from memkv_procs import MemKVServer  # noqa: E402
from tcp_ceiling import gbps, tcp_ceiling  # noqa: E402

from memkv_vllm.core.client import MemKVClient  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.store import BlockStore, StoreOptions  # noqa: E402
from memkv_vllm.offload import Entry, KVOffloader, PagedKV  # noqa: E402


class Clock:
    """Events (name, thread, us since `start`), recorded from any thread."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.events: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self.t0 = time.perf_counter_ns()
            self.events = []

    def mark(self, what: str) -> None:
        t = (time.perf_counter_ns() - self.t0) / 1e3
        with self._lock:
            self.events.append((what, threading.current_thread().name, t))


class TimedFence:
    def __init__(self, fence: Any, clock: Clock, what: str) -> None:
        self._f, self._clock, self._what, self._seen = fence, clock, what, False

    def _passed(self) -> None:
        if not self._seen:
            self._seen = True
            self._clock.mark(self._what)

    def done(self) -> bool:
        d = self._f.done()
        if d:
            self._passed()
        return d

    def wait(self) -> None:
        self._f.wait()
        self._passed()


def instrument(mover: Any, store: BlockStore, clock: Clock) -> None:
    """Wrap the public methods of the offloader's mover and store."""
    counts: collections.Counter[str] = collections.Counter()

    def wrap_copy(name: str) -> None:
        fn = getattr(mover, name)

        def timed(*a: Any, **k: Any) -> Any:
            i = counts[name]
            counts[name] += 1
            clock.mark(f"{name}{i} launch")
            f = fn(*a, **k)
            clock.mark(f"{name}{i} launched")
            return TimedFence(f, clock, f"{name}{i} fence passed")
        setattr(mover, name, timed)

    wrap_copy("gather")
    wrap_copy("scatter")
    marker = mover.ready_marker

    def timed_marker() -> Any:
        clock.mark("ready_marker")
        m = marker()
        clock.mark("ready_marker done")
        return m
    mover.ready_marker = timed_marker

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            i = counts[label]
            counts[label] += 1
            clock.mark(f"{label}{i}")
            return fn(*a, **k)
        setattr(obj, name, timed)

    wrap(store, "submit_store", "store.submit_store")
    wrap(store, "submit_load", "store.submit_load")
    poll = store.poll

    def timed_poll() -> Any:
        out = poll()
        for c in out:
            clock.mark(f"store.poll -> job {c.job_id}")
        return out
    store.poll = timed_poll  # type: ignore[method-assign]


def show(title: str, clock: Clock, total_us: float, nbytes: int) -> None:
    print(f"\n{title}: {total_us:.0f} us, {gbps(nbytes, total_us / 1e6):.1f} GB/s")
    for what, thread, t in sorted(clock.events, key=lambda e: e[2]):
        print(f"  {t:8.0f}  {thread[:22]:22}  {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--blocks-per-op", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lanes", type=int, default=8)
    a = ap.parse_args()
    n = a.blocks
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv = PagedKV([torch.randn((2 * n, 2, 8, 16, 128), device=dev).to(torch.bfloat16)
                  for _ in range(32)])
    vb = kv.value_bytes[0]
    nb = n * vb
    srv = MemKVServer(memory="8G", lanes=a.lanes).start()
    try:
        cfg = load_config({"servers": [srv.address], "connections_per_server": a.conns,
                           "io_threads": a.io_threads, "transport": "tcp"})
        client = MemKVClient.from_config(cfg)
        io = client.codes
        store = BlockStore(io, StoreOptions(n_read_threads=a.io_threads,
                                            n_write_threads=a.io_threads,
                                            blocks_per_op=a.blocks_per_op))
        off = KVOffloader(kv, store, medium="host", scratch_bytes=n * (vb + 4096),
                          batch_values=a.batch)
        print(f"# {dev}, {n} blocks of {vb} B ({nb / 2**20:.0f} MiB), {a.conns} connections, "
              f"{a.io_threads} ops in flight, {a.blocks_per_op} values per op, {a.batch} per "
              f"batch; {off.describe()}")
        clock = Clock()
        instrument(off.mover, store, clock)
        ids = iter(range(1, 1 << 30))

        def job(load: bool, keys: list[bytes]) -> float:
            j = next(ids)
            clock.start()
            t0 = time.perf_counter()
            entries = [Entry(k, 0, (n + i if load else i,)) for i, k in enumerate(keys)]
            clock.mark("entries made")
            (off.submit_load if load else off.submit_store)(j, entries)
            clock.mark("submit returned")
            assert off.drain(60)
            clock.mark("drain returned")
            dt = time.perf_counter() - t0
            assert all(r.ok for r in off.poll())
            return dt * 1e6

        best: dict[bool, tuple[float, list]] = {}
        for r in range(a.repeat + 1):
            keys = [b"tl/%d/%d" % (r, i) for i in range(n)]
            for load in (False, True):
                us = job(load, keys)
                if r and (load not in best or us < best[load][0]):
                    best[load] = (us, list(clock.events))
        for load in (False, True):
            clock.events = best[load][1]
            show("load" if load else "store", clock, best[load][0], nb)
        off.close()

        # The native client alone, same bytes out of the same kind of memory.
        buf = torch.empty(nb, dtype=torch.uint8, pin_memory=dev == "cuda")
        ptrs = [buf.data_ptr() + i * vb for i in range(n)]
        keys = [b"nat/%d" % i for i in range(n)]
        times: dict[str, list[float]] = collections.defaultdict(list)
        q = io.completion_queue()
        for _ in range(a.repeat + 1):
            for what in ("put", "get"):
                fn = io.put_ptrs if what == "put" else io.get_into_ptrs
                t0 = time.perf_counter()
                fn(keys, ptrs, [vb] * n)
                times[f"one call {what}"].append(time.perf_counter() - t0)
            for what in ("put", "get"):
                sub = io.submit_put_ptrs if what == "put" else io.submit_get_into_ptrs
                step = a.blocks_per_op if a.batch >= a.blocks_per_op else a.batch
                cuts = [(i, min(n, i + step)) for i in range(0, n, step)]
                t0 = time.perf_counter()
                waiting = collections.deque(cuts)
                running = 0
                left = len(cuts)
                while waiting and running < a.io_threads:
                    lo, hi = waiting.popleft()
                    sub(keys[lo:hi], ptrs[lo:hi], [vb] * (hi - lo), q, lo)
                    running += 1
                while left:
                    for _tag in q.wait(None):
                        left -= 1
                        running -= 1
                        if waiting:
                            lo, hi = waiting.popleft()
                            sub(keys[lo:hi], ptrs[lo:hi], [vb] * (hi - lo), q, lo)
                            running += 1
                times[f"ops of {step}, {a.io_threads} in flight, {what}"].append(
                    time.perf_counter() - t0)
        print()
        for what, ts in times.items():
            t = min(ts[1:])
            print(f"native {what:34}: {t * 1e6:7.0f} us, {gbps(nb, t):5.1f} GB/s")
        for conns in (1, a.conns):
            t = tcp_ceiling(nb, a.repeat, conns)
            print(f"loopback TCP, {conns} connection(s), Python threads: {nb / t / 1e3:7.0f} us, "
                  f"{t:5.1f} GB/s")
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
