"""The `memkv` command: a thin shim into the native CLI (serve, stats, ping, bench).

One thing is done here rather than in Rust: `memkv bench --plot FILE.png` runs the native bench
with --json and draws the chart with matplotlib (memkv_vllm/plots.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable


def take_option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `name VALUE` or `name=VALUE` from `args`; returns (VALUE or None, the rest)."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1], args[:i] + args[i + 2:]
        if a.startswith(name + "="):
            return a[len(name) + 1:], args[:i] + args[i + 1:]
    return None, args


def bench_with_plot(cli_main: Callable[[list[str]], int], args: list[str], png: str) -> int:
    from memkv_vllm import plots

    plots.pyplot()  # fail before a long benchmark, not after it
    data, args = take_option(args, "--json")
    tmp = None
    if data is None:
        fd, tmp = tempfile.mkstemp(prefix="memkv-bench-", suffix=".json")
        os.close(fd)
        data = tmp
    try:
        rc = cli_main(["memkv", *args, "--json", data])
        if rc == 0:
            with open(data) as f:
                plots.bench_figure(json.load(f), png)
            print(f"plot: {png}")
        return rc
    finally:
        if tmp:
            os.unlink(tmp)


def main() -> int:
    from memkv_vllm import _native

    args = sys.argv[1:]
    if args[:1] == ["bench"]:
        png, rest = take_option(args, "--plot")
        if png is not None:
            return bench_with_plot(_native.cli_main, rest, png)
    return _native.cli_main(["memkv", *args])


if __name__ == "__main__":
    raise SystemExit(main())
