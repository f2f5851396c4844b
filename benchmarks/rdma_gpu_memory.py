"""PUT and GET throughput of one client against a memkv server on the same host, by where the
values live and how they move: GPU memory over libfabric's shm provider (the server reads and
writes the client's CUDA memory: FI_HMEM, which needs a libfabric built with CUDA), pinned and
pageable host memory over shm, and host memory over memkv's TCP path.

    LD_LIBRARY_PATH=<libfabric built --with-cuda>/lib:$LD_LIBRARY_PATH \\
        python benchmarks/rdma_gpu_memory.py [--values 64] [--size 4M]

One line per case: the best of `--repeat` rounds of one batch of `--values` values; every round's
bytes are checked. A case whose transport does not reach its memory is reported, not run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.core.client import MemKVClient  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def case(label: str, provider: str | None, memory: str, a: argparse.Namespace) -> None:
    saved = dict(os.environ)
    if provider:
        os.environ.update(MEMKV_RDMA="true", MEMKV_RDMA_PROVIDER=provider)
        os.environ.pop("MEMKV_RDMA_DEVICES", None)
    else:
        os.environ.pop("MEMKV_RDMA", None)
    srv = MemKVServer(memory=a.server_memory).start()
    try:
        c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="rdma" if provider else "tcp",
                                    connections_per_server=a.connections), gpu_memory=True)
        if memory == "cuda" and not c.gpu_memory()[0]:
            print(f"{label:36s} not run: {c.gpu_memory()[1]}", flush=True)
            return
        shape = (a.values, a.size)
        src = torch.randint(0, 256, shape, dtype=torch.uint8,
                            device="cuda" if memory == "cuda" else "cpu")
        dst = torch.zeros_like(src)
        if memory == "pinned":
            src, dst = src.pin_memory(), dst.pin_memory()
        for buf in (src, dst):  # one registration per region, as the offloader does
            c.register_buffer(buf.data_ptr(), buf.numel())
        keys = [b"bench/%d" % i for i in range(a.values)]
        sp = [src.data_ptr() + i * a.size for i in range(a.values)]
        dp = [dst.data_ptr() + i * a.size for i in range(a.values)]
        best = {"put": float("inf"), "get": float("inf")}
        for _ in range(a.repeat):
            dst.zero_()
            for op, ptrs in (("put", sp), ("get", dp)):
                call = c.codes.put_ptrs if op == "put" else c.codes.get_into_ptrs
                t = time.perf_counter()
                st = call(keys, ptrs, [a.size] * a.values)
                best[op] = min(best[op], time.perf_counter() - t)
                assert set(st) == {0}, f"{op}: statuses {set(st)}"
            assert torch.equal(src, dst), "GET returned other bytes"
        gb = a.values * a.size / 1e9
        print(f"{label:36s} put {gb / best['put']:6.2f} GB/s  get {gb / best['get']:6.2f} GB/s",
              flush=True)
        for buf in (src, dst):
            c.unregister_buffer(buf.data_ptr())
        c.close()
    finally:
        srv.kill()
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=int, default=64)
    p.add_argument("--size", type=size, default=4 << 20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--server-memory", default="2G")
    a = p.parse_args()
    print(f"{a.values} values of {a.size} B per batch, best of {a.repeat}, GB/s = 1e9 B/s; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    if torch.cuda.is_available():
        case("GPU memory, RDMA over shm (FI_HMEM)", "shm", "cuda", a)
        case("pinned host memory, RDMA over shm", "shm", "pinned", a)
    case("host memory, RDMA over shm", "shm", "host", a)
    case("host memory, TCP", None, "host", a)


if __name__ == "__main__":
    main()
