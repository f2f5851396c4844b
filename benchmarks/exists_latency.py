"""Latency of one batched existence check through the Python client, next to the native call.

Starts a local `memkv serve`, stores --keys small values, then times one EXISTS of all of them
(every key a hit) three ways, interleaved round by round so that machine noise hits all alike:
  * native — the extension's call alone (`memkv_vllm._native.Client.exists`, keys already a list);
  * codes  — `MemKVClient.codes.exists`: the fast path, one `bytes` of status codes per batch;
  * enums  — `MemKVClient.exists`: a `Status` enum per key;
and, as the floor under all three, `ping`: one round trip of an empty frame (the extension's
`ping`), which every request pays however few keys it names.
Prints the median and the 10th-90th percentile spread of each, in microseconds.

    python benchmarks/exists_latency.py [--keys 1000] [--rounds 300] [--connections 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--connections", type=int, default=2,
                    help="connections_per_server of the client (the configuration's default: 2)")
    a = ap.parse_args()
    srv = MemKVServer(memory="64M", lanes=2).start()
    try:
        c = MemKVClient.from_config(load_config({"servers": [srv.address],
                                                 "connections_per_server": a.connections}))
        keys = [b"exists-bench/%06d" % i for i in range(a.keys)]
        value = np.zeros(64, dtype=np.uint8)
        assert c.put(keys, [value] * a.keys) == [Status.OK] * a.keys
        native = c._c  # the extension object under the wrapper: what the native call costs
        ways: dict[str, Callable[[], object]] = {
            "native": lambda: native.exists(keys, 0),
            "codes": lambda: c.codes.exists(keys),
            "enums": lambda: c.exists(keys),
            "ping": native.ping,
        }
        # The same answer every way (all hits), checked before timing anything.
        assert c.codes.exists(keys) == bytes(a.keys) and c.exists(keys) == [Status.OK] * a.keys
        us: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
                t0 = time.perf_counter_ns()
                ways[name]()
                us[name].append((time.perf_counter_ns() - t0) / 1e3)
        print(f"EXISTS of {a.keys} keys (all hits), loopback, {a.connections} connection(s), "
              f"{a.rounds} interleaved rounds, us:")
        for name, v in us.items():
            q = statistics.quantiles(v, n=10)
            print(f"  {name:6} median {statistics.median(v):7.0f}   p10-p90 {q[0]:6.0f} - "
                  f"{q[-1]:6.0f}")
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
