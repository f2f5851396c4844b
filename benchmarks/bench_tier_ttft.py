#!/usr/bin/env python3
"""Time to first token with the memkv tier on vLLM's CPU platform: cold vs warm, and all-miss cost.

Engine processes see sets of prompts (distinct prompts per length, so no prompt shares a prefix
with another), each prompt as a max_tokens=1 request:

  plain     plain vLLM, no KV connector (for reference: a KV connector changes vLLM's scheduling,
            e.g. async scheduling, so this is not the baseline of the tier's cost)
  baseline  vLLM's CPU pool only (MemKVTieringOffloadingSpec, no secondary tier)
  cold      the same plus the memkv tier, cluster empty for these prompts: every lookup misses
  warm      a NEW engine process (empty CPU pool), memkv tier on: prefixes come from the cluster

cold - baseline is the all-miss overhead of the memkv tier (probe round trip, the extra scheduler
step, stores); cold / warm is the speed-up from reusing another engine's prefix. Processes differ in
timing noise on a shared 2-core box, so baseline and cold run alternately for --rounds rounds,
each round on fresh prompts, and medians are taken over rounds and prompts. The model is a random
Llama big enough that prefill dominates on a 2-core CPU (built locally, scripts/make_tiny_model.py).

  .venv-vllm/bin/python benchmarks/bench_tier_ttft.py [--lengths 512,1024,2048,3072] [--reps 2]
      [--rounds 2] [--json out.json] [--plot ttft.png]

--plot draws the medians as a bar chart (memkv_vllm/plots.py; needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_SHAPE = {"TINY_HIDDEN": "512", "TINY_LAYERS": "8", "TINY_HEADS": "8", "TINY_KV_HEADS": "2",
               "TINY_INTERMEDIATE": "1536", "TINY_MAX_POS": "4096"}


def engine_main(args: argparse.Namespace) -> int:
    """One engine process: warm-up, then each prompt once; writes {prompt_id: [ttft, cached]}."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from tier_engine import kv_transfer_config, prompt_text
    from vllm import LLM, SamplingParams

    kw = {}
    if args.mode != "plain":
        kv = kv_transfer_config(args.servers, args.prefix, 512 << 20)
        if args.mode == "baseline":
            kv["kv_connector_extra_config"]["secondary_tiers"] = []
        kw["kv_transfer_config"] = kv
    llm = LLM(model=args.model, dtype="float32", max_model_len=4096, max_num_seqs=4,
              enforce_eager=True, seed=0, disable_log_stats=False, **kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt_text(200, seed=999_999)], sp, use_tqdm=False)  # warm-up, unrelated
    out = {}
    for pid in args.prompts.split(","):
        n, seed = (int(x) for x in pid.split(":"))
        t0 = time.perf_counter()
        r = llm.generate([prompt_text(n, seed)], sp, use_tqdm=False)[0]
        out[pid] = [time.perf_counter() - t0, r.num_cached_tokens, len(r.prompt_token_ids)]
        time.sleep(0.2)  # let the stores of this prompt reach the cluster before the next one
    time.sleep(1.0)
    # vLLM 0.28+ times how long tier lookups stay unresolved (RETRY until the probe answers):
    # the tier's own share of an all-miss request's TTFT, free of prefill noise.
    delay = {"count": 0, "sum": 0.0}
    try:
        for m in llm.get_metrics():
            if (m.name == "vllm:kv_offload_tiering_lookup_async_delay_seconds"
                    and m.labels.get("tier", "").endswith(":memkv")):
                delay["count"] += int(m.count)
                delay["sum"] += float(m.sum)
    except Exception:
        pass
    out["_lookup_delay"] = delay
    Path(args.out).write_text(json.dumps(out))
    return 0


