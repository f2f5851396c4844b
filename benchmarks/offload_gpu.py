"""Direct-mode offloader throughput on a CUDA host, next to the ceilings measured in the same run.

Prints, per layout, scratch medium and job size (blocks per job):
  * copy   — gather KV blocks into scratch and bring them to pinned host memory (store side), and
             the reverse (load side), through the offloader's mover alone, no network;
  * memkv  — a whole store job and a whole load job through KVOffloader and a local `memkv serve`;
and two ceilings: a pinned device<->host copy of the same bytes as one contiguous copy, and
loopback TCP between two threads of this process (one connection). Every figure is GB/s
(10^9 bytes/s) of value bytes, best of --repeat runs.

Layouts: `llama` = 32 layers x 8 KV heads x head_dim 128, bf16, 16-token blocks (2 MiB values),
`mla` = 61 layers x one 576-wide bf16 latent (1.1 MiB values).

    python benchmarks/offload_gpu.py [--blocks 16,64,256] [--repeat 5] [--mediums host,gpu]
"""

from __future__ import annotations

import argparse
import itertools
import socket
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.client import MemKVClient  # noqa: E402
from memkv_vllm.config import load_config  # noqa: E402
from memkv_vllm.offload import Entry, KVOffloader, PagedKV  # noqa: E402
from memkv_vllm.store import BlockStore, StoreOptions  # noqa: E402


def make_kv(layout: str, num_blocks: int) -> PagedKV:
    if layout == "llama":
        shape = (num_blocks, 2, 8, 16, 128)
        layers = 32
    else:
        shape, layers = (num_blocks, 16, 576), 61
    return PagedKV([torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(layers)])


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pinned_ceiling(nbytes: int, repeat: int) -> tuple[float, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    d2h(), h2d()
    return gbps(nbytes, best(d2h, repeat)), gbps(nbytes, best(h2d, repeat))


def tcp_ceiling(nbytes: int, repeat: int) -> float:
    """One loopback connection, a sender thread and a receiver thread, `nbytes` per run."""
    lsock = socket.create_server(("127.0.0.1", 0))
    snd = socket.create_connection(lsock.getsockname())
    rcv, _ = lsock.accept()
    for s in (snd, rcv):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = memoryview(bytearray(nbytes))
    dst = memoryview(bytearray(nbytes))

    def receive() -> None:
        got = 0
        while got < nbytes:
            got += rcv.recv_into(dst[got:], min(nbytes - got, 1 << 20))

    def once() -> None:
        t = threading.Thread(target=receive)
        t.start()
        snd.sendall(src)
        t.join()

    once()
    secs = best(once, repeat)
    for s in (snd, rcv, lsock):
        s.close()
    return gbps(nbytes, secs)


def offloader(address: str, kv: PagedKV, medium: str, n: int, method: str) -> KVOffloader:
    cfg = load_config({"servers": [address], "connections_per_server": 8, "io_threads": 8})
    store = BlockStore(MemKVClient.from_config(cfg).codes,
                       StoreOptions(n_read_threads=8, n_write_threads=8, blocks_per_op=1))
    name, _, programs = method.partition(":")
    return KVOffloader(kv, store, medium=medium, scratch_bytes=n * (kv.max_value_bytes + 4096),
                       batch_values=max(4, n // 8), copy_method=name,
                       copy_programs=int(programs or 32))


def copy_only(off: KVOffloader, n: int, repeat: int) -> tuple[float, float]:
    es = [Entry(b"%d" % i, 0, (i,)) for i in range(n)]
    slots = list(range(n))
    mover = off.mover

    def gather() -> None:
        mover.gather(es, slots, mover.ready_marker()).wait()

    def scatter() -> None:
        mover.scatter(es, slots, mover.ready_marker()).wait()

    gather(), scatter()
    nb = n * off.kv.value_bytes[0]
    return gbps(nb, best(gather, repeat)), gbps(nb, best(scatter, repeat))


def through_memkv(off: KVOffloader, n: int, repeat: int, tag: str) -> tuple[float, float]:
    job = iter(range(1, 1 << 30))
    last: list[Entry] = []

    def store() -> None:
        j = next(job)  # new keys every run: a key already stored would be skipped
        last[:] = [Entry(b"%s/%d/%d" % (tag.encode(), j, i), 0, (i,)) for i in range(n)]
        off.submit_store(j, last)
        assert off.drain(60)
        assert all(r.ok for r in off.poll()), "store failed"

    def load() -> None:
        off.submit_load(next(job), [Entry(e.key, 0, (n + i,)) for i, e in enumerate(last)])
        assert off.drain(60)
        assert all(r.ok for r in off.poll()), "load failed"

    store(), load()
    nb = n * off.kv.value_bytes[0]
    return gbps(nb, best(store, repeat)), gbps(nb, best(load, repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mediums", default="host,gpu")
    ap.add_argument("--methods", default="kernel:32,dma",
                    help="piece copies: kernel[:programs] (Triton) or dma (cuMemcpyBatchAsync)")
    ap.add_argument("--layouts", default="llama,mla")
    ap.add_argument("--memory", default="16G", help="memkv serve --memory")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    srv = MemKVServer(memory=a.memory, lanes=8).start()
    try:
        print(f"{'layout':6} {'medium':6} {'method':9} {'blocks':>6} {'MiB':>6} | {'pin D2H':>7} "
              f"{'pin H2D':>7} {'TCP':>6} | {'gather':>7} {'%':>4} {'scatter':>7} {'%':>4} | "
              f"{'store':>6} {'load':>6} {'%min':>5}")
        for layout in a.layouts.split(","):
            kv = make_kv(layout, 2 * max(sizes))
            vb = kv.value_bytes[0]
            for medium, method, n in itertools.product(a.mediums.split(","),
                                                       a.methods.split(","), sizes):
                nb = n * vb
                d2h, h2d = pinned_ceiling(nb, a.repeat)
                tcp = tcp_ceiling(nb, a.repeat)
                off = offloader(srv.address, kv, medium, n, method)
                g, s = copy_only(off, n, a.repeat)
                st, ld = through_memkv(off, n, a.repeat, f"{layout}{medium}{method}{n}")
                off.close()
                floor = min(d2h, h2d, tcp)
                print(f"{layout:6} {medium:6} {method:9} {n:>6} {nb / 2**20:>6.0f} | {d2h:>7.1f} "
                      f"{h2d:>7.1f} {tcp:>6.1f} | {g:>7.1f} {100 * g / d2h:>4.0f} "
                      f"{s:>7.1f} {100 * s / h2d:>4.0f} | {st:>6.1f} {ld:>6.1f} "
                      f"{100 * min(st, ld) / floor:>5.0f}", flush=True)
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
