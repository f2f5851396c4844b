"""memkv_vllm.plots draws both charts from the JSON its producers write (shapes as bench_tier_ttft
and `memkv bench --json` emit them), and `python -m memkv_vllm.plots` redraws saved data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib (the [plot] extra)")

from memkv_vllm.plots import ttft_figure  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_ttft_chart_from_the_benchmarks_rows(tmp_path: Path) -> None:
    rows = [{"prompt_tokens": n, "plain_s": 0.1 * k, "baseline_s": 0.11 * k, "cold_s": 0.12 * k,
             "warm_s": 0.02 * k, "all_miss_overhead_s": 0.01 * k, "speedup": 6.0,
             "warm_cached_tokens": n - n % 128}
            for k, n in enumerate([512, 1024, 2048], start=1)]
    out = tmp_path / "ttft.png"
    ttft_figure({"rows": rows}, str(out))
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_the_module_redraws_saved_bench_data(tmp_path: Path) -> None:
    doc = {"cpus": 2, "volume": "1G", "batch": 1, "repeat": 3,
           "rows": [{"size": s << 20, "label": f"{s}M", "threads": t, "memcpy": 10.0, "tcp": 5.0,
                     "tcp_per_thread": 6.0, "put": 4.6, "get": 4.8, "redis_set": None,
                     "redis_get": None} for s in (1, 4) for t in (1, 2)]}
    data, out = tmp_path / "b.json", tmp_path / "b.png"
    data.write_text(json.dumps(doc))
    p = subprocess.run([sys.executable, "-m", "memkv_vllm.plots", "bench", str(data), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == PNG
    bad = subprocess.run([sys.executable, "-m", "memkv_vllm.plots", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2
