"""Prompts, KV configs and engine runs of tests/gpu (each engine: one scripts/kv_engine.py process).

The prompts are token ids. PROMPT_TOKENS is not a multiple of the block size: each prompt has
PREFIX_TOKENS in full blocks that can come from outside, and a suffix every engine computes. Two
engines' greedy tokens and logprobs are compared only where both computed the same suffix over
the same prefix (kv_engine.py's second request of a prompt: the prefix from its cache, the
suffix computed); the control prompt has the main prompt's suffix after another prefix, so its
logprobs differing from the main prompt's shows that the comparison sees the prefix's KV.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from direct_engine import direct_config as e2e_direct_config
from tier_engine import kv_transfer_config
from vllm_procs import engine_env, run_engine_script

ROOT = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("GPU_TESTS_DEVICE", "cuda")
# The engines' device choices. On the GPU: Triton attention (the bundle carries no flash-attn),
# bf16, 128-token blocks (so a 600-token prompt has 4 full blocks, one memkv value each, as on
# the CPU platform), and a small share of the GPU (the engines are tiny and run one at a time).
ENGINE_ARGS = {
    "cuda": {"dtype": "bfloat16", "attention_backend": "TRITON_ATTN", "block_size": 128,
             "max_model_len": 2048, "gpu_memory_utilization": 0.05, "enforce_eager": True},
    "cpu": {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True},
}[DEVICE]
KV_ENGINE = ROOT / "scripts" / "kv_engine.py"
BLOCK = 128  # ENGINE_ARGS' block size (and vLLM's on the CPU platform)
PROMPT_TOKENS = 600
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK  # 4 (600 is not a multiple of 128)
PREFIX_TOKENS = PROMPT_BLOCKS * BLOCK
VOCAB = 1024  # scripts/make_tiny_model.py's


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]  # 0-2 are the special tokens


def prompts() -> list[dict]:
    """The main prompt and the control: another prefix, the same suffix."""
    main = token_ids(1, PROMPT_TOKENS)
    control = token_ids(2, PREFIX_TOKENS) + main[PREFIX_TOKENS:]
    return [{"name": "main", "ids": main}, {"name": "control", "ids": control}]


def tier_config(server: str, prefix: str) -> dict:
    return kv_transfer_config(server, prefix, 64 << 20)


def direct_config(server: str, prefix: str, connector: str = "OffloadingConnector") -> dict:
    """Direct mode through vLLM's OffloadingConnector, or memkv's recompute connector."""
    cfg = e2e_direct_config(server, prefix)
    if connector == "MemKVOffloadingConnector":
        cfg.update(kv_connector=connector, kv_connector_module_path="memkv_vllm.connector",
                   kv_load_failure_policy="recompute")
    return cfg


def run_engine(model: str, work: Path, name: str, kv: dict | None, engine_args: dict, *,
               server: str = "", wait_items: int = 0, env: dict | None = None) -> dict:
    """One kv_engine.py process over prompts(); its result (and name.log) in `work`."""
    (work / f"{name}.prompts.json").write_text(json.dumps(prompts()))
    args = ["--model", model, "--prompts", str(work / f"{name}.prompts.json"),
            "--llm-args", json.dumps(engine_args), "--kv-config", json.dumps(kv) if kv else ""]
    if wait_items:
        args += ["--servers", server, "--wait-items", str(wait_items)]
    return run_engine_script(KV_ENGINE, args, work / f"{name}.json",
                             env={**engine_env(), **(env or {})})


def refused(model: str, work: Path, name: str, kv: dict, engine_args: dict,
            env: dict) -> str:
    """Start an engine that must not start; returns its output (the reason it gave)."""
    (work / f"{name}.prompts.json").write_text(json.dumps(prompts()))
    p = subprocess.run(
        [sys.executable, str(KV_ENGINE), "--model", model, "--out", str(work / f"{name}.json"),
         "--prompts", str(work / f"{name}.prompts.json"), "--llm-args", json.dumps(engine_args),
         "--kv-config", json.dumps(kv)],
        env={**engine_env(), **env}, capture_output=True, text=True, timeout=300)
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    assert p.returncode != 0, f"the engine started; log {work / name}.log"
    return p.stdout + p.stderr


def same_outputs(a: dict, b: dict) -> None:
    """b's greedy tokens and logprobs for every prompt are exactly a's."""
    for name, rec in a["prompts"].items():
        assert b["prompts"][name]["tokens"] == rec["tokens"], name
        assert b["prompts"][name]["logprobs"] == rec["logprobs"], name


def expanded() -> dict:
    """The environment of an engine whose torch allocator uses expandable segments."""
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
