"""memkv as SGLang HiCache's L3 storage against SGLang's own file backend on /dev/shm, in one run,
through a real SGLang host pool. (SGLang's Mooncake backend is not measured: it needs the
mooncake package and a running Mooncake master; the header says whether mooncake imports.)

For each page size: a 32-layer MHA host pool (page_first, bf16, --heads KV heads of 128), then
per backend and round (the order rotated each round): store --pages pages, then read them back
into other pages of the pool, timed as SGLang's cache controller makes the calls:

* memkv v1: `batch_set_v1` / `batch_get_v1` (zero copy: the pool's memory is registered);
* memkv flat, file: `batch_set` of `get_data_page` copies / `batch_get` into dummy pages, then
  `set_from_flat_data_page` (SGLang's copying path, the only one its file backend has).

Every read is checked against what was stored. Prints GB/s (page bytes / seconds), median and
min-max over --rounds. Runs in .venv-sglang (scripts/setup-sglang.sh):

    .venv-sglang/bin/python benchmarks/sglang_hicache.py [--page-sizes 64,128,256] [--pages 16]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "hicache")]
from memkv_procs import MemKVServer  # noqa: E402
from sglang_pools import host_pool, storage_config  # noqa: E402

from memkv_vllm.sglang import MemKVHiCacheStorage  # noqa: E402


def names(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def flat_set(b, host, keys, first):  # noqa: ANN001, ANN201
    ps = host.page_size
    return b.batch_set(keys, [host.get_data_page((first + i) * ps) for i in range(len(keys))])


def flat_get(b, host, keys, first):  # noqa: ANN001, ANN201
    ps = host.page_size
    got = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(got):
        if page is None:
            return False
        host.set_from_flat_data_page((first + i) * ps, page)
    return True


def v1_set(b, host, keys, first):  # noqa: ANN001, ANN201
    import torch

    ps = host.page_size
    return all(b.batch_set_v1(keys, torch.arange(first * ps, (first + len(keys)) * ps)))


def v1_get(b, host, keys, first):  # noqa: ANN001, ANN201
    import torch

    ps = host.page_size
    return all(b.batch_get_v1(keys, torch.arange(first * ps, (first + len(keys)) * ps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-sizes", default="64,128,256")
    ap.add_argument("--pages", type=int, default=16, help="pages per batch")
    ap.add_argument("--heads", type=int, default=2, help="KV heads of this rank")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    srv = MemKVServer(memory="2G", lanes=4).start()
    shm = tempfile.mkdtemp(prefix="hicache-bench-", dir="/dev/shm")
    mooncake = importlib.util.find_spec("mooncake") is not None
    print(f"# {args.layers} layers, {args.heads} KV heads x 128, bf16, page_first; "
          f"{args.pages} pages per batch; median (min-max) GB/s over {args.rounds} rounds")
    print(f"# SGLang's mooncake backend: not measured (the mooncake package "
          f"{'imports' if mooncake else 'does not import'} here; it needs a Mooncake master too)")
    print("| page tokens | page MiB | backend | set GB/s | get GB/s |")
    print("|---|---|---|---|---|")
    try:
        for ps in (int(p) for p in args.page_sizes.split(",")):
            host = host_pool("mha", "page_first", layers=args.layers, page_size=ps,
                             tokens=args.pages * ps, heads=args.heads, head_dim=128)
            page_bytes = host.get_size_per_token() * ps
            cfg = storage_config(False, servers=srv.address)
            memkv = MemKVHiCacheStorage(cfg)
            memkv.register_mem_pool_host(host)
            file_cfg = storage_config(False)
            file_cfg.extra_config = {"file_storage_path": shm}
            file_backend = HiCacheFile(file_cfg)
            file_backend.register_mem_pool_host(host)
            runs: dict[str, tuple[object, Callable, Callable]] = {
                "memkv v1 (zero copy)": (memkv, v1_set, v1_get),
                "memkv flat pages": (memkv, flat_set, flat_get),
                "SGLang file, /dev/shm": (file_backend, flat_set, flat_get),
            }
            rates: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
            order = list(runs)
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    b, put, get = runs[name]
                    keys = names(f"{name}/{ps}/{r}", args.pages)
                    want = host.kv_buffer[:, : args.pages * ps].clone()
                    t0 = time.perf_counter()
                    assert put(b, host, keys, 0), f"{name}: set failed"
                    t1 = time.perf_counter()
                    assert get(b, host, keys, args.pages), f"{name}: get failed"
                    t2 = time.perf_counter()
                    assert torch.equal(host.kv_buffer[:, args.pages * ps:2 * args.pages * ps]
                                       .view(torch.int16), want.view(torch.int16)), name
                    total = args.pages * page_bytes / 1e9
                    rates[name][0].append(total / (t1 - t0))
                    rates[name][1].append(total / (t2 - t1))
            for name in runs:
                cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
                         for v in rates[name]]
                print(f"| {ps} | {page_bytes / (1 << 20):.1f} | {name} | {cells[0]} | {cells[1]} |")
            memkv.close()
            file_backend.clear()
    finally:
        srv.kill()
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