def run_engine(mode: str, model: str, servers: str, prefix: str, prompts: list[str],
               work: Path, tag: str = "") -> dict:
    out = work / f"{mode}{tag}.json"
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--engine", "--mode", mode, "--model", model,
           "--servers", servers, "--prefix", prefix, "--prompts", ",".join(prompts),
           "--out", str(out)]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (work / f"{mode}{tag}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.exit(f"{mode} engine failed:\n{p.stderr[-4000:]}")
    print(f"  {mode:8s}{tag:3s} engine done in {time.time() - t0:.0f}s", flush=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="cold")
    ap.add_argument("--model", default=str(ROOT / ".cache" / "benchmodel"))
    ap.add_argument("--servers", default="")
    ap.add_argument("--prefix", default="bench")
    ap.add_argument("--prompts", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--lengths", default="512,1024,2048,3072")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="", help="bar chart of the medians (PNG; needs matplotlib)")
    args = ap.parse_args()
    if args.engine:
        return engine_main(args)

    model = Path(args.model)
    if not (model / "config.json").exists():
        print(f"building the benchmark model -> {model}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)],
                       env={**os.environ, **MODEL_SHAPE}, check=True, capture_output=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from memkv_procs import MemKVServer

    lengths = [int(x) for x in args.lengths.split(",")]
    rounds = [[f"{n}:{n * 100 + 10 * k + r}" for n in lengths for r in range(args.reps)]
              for k in range(args.rounds)]
    prompts = [p for rnd in rounds for p in rnd]
    server = MemKVServer(memory="1G", lanes=2).start()
    prefix = f"bench-{int(time.time())}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            print(f"memkv server {server.address}; {len(prompts)} prompts; "
                  f"{2 * args.rounds + 2} engine processes", flush=True)
            res: dict[str, dict] = {"baseline": {}, "cold": {}}
            delays = {"count": 0, "sum": 0.0}  # tier lookup delays of the all-miss runs
            for k, rnd in enumerate(rounds):
                for m in ("baseline", "cold"):
                    r = run_engine(m, str(model), server.address, prefix, rnd, work, f"#{k}")
                    d = r.pop("_lookup_delay", {})
                    if m == "cold":
                        delays = {x: delays[x] + d.get(x, 0) for x in delays}
                    res[m].update(r)
            res["warm"] = run_engine("warm", str(model), server.address, prefix, prompts, work)
            res["plain"] = run_engine("plain", str(model), server.address, prefix, rounds[0],
                                      work)
            for r in res.values():
                r.pop("_lookup_delay", None)
            stats = server.stats()
    finally:
        server.kill()

    rows = []
    print(f"\nTTFT on vLLM's CPU platform, model {model.name} (random weights), median of "
          f"{args.reps * args.rounds} prompts per length\n")
    print(f"{'prompt':>7} {'plain':>8} {'CPU pool':>9} {'+memkv cold':>12} {'all-miss':>9} "
          f"{'+memkv warm':>12} {'speed-up':>9} {'from memkv':>11}")
    for n in lengths:
        ids = [p for p in prompts if p.startswith(f"{n}:")]
        med = {m: statistics.median(res[m][p][0] for p in ids if p in res[m]) for m in res}
        cached = statistics.median(res["warm"][p][1] for p in ids)
        ntok = res["warm"][ids[0]][2]
        row = {"prompt_tokens": ntok, "plain_s": med["plain"], "baseline_s": med["baseline"],
               "cold_s": med["cold"],
               "warm_s": med["warm"], "all_miss_overhead_s": med["cold"] - med["baseline"],
               "speedup": med["cold"] / med["warm"], "warm_cached_tokens": cached}
        rows.append(row)
        print(f"{ntok:>7} {med['plain'] * 1e3:>6.0f}ms {med['baseline'] * 1e3:>7.0f}ms "
              f"{med['cold'] * 1e3:>10.0f}ms {row['all_miss_overhead_s'] * 1e3:>+7.0f}ms "
              f"{med['warm'] * 1e3:>10.0f}ms {row['speedup']:>8.1f}x {int(cached):>6} tok")
    if delays["count"]:
        print(f"\nmemkv lookups pending until their probe answered (vLLM's "
              f"lookup_async_delay, all-miss runs): {delays['count']} chunk lookups, mean "
              f"{delays['sum'] / delays['count'] * 1e3:.2f} ms")
    print(f"\nserver: {stats['items']} items, {stats['puts']} puts, {stats['hits']} hits, "
          f"{stats['bytes_out'] >> 20} MiB served")
    doc = {"rows": rows, "server": stats, "memkv_lookup_delay": delays}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        from memkv_vllm.plots import ttft_figure

        ttft_figure(doc, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
