"""The same-host path's first GETs into fresh client regions, as a restarted engine sees them.

A client with `--conns` connections registers a fresh memfd region (its pages resident, as a
pinned pool's are), hands it to the server on every connection, waits `--wait` seconds (an engine
registers its pool long before its first load), then GETs `--values` values of `--value-mib` MiB
into it twice: `first` (fresh server mappings) and `again`. Figures are GB/s (1e9 B/s) of value
bytes, each also as a share of a memcpy of one value between two resident buffers in this process,
measured after the round. `--server-bin` takes several `memkv` binaries (two builds), interleaved.

    python benchmarks/shm_first_touch.py [--server-bin A,B] [--rounds 2] [--wait 1]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402


def memcpy_gbps(nbytes: int) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(b, a)
    t = time.perf_counter()
    np.copyto(b, a)
    return nbytes / (time.perf_counter() - t) / 1e9


def one_server(binary: str, a: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(first, again, memcpy) GB/s per round against a fresh server started from `binary`."""
    value = a.value_mib << 20
    total = value * a.values
    if binary:
        os.environ["MEMKV_BIN"] = binary  # the fixtures' server command (tests/memkv_procs.py)
    srv = MemKVServer(memory=f"{4 * total >> 20}M", lanes=4).start()
    keys = [b"first-touch/%d" % i for i in range(a.values)]
    rows = []
    try:
        c0 = MemKVClient(MemKVConfig(servers=(srv.address,)))
        src = np.random.default_rng(0).integers(0, 256, value, dtype=np.uint8)
        assert c0.put(keys, [src] * a.values) == [Status.OK] * a.values
        c0.close()
        for _ in range(a.rounds):
            c = MemKVClient(MemKVConfig(servers=(srv.address,), transport="shm",
                                        connections_per_server=a.conns))
            fd = os.memfd_create("memkv-first-touch")
            os.ftruncate(fd, total)
            m = mmap.mmap(fd, total)
            buf = np.frombuffer(m, dtype=np.uint8)
            buf[::4096] = 1
            base = buf.ctypes.data
            c.register_buffer(base, total)
            ptrs = [base + i * value for i in range(a.values)]
            # One small GET per connection hands the region over on each of them.
            c.get_into_ptrs(keys[:1] * a.conns, [base] * a.conns, [value] * a.conns)
            time.sleep(a.wait)
            rates = []
            for _ in range(2):
                t = time.perf_counter()
                st = c.get_into_ptrs(keys, ptrs, [value] * a.values)
                rates.append(total / (time.perf_counter() - t) / 1e9)
                assert all(s == Status.OK for s in st), st
            rows.append((rates[0], rates[1], memcpy_gbps(value)))
            c.close()
            del buf
            m.close()
            os.close(fd)
    finally:
        srv.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-bin", default="", help="comma-separated memkv binaries "
                    "(default: the one the tests use)")
    ap.add_argument("--rounds", type=int, default=2, help="fresh regions per server")
    ap.add_argument("--repeat", type=int, default=3, help="servers per binary, interleaved")
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--values", type=int, default=16)
    ap.add_argument("--value-mib", type=int, default=32)
    ap.add_argument("--wait", type=float, default=1.0)
    a = ap.parse_args()
    bins = a.server_bin.split(",")
    print(f"{a.values} values of {a.value_mib} MiB per GET, {a.conns} connections, wait "
          f"{a.wait}s, {os.cpu_count()} CPUs; GB/s (share of the round's memcpy)")
    for _ in range(a.repeat):
        for b in bins:
            cells = [f"first {f:.2f} ({f / mc:.0%}) again {g:.2f} ({g / mc:.0%})"
                     for f, g, mc in one_server(b, a)]
            print(f"{b or 'memkv':<24} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
