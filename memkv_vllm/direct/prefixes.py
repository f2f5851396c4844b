"""Key prefixes at startup: every worker publishes the prefix of its key namespace, the scheduler
adopts the one they agree on.

Why the workers decide: the namespace digest covers what only a worker knows for certain (the
weights it loaded, the KV tensors' layout and sizes), and the scheduler's keys must name exactly
the values the workers write. vLLM builds every worker's KV cache before the scheduler (EngineCore
initializes the KV caches, then constructs the Scheduler, whose connector asks the spec for its
manager), so by the time the manager is made every worker has published.

**The board.** An entry per (engine, rank): the prefix, the publisher's host name, boot id,
process id and start, the wall-clock time it was published and its lease. Each worker writes it

* into the cluster, under the reserved key ``spec prefix + b"\\xffmkB1" + sha256(engine id)[:16]
  + rank``: the channel that reaches the scheduler from any node (multi-node tensor parallelism),
  through either backend (memkv or Redis: only the `BlockClient` calls are used). The spec prefix
  (``memkv_spec_prefix``, usually empty) leads it as it leads the KV keys, so that on a server with
  tenants the entry lies in the tenant's namespace. No other key can collide with it: tier keys
  are UTF-8 path names, and 0xFF never occurs in UTF-8; direct-mode KV keys continue with
  ``mkD1`` after the spec prefix;
* and into a file of a per-user directory under the local temp dir. The file is the single-host
  fast path and earns its place because it does not depend on the cluster: a one-host engine
  starts, checks its ranks and adopts their prefix without a network round trip, also while the
  cluster is unreachable (its lookups then miss until the cluster answers, as everywhere else in
  direct mode).

The scheduler reads this host's files first and the cluster for the ranks it did not find there,
polling for at most `wait_s`. An entry is taken only when it is live:

* it is within its lease (`lease_s` after it was published), so a dead engine's entry expires
  even where nobody deletes it (the cluster evicts such small unread values first);
* one published on this host (same host name and boot id) still belongs to a running process
  (the pid exists with the start time it recorded);
* it was published after this engine's scheduler process started (less `CLOCK_SKEW_S` for
  clocks of other hosts): vLLM starts the scheduler's process before any worker publishes, so an
  older entry is a dead engine's.

Startup stops (`PrefixMismatch`) when live ranks disagree, or when after the wait a rank has no
live entry; the error names the rank and the host of each entry it found (a stale one says why
it is stale) and the hosts of the ranks that did publish. When the cluster cannot be read at all
(a partition at startup) but the ranks that could be read agree, the scheduler adopts their prefix
and logs the ranks it could not check: a rank that disagreed would only miss its loads (its keys
differ), never load wrong bytes. The scheduler removes the entries (files and keys) once read.

vLLM's stock OffloadingConnector gives a spec no worker -> scheduler path at startup (its
handshake metadata goes to the connector, after the scheduler exists), so a connector that
carries the prefixes itself can call `adopt` with what it received instead.

The engine id: vLLM's ``kv_transfer_config.engine_id`` (suffixed ``_dp<rank>`` per data-parallel
replica). vLLM draws a random one in each process that builds an engine config; with the
multiprocessing backend every node of a multi-node engine builds its own, so such engines must set
``engine_id`` to one value on every node (docs/direct.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from memkv_vllm.core.interface import Status

logger = logging.getLogger("vllm.memkv_direct")

BOARD_MAGIC = b"\xffmkB1"  # see the module doc: no tier or KV key starts so
ENTRY_BYTES = 512  # fixed, so that both backends' length-checked reads take it whole
# From a worker's publication to the scheduler's read: KV cache registration, then warm-up
# (compilation, CUDA graph capture), which can take minutes.
DEFAULT_LEASE_S = 900.0
DEFAULT_WAIT_S = 10.0
CLOCK_SKEW_S = 5.0  # tolerated between this host's clock and another publisher's
_POLL_S = 0.05


class PrefixMismatch(RuntimeError):
    """Ranks disagree on the key prefix, or a rank published none: the engine must not start."""


def adopt(published: Mapping[int, bytes | None], world_size: int,
          where: Mapping[int, str] | None = None) -> bytes:
    """The prefix every rank 0..world_size-1 published. Raises PrefixMismatch naming the ranks
    that published nothing or a prefix other than rank 0's; `where` (rank -> host) adds the host
    of each rank named."""
    where = where or {}
    missing = [r for r in range(world_size) if not published.get(r)]
    if missing:
        raise PrefixMismatch(
            f"memkv direct mode: worker rank(s) {missing} published no key prefix (a worker "
            f"failed to register its KV cache, or runs on another host than the scheduler)"
            f"{_published_on(published, where)}")
    return agreed({r: published[r] for r in range(world_size)}, where)


def agreed(published: Mapping[int, bytes | None], where: Mapping[int, str]) -> bytes:
    """The prefix of the lowest rank in `published`, if every rank there has the same; else
    raises PrefixMismatch naming the ranks that differ (with their hosts from `where`)."""
    ref_rank = min(published)
    ref = published[ref_rank]
    assert ref is not None
    bad = {r: p for r, p in published.items() if p != ref}
    if bad:
        shown = ", ".join(f"rank {r}{_on(where, r)}: {p.hex() if p else None}"
                          for r, p in sorted(bad.items()))
        raise PrefixMismatch(
            f"memkv direct mode: worker ranks disagree on the key prefix (rank {ref_rank}"
            f"{_on(where, ref_rank)}: {ref.hex()}; {shown}); their KV bytes for one block differ "
            f"(model files, dtype or layout), so they cannot share a namespace")
    return ref


def _on(where: Mapping[int, str], rank: int) -> str:
    return f" on {where[rank]}" if rank in where else ""


def _published_on(published: Mapping[int, bytes | None], where: Mapping[int, str]) -> str:
    hosts = {r: where[r] for r, p in published.items() if p and r in where}
    if not hosts:
        return ""
    return "; published: " + ", ".join(f"rank {r} on {h}" for r, h in sorted(hosts.items()))


# ------------------------------------------------------------------ who published an entry
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (None: no such process, or no
    /proc): with the pid it names one process, whatever pids the system reuses later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name


def _running(pid: int, pstart: int) -> bool:
    """Is the process that recorded (pid, pstart) still running? Without /proc (pstart 0) only
    the pid can be checked."""
    if pstart:
        return proc_start(pid) == pstart
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_started_at(pid: int | None = None) -> float:
    """Wall-clock time at which process `pid` (this one by default) started; 0.0 where /proc
    cannot tell."""
    start = proc_start(os.getpid() if pid is None else pid)
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    except (OSError, StopIteration):
        return 0.0
    return 0.0 if start is None else btime + start / os.sysconf("SC_CLK_TCK")


@attrs.frozen
class Entry:
    """What one rank published."""

    prefix: bytes
    host: str
    boot: str
    pid: int
    pstart: int  # proc_start(pid) when published
    published: float  # wall clock of the publishing host
    lease_s: float

    @classmethod
    def of_this_process(cls, prefix: bytes, lease_s: float) -> Entry:
        return cls(prefix=prefix, host=socket.gethostname(), boot=_boot_id(), pid=os.getpid(),
                   pstart=proc_start(os.getpid()) or 0, published=time.time(), lease_s=lease_s)

    def encode(self) -> bytes:
        raw = json.dumps({"v": 1, "prefix": self.prefix.hex(), "host": self.host,
                          "boot": self.boot, "pid": self.pid, "pstart": self.pstart,
                          "published": self.published, "lease_s": self.lease_s}).encode()
        if len(raw) > ENTRY_BYTES:
            raise ValueError(f"prefix-board entry of {len(raw)} bytes (host name too long?)")
        return raw.ljust(ENTRY_BYTES)

    @classmethod
    def decode(cls, raw: bytes) -> Entry | None:
        """The entry, or None for bytes that are not one (another writer's value)."""
        try:
            d = json.loads(raw)
            return cls(prefix=bytes.fromhex(d["prefix"]), host=str(d["host"]),
                       boot=str(d["boot"]), pid=int(d["pid"]), pstart=int(d["pstart"]),
                       published=float(d["published"]), lease_s=float(d["lease_s"]))
        except (ValueError, KeyError, TypeError):
            return None

    def where(self) -> str:
        return f"host {self.host} (pid {self.pid})"

    def stale_reason(self, since: float, now: float) -> str | None:
        """Why this entry belongs to no running engine started at `since` (None: it is live)."""
        age = now - self.published
        if age > self.lease_s:
            return f"expired: published {age:.0f} s ago, lease {self.lease_s:g} s"
        if (self.host, self.boot) == (socket.gethostname(), _boot_id()):
            if not _running(self.pid, self.pstart):
                return f"stale: its process {self.pid} has exited (a dead engine's entry)"
            return None  # a running process of this host: live whatever the clocks say
        if self.published < since - CLOCK_SKEW_S:
            return (f"stale: published {since - self.published:.0f} s before this engine "
                    f"started (a dead engine's entry, or clocks more than {CLOCK_SKEW_S:g} s "
                    f"apart)")
        return None


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"memkv-direct-{os.getuid()}"


@attrs.define
class _Reading:
    """One pass over the board: per rank a live entry, or why there is none."""

    live: dict[int, Entry] = attrs.Factory(dict)
    stale: dict[int, tuple[Entry, str]] = attrs.Factory(dict)
    unreadable: dict[int, str] = attrs.Factory(dict)  # rank -> the cluster's status

    def not_live(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.live]


class PrefixBoard:
    """The prefix board of one engine (see the module doc). `client`: the process's block client
    (its ``codes`` face is used) or None for the local files only."""

    def __init__(self, engine_id: str, client: Any = None, root: Path | None = None, *,
                 wait_s: float = DEFAULT_WAIT_S, lease_s: float = DEFAULT_LEASE_S,
                 since: float | None = None, spec_prefix: str = "") -> None:
        self.root = root or default_root()
        digest = hashlib.sha256(engine_id.encode()).digest()
        self._stem = digest.hex()[:32]
        self._key_base = spec_prefix.encode() + BOARD_MAGIC + digest[:16]
        self._codes = None if client is None else client.codes
        self.wait_s = wait_s
        self.lease_s = lease_s
        # When this engine started: its scheduler's process start (vLLM starts it before the
        # workers), unless the caller knows better.
        self.since = process_started_at() if since is None else since
        self._read_remote = False  # did the last adopt() read the cluster?

    def key(self, rank: int) -> bytes:
        """The cluster key of `rank`'s entry."""
        return self._key_base + rank.to_bytes(4, "big")

    def _path(self, rank: int) -> Path:
        return self.root / f"{self._stem}.rank{rank}"

    def _ensure_root(self) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            # Another user could plant a prefix here and redirect our reads and writes.
            raise PrefixMismatch(f"memkv direct mode: {self.root} is not private to this user")

    # ------------------------------------------------------------------ worker
    def publish(self, rank: int, prefix: bytes) -> None:
        """Worker: record this rank's prefix in this host's file (atomically: the scheduler never
        reads half) and in the cluster. A cluster that does not take it is logged, not raised:
        a scheduler on this host still reads the file."""
        raw = Entry.of_this_process(prefix, self.lease_s).encode()
        self._ensure_root()
        self._prune()
        path = self._path(rank)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=path.name + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self._codes is not None:
            buf = ctypes.create_string_buffer(raw, ENTRY_BYTES)
            try:
                st = self._codes.put_ptrs([self.key(rank)], [ctypes.addressof(buf)],
                                          [ENTRY_BYTES])[0]
                why = None if st == Status.OK else Status(st).name
            except Exception as e:  # the cluster's failure must not stop the worker
                why = f"error {e}"
            if why is not None:
                logger.warning("memkv direct worker rank %d: the cluster did not take the key "
                               "prefix (%s); a scheduler on another host will not find it",
                               rank, why)

    def _prune(self) -> None:
        """Removes files that processes of this host left behind when they died."""
        now = time.time()
        for p in self.root.glob("*.rank*"):
            with contextlib.suppress(OSError):
                e = Entry.decode(p.read_bytes())
                if e is None or e.stale_reason(0.0, now) is not None:
                    p.unlink()

    # ------------------------------------------------------------------ scheduler
    def read(self, world_size: int) -> dict[int, Entry | None]:
        """Every rank's entry, live or not (this host's file first, else the cluster's)."""
        out: dict[int, Entry | None] = dict(self._read_local(world_size))
        missing = [r for r in range(world_size) if out.get(r) is None]
        found, _ = self._read_cluster(missing)
        out.update(found)
        return {r: out.get(r) for r in range(world_size)}

    def _read_local(self, world_size: int) -> dict[int, Entry]:
        out: dict[int, Entry] = {}
        for r in range(world_size):
            try:
                e = Entry.decode(self._path(r).read_bytes())
            except FileNotFoundError:
                continue
            if e is not None:
                out[r] = e
        return out

    def _read_cluster(self, ranks: Sequence[int]) -> tuple[dict[int, Entry], dict[int, str]]:
        """(entries found, rank -> status for those the cluster could not answer)."""
        if self._codes is None or not ranks:
            return {}, {}
        bufs = [ctypes.create_string_buffer(ENTRY_BYTES) for _ in ranks]
        try:
            codes = self._codes.get_into_ptrs([self.key(r) for r in ranks],
                                              [ctypes.addressof(b) for b in bufs],
                                              [ENTRY_BYTES] * len(ranks))
        except Exception as e:
            return {}, {r: f"error {e}" for r in ranks}
        found: dict[int, Entry] = {}
        failed: dict[int, str] = {}
        for r, b, st in zip(ranks, bufs, codes, strict=True):
            entry = Entry.decode(b.raw) if st == Status.OK else None
            if entry is not None:
                found[r] = entry
            elif st not in (Status.OK, Status.NOT_FOUND, Status.LENGTH_MISMATCH):
                failed[r] = Status(st).name
        return found, failed

    def _reading(self, world_size: int) -> _Reading:
        out = _Reading()
        now = time.time()

        def take(r: int, e: Entry) -> None:
            why = e.stale_reason(self.since, now)
            if why is None:
                out.live[r] = e
                out.stale.pop(r, None)
            else:
                out.stale[r] = (e, why)

        for r, e in self._read_local(world_size).items():
            take(r, e)
        remote = out.not_live(world_size)
        self._read_remote = self._read_remote or bool(remote)
        found, out.unreadable = self._read_cluster(remote)
        for r, e in found.items():
            take(r, e)
        return out

    def adopt(self, world_size: int) -> bytes:
        """Scheduler: the agreed prefix (see the module doc), waiting at most `wait_s` (plus the
        last read's `op_timeout_s` where the cluster does not answer) for ranks without a live
        entry. The entries are removed either way, so a later engine with the same id never
        reads them."""
        self._read_remote = False
        try:
            return self._adopt(world_size)
        finally:
            for r in range(world_size):
                self._path(r).unlink(missing_ok=True)
            if self._codes is not None:
                keys = [self.key(r) for r in range(world_size)]
                if self._read_remote:
                    self._remove(keys)  # the cluster just answered: quick
                else:
                    # Every rank was on this host: the start must not wait for a cluster that
                    # may be partitioned away to remove the workers' copies.
                    threading.Thread(target=self._remove, args=(keys,), daemon=True,
                                     name="memkv-board-remove").start()

    def _remove(self, keys: list[bytes]) -> None:
        assert self._codes is not None
        with contextlib.suppress(Exception):  # housekeeping only: a lease expires the rest
            self._codes.delete(keys)

    def _adopt(self, world_size: int) -> bytes:
        deadline = time.monotonic() + self.wait_s
        while True:
            reading = self._reading(world_size)
            where = {r: e.where() for r, e in reading.live.items()}
            # Live ranks that disagree stop the start at once: waiting cannot change them.
            if len({e.prefix for e in reading.live.values()}) > 1:
                return agreed({r: e.prefix for r, e in reading.live.items()}, where)
            if not reading.not_live(world_size):
                return adopt({r: e.prefix for r, e in reading.live.items()}, world_size, where)
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        waiting = reading.not_live(world_size)
        if reading.live and set(waiting) <= set(reading.unreadable):
            prefix = next(iter(reading.live.values())).prefix
            logger.warning(
                "memkv direct: the cluster could not be read for rank(s) %s (%s); adopting the "
                "key prefix %s of rank(s) %s unchecked: a rank that disagrees will miss its "
                "loads, never load wrong bytes", waiting,
                ", ".join(f"{r}: {s}" for r, s in sorted(reading.unreadable.items())),
                prefix.hex(), sorted(reading.live))
            return prefix
        raise PrefixMismatch(self._why_not(reading, world_size))

    def _why_not(self, reading: _Reading, world_size: int) -> str:
        parts = []
        for r in reading.not_live(world_size):
            if r in reading.stale:
                e, why = reading.stale[r]
                parts.append(f"rank {r}: only an entry from {e.where()}, {why}")
            elif r in reading.unreadable:
                parts.append(f"rank {r}: the cluster did not answer ({reading.unreadable[r]})")
            else:
                parts.append(f"rank {r}: no entry, its node published nothing")
        live = ", ".join(f"rank {r} on {e.where()}" for r, e in sorted(reading.live.items()))
        return (f"memkv direct mode: worker rank(s) {reading.not_live(world_size)} published no "
                f"live key prefix within {self.wait_s:g} s ({'; '.join(parts)}). Published: "
                f"{live or 'none'}; this scheduler runs on host {socket.gethostname()}. Ranks "
                f"on other hosts publish through the cluster: check that every node uses the "
                f"same memkv servers and the same kv_transfer_config engine_id (vLLM draws one "
                f"per node unless it is set)")
