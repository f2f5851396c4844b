"""The `memkv` command as an operator uses it, against real servers: stats table and JSON,
flags from MEMKV_* variables, help texts, and bench --plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from memkv_procs import MemKVServer, memkv_command

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig


def memkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(memkv_command() + list(args), capture_output=True, text=True,
                          timeout=120, env=env)


def rows_by_server(table: str) -> dict[str, list[str]]:
    """Table lines split on runs of 2+ spaces, keyed by their first cell."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        out[cells[0]] = cells
    return out


def test_stats_shows_every_server_hit_ratio_and_memory_as_a_table(memkv_cluster2) -> None:
    a, b = memkv_cluster2
    c = MemKVClient(MemKVConfig(servers=(a.address, b.address)))
    keys = [b"op/%d" % i for i in range(8)]
    assert c.put(keys, [np.full(1 << 20, i, np.uint8) for i in range(8)]) == [Status.OK] * 8
    buf = np.zeros(1 << 20, np.uint8)
    got = [c.get_into([k], [buf])[0] for k in keys + [b"op/absent"]]  # 8 hits, 1 miss
    assert got.count(Status.OK) == 8
    c.close()
    p = memkv("stats", "--servers", f"{a.address},{b.address}")
    assert p.returncode == 0, p.stderr
    rows = rows_by_server(p.stdout)
    header = rows.pop("SERVER")
    assert header[1:5] == ["ITEMS", "MEMORY", "USED", "GET HITS"]
    total = rows.pop("total (2 of 2 up)")
    assert set(rows) == {a.address, b.address}
    assert sum(int(r[1]) for r in rows.values()) == 8 == int(total[1])
    assert total[2] == "8.0 MiB / 512.0 MiB" and total[3] == "1.6%"
    assert total[4] == "88.9% of 9"  # 8 of 9 GETs hit, summed over the servers
    # The JSON has the same counters, raw.
    j = json.loads(memkv("stats", "--json", "--servers", f"{a.address},{b.address}").stdout)
    assert sum(s["items"] for s in j.values()) == 8
    assert sum(s["hits"] for s in j.values()) == 8 and sum(s["misses"] for s in j.values()) == 1


def test_stats_names_a_down_server_and_fails(memkv_server) -> None:
    dead = MemKVServer().start()
    dead.kill()
    p = memkv("stats", "--timeout", "2", "--servers", f"{memkv_server.address},{dead.address}")
    assert p.returncode == 1
    assert f"{dead.address}: DOWN (" in p.stdout
    assert "total (1 of 2 up)" in p.stdout


def test_serve_reads_its_flags_from_memkv_variables_and_a_flag_wins(monkeypatch) -> None:
    monkeypatch.setenv("MEMKV_MEMORY", "48M")
    monkeypatch.setenv("MEMKV_LANES", "3")
    monkeypatch.setenv("MEMKV_LISTEN", "127.0.0.1:1")  # unusable: the --listen flag must win
    s = MemKVServer()
    s.args = ["serve", "--listen", "127.0.0.1:0"]  # memory and lanes from the environment only
    s.start()
    try:
        st = s.stats()
        assert st["memory_capacity_bytes"] == 48 << 20 and st["lanes"] == 3
    finally:
        s.kill()


def test_help_explains_every_flag_and_hides_environment_values() -> None:
    serve = memkv("serve", "--help").stdout
    lines = serve.splitlines()
    i = next(n for n, line in enumerate(lines) if "--max-connections" in line)
    assert "refused" in lines[i + 1]  # a help text, not just the default
    for name in ("MEMKV_LISTEN", "MEMKV_MEMORY", "MEMKV_LANES", "MEMKV_METRICS", "MEMKV_AUTH_KEY"):
        assert f"[env: {name}]" in serve
    stats = memkv("stats", "--help", env={**os.environ, "MEMKV_SERVERS": "10.9.9.9:1"}).stdout
    assert "[env: MEMKV_SERVERS]" in stats and "10.9.9.9" not in stats
    assert "=]" not in serve + stats


def test_bench_plot_draws_a_png_from_the_runs_measurements(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the [plot] extra)")
    png, data = tmp_path / "bench.png", tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "memkv_vllm.cli", "bench", "--sizes", "64K,256K",
                        "--threads", "1,2", "--volume", "4M", "--memory", "64M", "--repeat", "1",
                        "--json", str(data), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = json.loads(data.read_text())["rows"]
    assert {(r["label"], r["threads"]) for r in rows} == {
        ("64K", 1), ("64K", 2), ("256K", 1), ("256K", 2)}
    assert all(r["put"] > 0 and r["get"] > 0 and r["tcp"] > 0 for r in rows)
    assert f"plot: {png}" in p.stdout


def test_the_bare_binary_refuses_plot_and_says_who_draws_it(tmp_path: Path) -> None:
    binary = Path(__file__).resolve().parents[1] / "native" / "target" / "release" / "memkv"
    if not binary.exists():
        pytest.skip("no cargo-built memkv binary")
    p = subprocess.run([str(binary), "bench", "--plot", str(tmp_path / "x.png")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Python package" in p.stderr


DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def test_the_deploy_env_file_configures_a_real_server_with_its_auth_key(tmp_path: Path) -> None:
    """deploy/systemd/memkv.env.example is all `memkv serve` needs: every variable in it is read
    (ports and sizes swapped for test ones), and the auth key comes from it, not argv."""
    example = env_file(DEPLOY / "systemd" / "memkv.env.example")
    unit = (DEPLOY / "systemd" / "memkv@.service").read_text()
    assert "EnvironmentFile=" in unit and "--auth-key" not in unit
    assert set(example) == {"MEMKV_LISTEN", "MEMKV_MEMORY", "MEMKV_LANES", "MEMKV_METRICS",
                            "MEMKV_AUTH_KEY", "MEMKV_LOG"}
    key = "cd" * 32
    env = {**os.environ, **example, "MEMKV_LISTEN": "127.0.0.1:0", "MEMKV_MEMORY": "32M",
           "MEMKV_METRICS": "127.0.0.1:0", "MEMKV_AUTH_KEY": key}
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(memkv_command() + ["serve"], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # nothing on the command line but "serve"
        assert line.startswith("memkv listening on "), (tmp_path / "serve.log").read_text()
        addr = line.split()[-1]
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        with_key = {**os.environ, "MEMKV_AUTH_KEY": key}
        st = json.loads(memkv("stats", "--json", "--servers", addr, env=with_key).stdout)[addr]
        assert st["memory_capacity_bytes"] == 32 << 20
        assert st["lanes"] == int(example["MEMKV_LANES"])
        assert " metrics=127.0.0.1:" in (tmp_path / "serve.log").read_text()
        without = {k: v for k, v in os.environ.items() if k != "MEMKV_AUTH_KEY"}
        assert memkv("stats", "--servers", addr, env=without).returncode == 1  # refused
    finally:
        proc.kill()
        proc.wait()
