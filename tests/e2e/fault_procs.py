"""Running direct_fault_engine.py (one vLLM engine in direct mode through the recompute connector,
with a fault hook) for the fault tests: tests/e2e/test_direct_faults.py, tests/gpu."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from vllm_procs import engine_env, run_engine_script

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def run_fault_engine(model: str, address: str, work: Path, name: str, cases: list[dict],
                     server_pid: int = 0, wait_items: int = 0, timeout: int = 480,
                     llm_args: dict | None = None, final_items: int = 0) -> dict:
    """One direct_fault_engine.py process (its own session: whatever it leaves is killed; its log
    is work/<name>.log).
    `llm_args`: vllm.LLM keyword arguments over the script's CPU defaults (a GPU's choices)."""
    out, plan = work / f"{name}.json", work / f"{name}-plan" / "plan.json"
    plan.parent.mkdir()
    env = {**engine_env(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "DIRECT_FAULT_PLAN": str(plan),
           # Small client timeouts: a frozen server costs seconds, not the default 10 s per op.
           "MEMKV_OP_TIMEOUT_S": "2", "MEMKV_CONNECT_TIMEOUT_S": "0.5"}
    return run_engine_script(
        HERE / "direct_fault_engine.py",
        ["--model", model, "--servers", address, "--cases", json.dumps(cases),
         "--server-pid", str(server_pid), "--wait-items", str(wait_items),
         "--final-items", str(final_items), "--llm-args", json.dumps(llm_args or {})],
        out, timeout, env)


def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
