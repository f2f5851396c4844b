"""What a membership change costs: the share of hits a fleet keeps when one of N memkv servers
leaves, or joins N-1 (keys are placed by rendezvous hashing: only the leaving server's keys, or
the keys the new server wins, move; the expected share kept is (N-1)/N either way).

    python benchmarks/membership.py [--counts 2,3,4] [--keys 20000] [--value 1K] [--json out]

For each N it starts N real `memkv serve` processes on loopback ports and, with the real client:

* remove: writes the keys through a client of all N, then reads them through a client of N-1
  (each server left out in turn); a hit must hold the bytes written (else the run fails);
* add: writes other keys through a client of N-1 servers (each left out in turn), then reads them
  through a client of all N.

It prints the share of keys still hit (mean over the N choices, with min-max) against (N-1)/N.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402

BATCH = 512


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def value_of(key: bytes, size: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(key).digest(size), dtype=np.uint8)


def client_of(servers: list[str]) -> MemKVClient:
    return MemKVClient(load_config({"servers": servers, "op_timeout_s": 30}, env={}))


def write(client: MemKVClient, keys: list[bytes], size: int) -> None:
    for i in range(0, len(keys), BATCH):
        part = keys[i:i + BATCH]
        st = client.put(part, [value_of(k, size) for k in part])
        if set(st) != {Status.OK}:
            raise SystemExit(f"membership: a write failed: {sorted({s.name for s in st})}")


def kept(client: MemKVClient, keys: list[bytes], size: int) -> float:
    """The share of `keys` read back with their bytes; anything but a hit or a miss fails."""
    hits = 0
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
    for i in range(0, len(keys), BATCH):
        part = keys[i:i + BATCH]
        for k, s, b in zip(part, client.get_into(part, bufs[:len(part)]), bufs, strict=False):
            if s == Status.OK:
                if not np.array_equal(b, value_of(k, size)):
                    raise SystemExit(f"membership: wrong bytes for {k!r}")
                hits += 1
            elif s != Status.NOT_FOUND:
                raise SystemExit(f"membership: {k!r} answered {s.name}")
    return hits / len(keys)


def measure(n: int, n_keys: int, size: int, memory: str) -> dict:
    servers = [MemKVServer(memory=memory, lanes=1).start() for _ in range(n)]
    try:
        addrs = [s.address for s in servers]
        full = client_of(addrs)
        removed, added = [], []
        keys = [f"member/{n}/rm/{i}".encode() for i in range(n_keys)]
        write(full, keys, size)
        for out in range(n):
            rest = client_of(addrs[:out] + addrs[out + 1:])
            removed.append(kept(rest, keys, size))
            rest.close()
        for out in range(n):
            keys = [f"member/{n}/add/{out}/{i}".encode() for i in range(n_keys)]
            rest = client_of(addrs[:out] + addrs[out + 1:])
            write(rest, keys, size)
            rest.close()
            added.append(kept(full, keys, size))
        full.close()
    finally:
        for s in servers:
            s.kill()
    return {"n": n, "expected": (n - 1) / n, "removed": removed, "added": added}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="2,3,4", help="server counts N")
    ap.add_argument("--keys", type=int, default=20000, help="keys written per case")
    ap.add_argument("--value", default="1K", help="value size")
    ap.add_argument("--memory", default="128M", help="memory per server")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    size = parse_size(args.value)
    t0 = time.monotonic()
    rows = [measure(int(n), args.keys, size, args.memory) for n in args.counts.split(",")]
    print(f"{args.keys} keys of {args.value} per case; share of keys still hit")
    print(f"{'N':>2}  {'(N-1)/N':>8}  {'one of N removed':>24}  {'N-th added':>24}")
    for r in rows:
        cols = [f"{np.mean(r[c]):.4f} ({min(r[c]):.4f}-{max(r[c]):.4f})"
                for c in ("removed", "added")]
        print(f"{r['n']:>2}  {r['expected']:>8.4f}  {cols[0]:>24}  {cols[1]:>24}")
    print(f"({time.monotonic() - t0:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
