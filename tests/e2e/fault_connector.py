"""The recompute connector plus a test hook that hits the memkv server at the moment a load starts.

`FaultInjectingConnector` is memkv_vllm.connector's MemKVOffloadingConnector with one addition,
for tests/e2e/test_direct_faults.py only: when a worker is about to submit load jobs (the
scheduler has already looked the blocks up, found them and leased them), it looks for the plan
file named by $DIRECT_FAULT_PLAN. If there is one, it sends the named signal to the server
(SIGKILL: killed between lookup and load; SIGSTOP: frozen), waits until that has taken effect
(the port refuses connections / the process is stopped: polled, not slept), renames the plan to
`<plan>.fired` and only then lets the loads go. Every load error the connector reports to vLLM
is appended to `<plan dir>/load_errors.jsonl`, so the test sees that the failure went through
vLLM's recompute path rather than a lookup miss.

Selected with "kv_connector": "FaultInjectingConnector", "kv_connector_module_path":
"fault_connector" (this directory on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from memkv_vllm.vllm.connector import connector_class

PLAN_ENV = "DIRECT_FAULT_PLAN"  # not MEMKV_*: the config layer warns about unknown ones


def _refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def fire_plan(plan: Path) -> None:
    """Carry out the plan at `plan` (see the module doc)."""
    order = json.loads(plan.read_text())
    sig, pid, port = signal.Signals[order["signal"]], int(order["pid"]), int(order["port"])
    os.kill(pid, sig)
    done = (lambda: _refuses(port)) if sig == signal.SIGKILL else (lambda: _stopped(pid))
    deadline = time.monotonic() + 10
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sig.name} to the memkv server {pid} did not take effect")
        time.sleep(0.01)
    plan.rename(plan.with_name(plan.name + ".fired"))


class _FaultHook:
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = os.environ.get(PLAN_ENV)
        meta = self._get_connector_metadata()  # type: ignore[attr-defined]
        if plan and getattr(meta, "load_jobs", None) and Path(plan).exists():
            fire_plan(Path(plan))
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()  # type: ignore[misc]
        plan = os.environ.get(PLAN_ENV)
        if errors and plan:
            with open(Path(plan).parent / "load_errors.jsonl", "a") as f:
                f.write(json.dumps({"blocks": sorted(errors)}) + "\n")
        return errors


FaultInjectingConnector = type("FaultInjectingConnector", (_FaultHook, connector_class()),
                               {"__module__": __name__})
