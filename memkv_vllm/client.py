"""Typed Python client for a memkv cluster, over the Rust extension ``memkv_vllm._native``.

Values move between the caller's memory and the sockets with no Python copy: torch tensors,
numpy arrays and any buffer-protocol object are turned into (address, length) pairs, and the
owning objects are kept alive until the native I/O that uses them is finished. Blocking calls
release the GIL; ``submit_*`` calls run on native I/O threads and return an :class:`Op`.

A server that is down, slow or misbehaving never raises here: its keys come back with a status
that says what happened (``TIMEOUT``, ``REFUSED``, ``AUTH_FAILED``, ``PROTOCOL_ERROR``, or
``UNAVAILABLE`` while the server is marked down after such a failure), and the caller decides what
to do. A server going down is logged once, with the reason, on the ``memkv_client`` logger (and
coming back once); :meth:`MemKVClient.stats` and :meth:`MemKVClient.health` show the reason too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from memkv_vllm import _native
from memkv_vllm.config import MemKVConfig, load_config
from memkv_vllm.interface import Status

__all__ = ["MAX_KEY_LEN", "MemKVClient", "Op", "Status", "buffer_address"]

log = logging.getLogger(__name__)

MAX_KEY_LEN: int = _native.MAX_KEY_LEN


def buffer_address(obj: Any, writable: bool) -> tuple[int, int]:
    """(address, byte length) of a contiguous CPU buffer: torch tensor, numpy array, or any
    object with the buffer protocol. Raises ValueError for memory we cannot safely use."""
    # torch.Tensor, recognised without importing torch
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if obj.device.type != "cpu":
            raise ValueError(f"tensor on {obj.device}: the TCP transport needs host memory")
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    import numpy as np

    arr = obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, dtype=np.uint8)
    if not arr.flags["C_CONTIGUOUS"]:
        raise ValueError("array is not C-contiguous")
    if writable and not arr.flags["WRITEABLE"]:
        raise ValueError("buffer is read-only; get_into needs writable memory")
    return int(arr.ctypes.data), int(arr.nbytes)


def _statuses(codes: Sequence[int]) -> list[Status]:
    return [Status(c) for c in codes]


class Op:
    """A submitted batch. ``wait`` returns per-key statuses, or None on timeout; it raises
    RuntimeError only if the native operation hit a bug (a Rust panic), never for a failed
    server."""

    __slots__ = ("_op", "_exists")

    def __init__(self, op: Any, exists: bool = False) -> None:
        self._op = op
        self._exists = exists

    def done(self) -> bool:
        return bool(self._op.done())

    def wait(self, timeout: float | None = None) -> list[Status] | None:
        if self._exists:
            lengths = self.wait_lengths(timeout)
            return None if lengths is None else [s for s, _ in lengths]
        r = self._op.wait(timeout)
        return None if r is None else _statuses(r)

    def wait_lengths(self, timeout: float | None = None) -> list[tuple[Status, int]] | None:
        """For EXISTS ops: (status, stored value length) per key."""
        r = self._op.wait(timeout)
        if r is None:
            return None
        return [(Status(s), n) for s, n in r]


class MemKVClient:
    """Batched exists/put/get/delete against a cluster; keys are sharded by rendezvous hashing."""

    def __init__(self, config: MemKVConfig, io_threads: int | None = None) -> None:
        """Raises ValueError for a setting this build cannot honour (``transport: rdma``)."""
        self.config = config
        self._c = _native.Client(
            list(config.servers),
            config.auth_key,
            config.connections_per_server,
            config.connect_timeout_s,
            config.op_timeout_s,
            io_threads or config.io_threads,
            config.transport,
            list(config.rdma_devices),
        )

    @classmethod
    def from_config(
        cls, cfg: MemKVConfig | None = None, io_threads: int | None = None
    ) -> MemKVClient:
        return cls(cfg if cfg is not None else load_config(), io_threads)

    # -- blocking calls (GIL released during I/O) ------------------------------------------

    def exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> list[Status]:
        return [s for s, _ in self.exists_lengths(keys, lease_ms)]

    def exists_lengths(self, keys: Sequence[bytes], lease_ms: int = 0) -> list[tuple[Status, int]]:
        return [(Status(s), n) for s, n in self._c.exists(list(keys), lease_ms)]

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[Status]:
        ptrs, sizes = self._addresses(values, writable=False)
        return _statuses(self._c.put(list(keys), ptrs, sizes))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        ptrs, sizes = self._addresses(buffers, writable=True)
        return _statuses(self._c.get_into(list(keys), ptrs, sizes))

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[Status]:
        """Stores ``sizes[i]`` bytes at address ``ptrs[i]`` under ``keys[i]``.

        UNSAFE: nothing checks the addresses. The caller guarantees that every range is readable
        memory that stays valid and unchanged until this blocking call returns.
        """
        return _statuses(self._c.put(list(keys), list(ptrs), list(sizes)))

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> list[Status]:
        """Reads ``keys[i]`` into ``sizes[i]`` bytes at address ``ptrs[i]``.

        UNSAFE: nothing checks the addresses. The caller guarantees that every range is
        writable memory, not overlapping the others, that stays valid and that nobody else
        reads or writes until this blocking call returns. A range is written only once its key
        answered OK with exactly its size; a transfer that then fails part-way (TIMEOUT,
        UNAVAILABLE, PROTOCOL_ERROR) may leave part of the value in that key's range. Nothing is
        written after the call returns.
        """
        return _statuses(self._c.get_into(list(keys), list(ptrs), list(sizes)))

    def delete(self, keys: Sequence[bytes]) -> list[Status]:
        return _statuses(self._c.delete(list(keys)))

    # -- submitted calls (native I/O threads; owners kept alive until done) ------------------

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> Op:
        return Op(self._c.submit_exists(list(keys), lease_ms), exists=True)

    def submit_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> Op:
        ptrs, sizes = self._addresses(values, writable=False)
        return Op(self._c.submit_put(list(keys), ptrs, sizes, list(values)))

    def submit_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> Op:
        ptrs, sizes = self._addresses(buffers, writable=True)
        return Op(self._c.submit_get_into(list(keys), ptrs, sizes, list(buffers)))

    # -- cluster -------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per server address, plus ``"client"``: this client's view of the server
        (see :meth:`health`). A server that does not answer maps to ``{"error": why, "client":
        ...}``."""
        rows = self._c.stats()
        health = self.health()  # after the requests, so it includes what they found
        out: dict[str, dict[str, Any]] = {}
        for addr, text, err in rows:
            out[addr] = json.loads(text) if text is not None else {"error": err}
            out[addr]["client"] = health[addr]
        return out

    def health(self) -> dict[str, dict[str, Any]]:
        """Per server, without contacting it: ``up`` (False from a transport failure until a
        request succeeds again), and the last failure (``last_failure``: the status name,
        ``reason``: its text, ``failure_age_s``: seconds since), or None if none happened."""
        out: dict[str, dict[str, Any]] = {}
        for addr, up, code, reason, age in self._c.health():
            out[addr] = {
                "up": up,
                "last_failure": None if code is None else Status(code).name,
                "reason": reason,
                "failure_age_s": age,
            }
        return out

    def ping(self) -> dict[str, float | None]:
        """Round-trip seconds per server, None for a server that does not answer."""
        return {addr: secs for addr, secs, _ in self._c.ping()}

    def server_of(self, key: bytes) -> str:
        return self.config.servers[self._c.server_of(key)]

    def close(self) -> None:
        """Drops the connections (once the I/O threads finish what was submitted)."""
        self._c = None  # type: ignore[assignment]

    @staticmethod
    def _addresses(objs: Sequence[Any], writable: bool) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        sizes: list[int] = []
        for o in objs:
            p, n = buffer_address(o, writable)
            ptrs.append(p)
            sizes.append(n)
        return ptrs, sizes
