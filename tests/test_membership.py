"""What a membership change costs: adding or removing one of N servers keeps close to (N-1)/N of
the hits. Measured with real servers and the real client by benchmarks/membership.py (every hit
checked for its bytes), and for a large key count through the placement function alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from memkv_vllm._native import rendezvous

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_real_servers_keep_n_minus_1_over_n_of_the_hits(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "membership.py"),
                        "--keys", "4000", "--value", "64", "--memory", "32M", "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert [r["n"] for r in rows] == [2, 3, 4]
    for r in rows:
        # 4000 keys: one server's share has a standard deviation under 0.008.
        for share in r["removed"] + r["added"]:
            assert abs(share - (r["n"] - 1) / r["n"]) < 0.04, r


@pytest.mark.parametrize("n", [2, 3, 4])
def test_placement_keeps_n_minus_1_over_n_of_many_keys(n: int) -> None:
    servers = [f"10.231.0.{4 * i + 2}:7390" for i in range(n)]
    keys = [b"prefix/model_abc/%016x.bin" % (i * 2654435761) for i in range(100_000)]
    placed = [servers[rendezvous(k, servers)] for k in keys]
    for gone in servers:  # one removed
        rest = [s for s in servers if s != gone]
        stay = sum(rest[rendezvous(k, rest)] == s for k, s in zip(keys, placed, strict=True))
        assert abs(stay / len(keys) - (n - 1) / n) < 0.01
    fewer = servers[:-1]  # the N-th added to N-1
    stay = sum(fewer[rendezvous(k, fewer)] == s for k, s in zip(keys, placed, strict=True))
    assert abs(stay / len(keys) - (n - 1) / n) < 0.01
