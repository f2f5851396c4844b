#!/usr/bin/env python3
"""Run ONE vLLM engine process in direct mode, serve a prompt, report as JSON (tests/e2e).

  python tests/e2e/direct_engine.py --model DIR --servers HOST:PORT --prefix NS --out r.json
         [--prompt-tokens 600] [--max-tokens 8] [--kv-config JSON] [--tp N]

Each call is a new engine with an empty prefix cache, so prefix blocks it does not compute came
from the memkv cluster. The prompt is served once with max_tokens=1 (its num_cached_tokens says
how much came from the cluster), then greedily with logprobs for the comparison with a cold run.
`--kv-config` replaces the whole --kv-transfer-config (e.g. another connector class).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from tier_engine import prompt_text  # noqa: E402


def direct_config(servers: str, prefix: str, block_size: int | None = None) -> dict:
    extra: dict = {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.spec",
                   "servers": servers.split(","), "memkv_spec_prefix": prefix,
                   "memkv_num_threads": 2, "memkv_scratch_mb_per_thread": 8}
    if block_size:
        extra["block_size"] = block_size
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", default="127.0.0.1:7390")
    ap.add_argument("--prefix", default="e2e")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=0, help="tokens per stored chunk")
    ap.add_argument("--kv-config", default="", help="the whole --kv-transfer-config, as JSON")
    ap.add_argument("--no-offload", action="store_true", help="plain vLLM (the cold reference)")
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (worker processes)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kv = json.loads(args.kv_config) if args.kv_config else direct_config(
        args.servers, args.prefix, args.block_size or None)
    kw = {} if args.no_offload else {"kv_transfer_config": kv}
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=4,
              enforce_eager=True, seed=0, disable_log_stats=False, tensor_parallel_size=args.tp,
              **kw)
    prompt = prompt_text(args.prompt_tokens)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                 ignore_eos=True, logprobs=3), use_tqdm=False)[0]
    time.sleep(args.settle_s)  # stores finish in later engine steps (the engine keeps stepping)
    out = full.outputs[0]
    result = {
        "vllm": __import__("vllm").__version__,
        "prompt_tokens": len(first.prompt_token_ids),
        "cached_tokens_first": first.num_cached_tokens,
        "tokens": list(out.token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in d.items()} for d in out.logprobs],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"engine: prompt {result['prompt_tokens']} tokens, {first.num_cached_tokens} cached",
          flush=True)
    return 0


if __name__ == "__main__":  # vLLM on CPU spawns engine processes: a __main__ guard is required
    sys.exit(main())
