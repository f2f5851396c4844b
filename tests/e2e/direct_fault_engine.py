#!/usr/bin/env python3
"""ONE vLLM engine process in memkv direct mode through the recompute connector; serves prompts
one after another, each with an optional fault, and reports as JSON. Used by
tests/e2e/test_direct_faults.py (engine A, which fills the cluster, and the engines B).

  python direct_fault_engine.py --model DIR --servers HOST:PORT --out result.json
         --cases '[{"name": "kill", "seeds": [3, 4], "fault": "SIGKILL"}, ...]'
         [--server-pid PID] [--wait-items N] [--final-items N] [--llm-args JSON]

A case's `fault` (SIGKILL or SIGSTOP) is written as a plan for fault_connector.py, which sends it
to the server (--server-pid) when this engine's worker starts the prompt's loads; its prompts
(`seeds`) are tried in turn until it fires (a case without a fault runs them all). After a
SIGSTOP the server is continued (SIGCONT). --wait-items: after the first case, wait until the
server holds N values (its stores are committed) before the next one, so the first prompt's
values are the cluster's oldest. Result per case, a list of the prompts run: greedy tokens,
logprobs, num_cached_tokens, seconds, whether the fault fired, and the block ids the connector
reported to vLLM as load errors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "scripts"))
from fault_connector import PLAN_ENV  # noqa: E402
from tier_engine import prompt_text  # noqa: E402

PROMPT_TOKENS = 600  # 4 full 128-token blocks (vLLM's block size on the CPU platform)


def kv_transfer_config() -> dict:
    return {
        "kv_connector": "FaultInjectingConnector",
        "kv_connector_module_path": "fault_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # Small scratch: the tiny model's values are 128 KiB and a test machine is shared.
        "kv_connector_extra_config": {"spec_name": "MemKVOffloadingSpec",
                                      "spec_module_path": "memkv_vllm.spec",
                                      "memkv_num_threads": 2, "memkv_scratch_mb_per_thread": 4},
    }


def wait_items(servers: str, n: int, timeout: float = 60) -> None:
    from memkv_vllm.core.client import MemKVClient
    from memkv_vllm.core.config import load_config

    client = MemKVClient.from_config(load_config({"servers": servers}))
    try:
        deadline = time.monotonic() + timeout
        while client.stats()[servers].get("items", 0) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not reach {n} values")
            time.sleep(0.05)
    finally:
        client.close()


def run_case(llm, params, plan: Path, fault: str | None, seed: int, server_pid: int,
             port: int) -> dict:
    fired = plan.with_name(plan.name + ".fired")
    fired.unlink(missing_ok=True)
    if fault:
        plan.write_text(json.dumps({"signal": fault, "pid": server_pid, "port": port}))
    t1 = time.perf_counter()
    out = llm.generate([prompt_text(PROMPT_TOKENS, seed)], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t1
    if fault == "SIGSTOP" and fired.exists():
        os.kill(server_pid, signal.SIGCONT)
    plan.unlink(missing_ok=True)  # a plan that did not fire must not hit a later case
    # The hook logs each load error it reports to vLLM; a request's errors are reported before
    # it finishes, so these are this prompt's.
    errors = plan.with_name("load_errors.jsonl")
    failed = [json.loads(line)["blocks"] for line in
              (errors.read_text().splitlines() if errors.exists() else [])]
    errors.unlink(missing_ok=True)
    comp = out.outputs[0]
    return {
        "seed": seed,
        "tokens": list(comp.token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in d.items()} for d in comp.logprobs],
        "num_cached_tokens": out.num_cached_tokens,
        "seconds": seconds,
        "fired": fired.exists(),
        "load_errors": failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--server-pid", type=int, default=0)
    ap.add_argument("--wait-items", type=int, default=0)
    ap.add_argument("--final-items", type=int, default=0,
                    help="after the last case, wait until the server holds N values (the last "
                         "prompt's stores are asynchronous, and an engine's exit drops them)")
    ap.add_argument("--llm-args", default="{}",
                    help="vllm.LLM keyword arguments over the defaults, as JSON (device choices)")
    args = ap.parse_args()
    cases = json.loads(args.cases)
    plan = Path(os.environ[PLAN_ENV])
    port = int(args.servers.rsplit(":", 1)[1])

    os.environ["MEMKV_SERVERS"] = args.servers
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kw = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True,
          "seed": 0, **json.loads(args.llm_args)}
    llm = LLM(model=args.model, kv_transfer_config=kv_transfer_config(), **kw)
    result: dict = {"vllm": __import__("vllm").__version__,
                    "startup_s": time.perf_counter() - t0, "cases": {}}
    # First forward of a process pays one-time costs; shorter than a block: nothing to offload.
    llm.generate([prompt_text(64, seed=10**6)], SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, case in enumerate(cases):
        # A faulted case may name several prompts: they are tried in turn until the fault fires
        # (after a freeze, this engine's client leaves the server alone for its backoff, up to
        # 5 s, and its lookups miss meanwhile: nothing loads, so nothing can fail a load).
        attempts = result["cases"][case["name"]] = []
        for seed in case["seeds"]:
            attempts.append(run_case(llm, params, plan, case.get("fault"), seed, args.server_pid,
                                     port))
            if attempts[-1]["fired"]:
                break
        if i == 0 and args.wait_items:
            wait_items(args.servers, args.wait_items)
    if args.final_items:
        wait_items(args.servers, args.final_items)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # vLLM on CPU spawns its engine processes: a __main__ guard is required
    sys.exit(main())
