"""Starting and stopping real `memkv serve` processes on free loopback ports (tests, demos)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def proc_status(pid: int | str, field: str) -> int:
    """A number from /proc/<pid>/status (`pid` "self" for this process): kB for the Vm*
    fields (VmRSS, VmSize), a count for Threads."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _task_state(task: Path) -> str:
    """One thread's state letter from /proc/<pid>/task/<tid>/stat ("T": stopped), or "gone"."""
    try:
        return task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return "gone"


def memkv_command() -> list[str]:
    """The server command: $MEMKV_BIN if set, else the `memkv` of the interpreter running the tests
    (the wheel's console script, always the build just installed), else that module directly.
    A cargo-built native/target/release/memkv is used only through MEMKV_BIN, so a stale one
    cannot be tested by accident."""
    if os.environ.get("MEMKV_BIN"):
        return [os.environ["MEMKV_BIN"]]
    script = Path(sys.executable).parent / "memkv"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "memkv_vllm.cli"]


class MemKVServer:
    """One real server process. ``address`` is its host:port once started."""

    def __init__(self, memory: str = "256M", lanes: int = 4, auth_key: str | None = None,
                 metrics: bool = False, extra: list[str] | None = None,
                 listen: str = "127.0.0.1:0", wrapper: list[str] | None = None) -> None:
        # `wrapper` runs the server through another command that execs it (e.g. prlimit), so the
        # process id stays the server's.
        self.wrapper = wrapper or []
        self.args = ["serve", "--listen", listen, "--memory", memory, "--lanes", str(lanes)]
        if auth_key:
            self.args += ["--auth-key", auth_key]
        if metrics:
            self.args += ["--metrics", "127.0.0.1:0"]
        self.args += extra or []
        self.auth_key = auth_key
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self, timeout: float = 30.0) -> MemKVServer:
        env = {k: v for k, v in os.environ.items() if k != "MEMKV_AUTH_KEY"}
        # stderr goes to a file: a pipe nobody drains would block the server once full.
        self._log = tempfile.NamedTemporaryFile("w+", prefix="memkv-", suffix=".log")
        self.proc = subprocess.Popen(self.wrapper + memkv_command() + self.args,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"memkv serve exited: {self.log()}")
            if line.startswith("memkv listening on "):
                self.address = line.split()[-1]
                return self
        raise RuntimeError("memkv serve did not report its address in time")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_port(self) -> int:
        """The `--metrics` HTTP port (metrics=True binds a free one), from the server's log."""
        for line in self.log().splitlines():
            if " metrics=127.0.0.1:" in line:
                return int(line.split(" metrics=127.0.0.1:")[1].split()[0])
        raise AssertionError(f"no metrics port in the log: {self.log()}")

    def stats(self) -> dict:
        out = subprocess.run(memkv_command() + ["stats", "--json", "--servers", self.address],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "MEMKV_AUTH_KEY": self.auth_key or ""}
                             if self.auth_key else None)
        return json.loads(out.stdout)[self.address]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the abrupt death of a server."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    @contextlib.contextmanager
    def frozen(self, timeout: float = 20.0) -> Iterator[None]:
        """SIGSTOP for the `with` block, SIGCONT after: the server answers nothing while its
        connections stay open. Enters once every thread of it has stopped (the signal is
        delivered to them one by one), so none still answers a request sent inside."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        try:
            tasks = Path(f"/proc/{self.proc.pid}/task")
            deadline = time.monotonic() + timeout
            while not all(_task_state(t) in ("T", "gone") for t in tasks.iterdir()):
                assert time.monotonic() < deadline, "memkv serve did not stop"
                time.sleep(0.005)
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful drain); returns the exit code."""
        assert self.proc is not None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        """What the server wrote to stderr so far."""
        self._log.flush()
        return Path(self._log.name).read_text()
