"""benchmarks/vs_peers.py end to end against a real `memkv serve` (and Redis where installed).

Mooncake needs its own environment (see the script's docstring), so CI runs the script with the
stores it has; the run must verify every value's bytes and answer the existence check right,
else the script exits non-zero.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_vs_peers_measures_and_verifies_the_stores_it_has(tmp_path: Path) -> None:
    have_redis = shutil.which("redis-server") and importlib.util.find_spec("redis")
    systems = "memkv,redis" if have_redis else "memkv"
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_peers.py"), "--systems", systems,
         "--sizes", "64K,1M", "--threads", "1,2", "--volume", "4M", "--rounds", "2",
         "--memory", "64M", "--exists-calls", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert [(r["size"], r["threads"]) for r in res["rows"]] == [
        (64 << 10, 1), (64 << 10, 2), (1 << 20, 1), (1 << 20, 2)]
    for row in res["rows"]:
        for name in systems.split(","):
            for op in ("put", "get"):
                med, lo, hi = row[f"{name}_{op}"]
                assert 0 < lo <= med <= hi
    assert set(res["exists_s"]) == {*systems.split(","), "memkv native call"}
    assert "batched existence check of 1,000 keys" in p.stdout
