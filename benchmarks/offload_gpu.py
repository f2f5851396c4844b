"""Direct-mode offloader throughput on a CUDA host, next to the ceilings measured in the same run.

Prints, per layout, scratch medium and job size (blocks per job):
  * copy   — gather KV blocks into scratch and bring them to pinned host memory (store side), and
             the reverse (load side), through the offloader's mover alone, no network: one job
             (submit to its CUDA event), then --stream jobs submitted back to back (S columns);
  * memkv  — a whole store job and a whole load job through KVOffloader and a local `memkv serve`,
             submit to drain: one job, then --stream jobs submitted together (S columns), over
             --transport (tcp, or shm: the same-host path); load1 is the first load, whose
             connections and mappings are fresh, as in an engine after a restart;
and the ceilings: a pinned device<->host copy of the same bytes as one contiguous copy, and
loopback TCP between threads of this process, over one connection (a sender and a receiver
thread) and over --conns connections (the client's connection count; %min uses this one, the
smaller of it and the pinned copy). Every figure is GB/s (10^9 bytes/s) of value bytes, best of
--repeat runs. %H2D is the streamed load as a share of the pinned host-to-device copy: the
ceiling of loads in place (a server started with `--server-args --shm-share-values` and
`--transport shm`: the GPU copies straight out of the server's memory; the first `#` line says
whether the offloader uses them).

scatM is the mover alone copying --stream jobs straight out of a memfd mapped read-only and
registered with CUDA, as loads in place read a server's lanes (the network-free ceiling of those
loads; host scratch only); --mapped VALUES:MIB:IN_FLIGHT,... streams the loads once more per cut
of the offloader's in-place batches (`MappedBatches`), to tune it.

Layouts: `llama` = 32 layers x 8 KV heads x head_dim 128, bf16, 16-token blocks (2 MiB values),
`mla` = 61 layers x one 576-wide bf16 latent (1.1 MiB values).

    python benchmarks/offload_gpu.py [--blocks 16,64,256] [--repeat 5] [--mediums host,gpu]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import mmap
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402
from tcp_ceiling import best, gbps, tcp_ceiling  # noqa: E402

from memkv_vllm.core.client import MemKVClient  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402
from memkv_vllm.core.store import BlockStore, StoreOptions  # noqa: E402
from memkv_vllm.direct.options import DirectOptions  # noqa: E402
from memkv_vllm.offload import Entry, KVOffloader, MappedBatches, PagedKV  # noqa: E402


def make_kv(layout: str, num_blocks: int) -> PagedKV:
    if layout == "llama":
        shape = (num_blocks, 2, 8, 16, 128)
        layers = 32
    else:
        shape, layers = (num_blocks, 16, 576), 61
    return PagedKV([torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(layers)])


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


def parse_cut(text: str) -> MappedBatches:
    """VALUES:MIB:IN_FLIGHT, e.g. 16:64:8 (the offloader's default)."""
    values, mib, in_flight = (int(x) for x in text.split(":"))
    return MappedBatches(values, mib << 20, in_flight)


def offloader(address: str, kv: PagedKV, medium: str, n: int, method: str,
              a: argparse.Namespace, cut: MappedBatches | None = None) -> KVOffloader:
    cfg = load_config({"servers": [address], "connections_per_server": a.conns,
                       "io_threads": a.io_threads, "transport": a.transport})
    store = BlockStore(MemKVClient.from_config(cfg).codes,
                       StoreOptions(n_read_threads=a.io_threads, n_write_threads=a.io_threads,
                                    blocks_per_op=a.blocks_per_op))
    name, _, programs = method.partition(":")
    scratch = a.scratch_mib << 20 if a.scratch_mib else n * (kv.max_value_bytes + 4096)
    return KVOffloader(kv, store, medium=medium, scratch_bytes=scratch,
                       batch_values=a.batch, copy_method=name, copy_programs=int(programs or 32),
                       mapped_batches=cut)


def spin(fence) -> None:
    """The benchmark's own wait: spinning sees the end of a copy at once (the offloader's copy
    thread sleeps in the driver instead, which wakes it a little later)."""
    while not fence.done():
        pass


def copy_only(off: KVOffloader, n: int, repeat: int, stream: int) -> tuple[float, ...]:
    """Gather and scatter GB/s of one job, then of `stream` jobs submitted back to back; and the
    host's time to submit one gather (ready marker + gather call), in microseconds."""
    es = [Entry(b"%d" % i, 0, (i,)) for i in range(n)]
    slots = list(range(n))
    mover = off.mover
    submit: list[float] = []

    def gather(jobs: int = 1) -> None:
        t0 = time.perf_counter()
        for _ in range(jobs):
            f = mover.gather(es, slots, mover.ready_marker())
        submit.append((time.perf_counter() - t0) / jobs)
        spin(f)

    def scatter(jobs: int = 1) -> None:
        for _ in range(jobs):
            f = mover.scatter(es, slots, mover.ready_marker())
        spin(f)

    gather(), scatter()
    nb = n * off.kv.value_bytes[0]
    one = gbps(nb, best(gather, repeat))
    us = 1e6 * min(submit[1:])
    return (one, gbps(nb, best(scatter, repeat)),
            gbps(stream * nb, best(lambda: gather(stream), repeat)),
            gbps(stream * nb, best(lambda: scatter(stream), repeat)), us)


def scatter_shared(off: KVOffloader, n: int, repeat: int, stream: int) -> float:
    """The ceiling of loads in place without the network: `stream` scatters of `n` values each,
    back to back, straight out of a memfd mapped read-only and registered with CUDA as the
    offloader registers a server's lanes (GB/s of value bytes)."""
    vb = off.kv.value_bytes[0]
    nbytes = n * vb
    fd = os.memfd_create("offload-gpu-shared")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as w:  # fill it through a writable map of its own
            w.write(os.urandom(1 << 20) * (nbytes >> 20))
        addr = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the shared values failed")
        mover = off.mover
        mover.register_host(addr, nbytes)
        try:
            es = [Entry(b"%d" % i, 0, (i,)) for i in range(n)]
            addrs = [addr + i * vb for i in range(n)]

            def scatter() -> None:
                for _ in range(stream):
                    f = mover.scatter_from(es, addrs, mover.ready_marker())
                spin(f)

            scatter()
            return gbps(stream * nbytes, best(scatter, repeat))
        finally:
            mover.unregister_host(addr, nbytes)
            libc.munmap(addr, nbytes)
    finally:
        os.close(fd)


def through_memkv(off: KVOffloader, n: int, repeat: int, tag: str, jobs: int
                  ) -> tuple[float, float, float]:
    """Store and load GB/s of `jobs` jobs of `n` blocks submitted together, submit to drain; and
    the first load's GB/s (what a restarted engine sees: fresh connections and mappings)."""
    ids = iter(range(1, 1 << 30))
    last: list[Entry] = []

    def store() -> None:
        for _ in range(jobs):
            j = next(ids)  # new keys every job: a key already stored would be skipped
            last[:] = [Entry(b"%s/%d/%d" % (tag.encode(), j, i), 0, (i,)) for i in range(n)]
            off.submit_store(j, last)
        assert off.drain(60)
        assert all(r.ok for r in off.poll()), "store failed"

    def load() -> None:
        for _ in range(jobs):
            off.submit_load(next(ids), [Entry(e.key, 0, (n + i,)) for i, e in enumerate(last)])
        assert off.drain(60)
        assert all(r.ok for r in off.poll()), "load failed"

    store()
    t0 = time.perf_counter()
    load()
    first = time.perf_counter() - t0
    nb = jobs * n * off.kv.value_bytes[0]
    return gbps(nb, best(store, repeat)), gbps(nb, best(load, repeat)), nb / first / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mediums", default="host,gpu")
    ap.add_argument("--methods", default="kernel:32,dma",
                    help="piece copies: kernel[:programs] (Triton) or dma (cuMemcpyBatchAsync)")
    ap.add_argument("--layouts", default="llama,mla")
    ap.add_argument("--memory", default="32G", help="memkv serve --memory")
    ap.add_argument("--conns", type=int, default=8,
                    help="client connections, and connections of the multi-connection TCP ceiling")
    ap.add_argument("--io-threads", type=int, default=8,
                    help="BlockStore I/O threads per direction")
    ap.add_argument("--batch", type=int, default=4, help="KVOffloader batch_values")
    ap.add_argument("--blocks-per-op", type=int, default=1,
                    help="BlockStore blocks_per_op: values per client operation (direct mode "
                         "in an engine: 8, with 4 operations in flight: --io-threads 4)")
    ap.add_argument("--stream", type=int, default=8, help="jobs per streamed run")
    ap.add_argument("--scratch-mib", type=int, default=DirectOptions().scratch_bytes >> 20,
                    help="the offloader's scratch (default: direct mode's in an engine); 0: "
                         "one job's values, so streamed jobs wait for each other's slots")
    ap.add_argument("--lanes", type=int, default=8, help="memkv serve --lanes")
    ap.add_argument("--server-args", default="",
                    help="more memkv serve arguments, e.g. '--shm-copy-threads 1'")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm", "auto"],
                    help="the client's transport (shm: the same-host path)")
    ap.add_argument("--mapped", default="",
                    help="loads in place: also stream loads with these cuts of the offloader's "
                         "batches, VALUES:MIB:IN_FLIGHT[,...] (default cut 16:64:8)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.conns} "
          f"connections, {a.io_threads} I/O threads, {a.batch} values per batch, "
          f"{a.blocks_per_op} values per operation, "
          f"{a.stream} jobs per stream, scratch "
          f"{f'{a.scratch_mib} MiB' if a.scratch_mib else 'one job'}, server lanes {a.lanes}, "
          f"transport {a.transport}, "
          f"server args {a.server_args or '-'}")
    srv = MemKVServer(memory=a.memory, lanes=a.lanes, extra=shlex.split(a.server_args)).start()
    try:
        print(f"{'layout':6} {'medium':6} {'method':9} {'blocks':>6} {'MiB':>5} | {'pinD2H':>6} "
              f"{'pinH2D':>6} {'TCP1':>5} {'TCP' + str(a.conns):>5} | {'gather':>6} {'%':>3} "
              f"{'scat':>5} {'%':>3} {'subus':>5} | {'gathS':>5} {'%':>3} {'scatS':>5} {'%':>3} | "
              f"{'store':>5} {'load':>5} {'%min':>4} {'load1':>5} | {'storeS':>6} {'loadS':>5} "
              f"{'%min':>4} {'%H2D':>4} | {'scatM':>5} {'%':>3}")
        for layout in a.layouts.split(","):
            kv = make_kv(layout, 2 * max(sizes))
            vb = kv.value_bytes[0]
            for medium, method, n in itertools.product(a.mediums.split(","),
                                                       a.methods.split(","), sizes):
                nb = n * vb
                d2h, h2d = pinned_ceiling(nb, a.repeat)
                tcp1 = tcp_ceiling(nb, a.repeat, 1)
                tcpn = tcp_ceiling(nb, a.repeat, a.conns)
                off = offloader(srv.address, kv, medium, n, method, a)
                if n == sizes[0]:
                    print(f"# {off.describe()}", flush=True)
                g, s, gs, ss, us = copy_only(off, n, a.repeat, a.stream)
                sm = scatter_shared(off, n, a.repeat, a.stream) if medium == "host" else 0.0
                tag = f"{layout}{medium}{method}{n}"
                st, ld, ld1 = through_memkv(off, n, a.repeat, tag, 1)
                sts, lds, _ = through_memkv(off, n, a.repeat, tag + "s", a.stream)
                off.close()
                cuts = []
                for text in filter(None, a.mapped.split(",")):
                    o = offloader(srv.address, kv, medium, n, method, a, parse_cut(text))
                    if o.mapped:
                        cuts.append((text, *through_memkv(o, n, a.repeat, tag + text, a.stream)))
                    o.close()
                floor = min(d2h, h2d, tcpn)
                print(f"{layout:6} {medium:6} {method:9} {n:>6} {nb / 2**20:>5.0f} | {d2h:>6.1f} "
                      f"{h2d:>6.1f} {tcp1:>5.1f} {tcpn:>5.1f} | {g:>6.1f} {100 * g / d2h:>3.0f} "
                      f"{s:>5.1f} {100 * s / h2d:>3.0f} {us:>5.0f} | "
                      f"{gs:>5.1f} {100 * gs / d2h:>3.0f} {ss:>5.1f} {100 * ss / h2d:>3.0f} | "
                      f"{st:>5.1f} {ld:>5.1f} "
                      f"{100 * min(st, ld) / floor:>4.0f} {ld1:>5.1f} | {sts:>6.1f} {lds:>5.1f} "
                      f"{100 * min(sts, lds) / floor:>4.0f} {100 * lds / h2d:>4.0f} | "
                      f"{sm:>5.1f} {100 * sm / h2d:>3.0f}", flush=True)
                for text, _, cut_load, _ in cuts:
                    print(f"#   in place, batches cut {text}: {a.stream} loads streamed "
                          f"{cut_load:.1f} GB/s, {100 * cut_load / h2d:.0f}% of pinned H2D",
                          flush=True)
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
