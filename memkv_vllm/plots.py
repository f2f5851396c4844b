"""Charts of the benchmarks, drawn with matplotlib (optional: pip install 'memkv-vllm[plot]').

`memkv bench --plot FILE.png` draws `bench_figure` from the measurements the native bench writes
with --json; benchmarks/bench_tier_ttft.py --plot draws `ttft_figure` from its --json rows. Also
runnable on saved JSON: python -m memkv_vllm.plots bench|ttft IN.json OUT.png
"""

from __future__ import annotations

import json
import sys
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a clear error saying how to get it."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plots need matplotlib: pip install 'memkv-vllm[plot]' "
                         "(or pip install matplotlib)") from e
    matplotlib.use("Agg")  # no display needed; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def bench_figure(doc: dict, out: str) -> None:
    """Throughput by value size, one panel per client thread count: memkv put/get (and Redis when
    measured) as points, the same run's loopback-TCP ceilings as lines."""
    plt = pyplot()
    rows = doc["rows"]
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(1, len(threads), figsize=(4.4 * len(threads), 4.0), sharey=True,
                             squeeze=False)
    for ax, th in zip(axes[0], threads, strict=True):
        rs = sorted((r for r in rows if r["threads"] == th), key=lambda r: r["size"])
        x = [r["size"] for r in rs]
        ax.plot(x, [r["tcp"] for r in rs], "-", color="0.45", label="ceiling: TCP, one stream")
        ax.plot(x, [r["tcp_per_thread"] for r in rs], "--", color="0.65",
                label="ceiling: TCP, a stream per thread")
        ax.plot(x, [r["put"] for r in rs], "o", color="tab:blue", label="memkv put")
        ax.plot(x, [r["get"] for r in rs], "s", color="tab:orange", label="memkv get")
        if any(r.get("redis_set") is not None for r in rs):
            ax.plot(x, [r["redis_set"] for r in rs], "^", color="tab:red", label="Redis SET")
            ax.plot(x, [r["redis_get"] for r in rs], "v", color="tab:purple", label="Redis GET")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [r["label"] for r in rs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{th} client thread{'s' if th > 1 else ''}")
        ax.set_xlabel("value size")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s (1e9 B/s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"memkv bench: {doc['cpus']} CPUs, {doc['volume']} per point, "
                 f"{doc['batch']} value(s) per request, best of {doc['repeat']} rounds",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend below the panels
    fig.savefig(out, dpi=100)
    plt.close(fig)


def ttft_figure(doc: dict, out: str) -> None:
    """Median time to first token by prompt length: CPU pool only, memkv cold (all-miss) and
    memkv warm (prefix from the cluster), bars side by side, speed-up over each warm bar."""
    plt = pyplot()
    rows = sorted(doc["rows"], key=lambda r: r["prompt_tokens"])
    series = [("baseline_s", "CPU pool only", "0.6"),
              ("cold_s", "+ memkv, all miss (cold)", "tab:red"),
              ("warm_s", "+ memkv, prefix from the cluster (warm)", "tab:green")]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    width = 0.27
    for i, (key, label, color) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        bars = ax.bar(xs, [r[key] * 1e3 for r in rows], width, label=label, color=color)
        if key == "warm_s":
            for b, r in zip(bars, rows, strict=True):
                ax.annotate(f"{r['speedup']:.1f}x", (b.get_x() + b.get_width() / 2,
                            b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [str(r["prompt_tokens"]) for r in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median time to first token (ms)")
    ax.set_title("vLLM (CPU platform) with the memkv tier: TTFT cold vs warm", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    figures = {"bench": bench_figure, "ttft": ttft_figure}
    if len(argv) != 3 or argv[0] not in figures:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        figures[argv[0]](json.load(f), argv[2])
    print(f"plot: {argv[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
