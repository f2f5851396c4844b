"""Typed Python client for a memkv cluster, over the Rust extension ``memkv_vllm._native``.

Values move between the caller's memory and the sockets with no Python copy: torch tensors,
numpy arrays and any buffer-protocol object are turned into (address, length) pairs, and the
owning objects are kept alive until the native I/O that uses them is finished. Blocking calls
release the GIL; ``submit_*`` calls run on native I/O threads and return an :class:`Op`; given a
completion queue (``completion_queue()``) and a tag, each also pushes its tag onto the queue once
it completed, so one thread waits for many (``queue.wait(timeout)``, GIL released) and collects
each Op with ``wait(0)``: the block store's path (`memkv_vllm.core.interface.AsyncBlockClient`).

A server that is down, slow or misbehaving never raises here: its keys come back with a status
that says what happened (``TIMEOUT``, ``REFUSED``, ``AUTH_FAILED``, ``PROTOCOL_ERROR``, or
``UNAVAILABLE`` while the server is marked down after such a failure), and the caller decides what
to do. A server going down is logged once, with the reason, on the ``memkv_client`` logger (and
coming back once); :meth:`MemKVClient.stats` and :meth:`MemKVClient.health` show the reason too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from memkv_vllm import _native
from memkv_vllm.core.config import MemKVConfig, load_config
from memkv_vllm.core.interface import Status

__all__ = ["MAX_KEY_LEN", "CodesClient", "CodesOp", "MemKVClient", "Op", "Status", "Tenant",
           "buffer_address"]

log = logging.getLogger(__name__)

MAX_KEY_LEN: int = _native.MAX_KEY_LEN


def buffer_address(obj: Any, writable: bool) -> tuple[int, int]:
    """(address, byte length) of a contiguous buffer: torch tensor (host, or CUDA for a client
    whose transport reaches GPU memory: the native client checks), numpy array, or any object
    with the buffer protocol. Raises ValueError for memory we cannot safely use."""
    # torch.Tensor, recognised without importing torch
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if obj.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor on {obj.device}: memkv moves host or CUDA memory only")
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


# Status(c) goes through the enum machinery (about a microsecond per key); a dict lookup per
# code makes the enum lists nearly as cheap as the codes. The native client only produces these
# numbers (tests/test_client.py checks the two lists agree).
_STATUS_OF: dict[int, Status] = {s.value: s for s in Status}


def _statuses(codes: bytes) -> list[Status]:
    return list(map(_STATUS_OF.__getitem__, codes))


@attrs.frozen
class Tenant:
    """The tenant our credential names on a server started with ``--tenants``: every key we
    name there must start with ``prefix`` (others answer FORBIDDEN); a ``read_only`` tenant's
    writes answer FORBIDDEN too."""

    name: str
    prefix: bytes
    read_only: bool


class CodesOp:
    """A submitted batch answering in status codes: ``wait`` returns one ``bytes`` (byte i is key
    i's :class:`Status` number), or None on timeout; it raises RuntimeError only if the native
    operation hit a bug (a Rust panic), never for a failed server."""

    __slots__ = ("_op",)

    def __init__(self, op: _native.Op) -> None:
        self._op = op

    def done(self) -> bool:
        return self._op.done()

    def wait(self, timeout: float | None = None) -> bytes | None:
        return self._op.wait(timeout)

    def wait_lengths(self, timeout: float | None = None) -> tuple[bytes, list[int]] | None:
        """For EXISTS ops: (status codes, stored value length per key)."""
        return self._op.wait_lengths(timeout)

    def wait_mapped(self, timeout: float | None = None) -> tuple[bytes, list[int], int] | None:
        """For mapped reads: (status codes, address of each OK value, ticket)."""
        return self._op.wait_mapped(timeout)


class Op:
    """A submitted batch. ``wait`` returns per-key statuses, or None on timeout; it raises
    RuntimeError only if the native operation hit a bug (a Rust panic), never for a failed
    server."""

    __slots__ = ("codes",)

    def __init__(self, codes: CodesOp) -> None:
        self.codes = codes  # the same batch answering in status codes

    def done(self) -> bool:
        return self.codes.done()

    def wait(self, timeout: float | None = None) -> list[Status] | None:
        r = self.codes.wait(timeout)
        return None if r is None else _statuses(r)

    def wait_lengths(self, timeout: float | None = None) -> list[tuple[Status, int]] | None:
        """For EXISTS ops: (status, stored value length) per key."""
        r = self.codes.wait_lengths(timeout)
        return None if r is None else list(zip(_statuses(r[0]), r[1], strict=True))


class CodesClient:
    """The batch calls of a :class:`MemKVClient` (``client.codes``), answering with ONE ``bytes``
    of status codes per batch: byte i is key i's :class:`Status` number. No Python object is made
    per key, so a batched check of thousands of keys costs what the native call costs; callers
    that compare numbers (the block store, ``codes[i] == Status.OK``) use this. Implements
    :class:`memkv_vllm.core.interface.BlockClient` and
    :class:`memkv_vllm.core.interface.AsyncBlockClient`."""

    __slots__ = ("_c", "_n_servers")

    def __init__(self, native: _native.Client) -> None:
        self._c = native
        self._n_servers = len(native.servers())

    # -- blocking calls (GIL released during I/O) ------------------------------------------

    def exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> bytes:
        return self._c.exists(keys, lease_ms)

    def exists_lengths(self, keys: Sequence[bytes], lease_ms: int = 0
                       ) -> tuple[bytes, list[int]]:
        return self._c.exists_lengths(keys, lease_ms)

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> bytes:
        ptrs, sizes = _addresses(values, writable=False)
        return self._c.put(list(keys), ptrs, sizes)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> bytes:
        ptrs, sizes = _addresses(buffers, writable=True)
        return self._c.get_into(list(keys), ptrs, sizes)

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> bytes:
        """UNSAFE, as :meth:`MemKVClient.put_ptrs`."""
        return self._c.put(list(keys), list(ptrs), list(sizes))

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> bytes:
        """UNSAFE, as :meth:`MemKVClient.get_into_ptrs`."""
        return self._c.get_into(list(keys), list(ptrs), list(sizes))

    def delete(self, keys: Sequence[bytes]) -> bytes:
        return self._c.delete(keys)

    def by_server(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """`keys` grouped by owning server (`ShardedClient`): the block store probes each group
        on its own, so a partitioned server delays only its own keys' verdicts."""
        if self._n_servers == 1:
            return [list(keys)] if keys else []
        groups: dict[int, list[bytes]] = {}
        server_of = self._c.server_of
        for k in keys:
            groups.setdefault(server_of(k), []).append(k)
        return list(groups.values())

    # -- submitted calls (native I/O threads; owners kept alive until done) ------------------

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> CodesOp:
        return CodesOp(self._c.submit_exists(keys, lease_ms))

    def submit_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> CodesOp:
        ptrs, sizes = _addresses(values, writable=False)
        return CodesOp(self._c.submit_put(list(keys), ptrs, sizes, list(values)))

    def submit_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> CodesOp:
        ptrs, sizes = _addresses(buffers, writable=True)
        return CodesOp(self._c.submit_get_into(list(keys), ptrs, sizes, list(buffers)))

    # -- submitted raw-pointer calls announced on a completion queue (AsyncBlockClient) ------

    def completion_queue(self) -> _native.CompletionQueue:
        """A queue the native I/O threads push each tagged op's tag onto once it completed."""
        return _native.CompletionQueue()

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: _native.CompletionQueue | None = None, tag: int = 0) -> CodesOp:
        """UNSAFE, as :meth:`MemKVClient.put_ptrs`, until the op is done: the memory must stay
        valid and unchanged until then; nothing reads it afterwards."""
        return CodesOp(self._c.submit_put(list(keys), list(ptrs), list(sizes), None, queue, tag))

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: _native.CompletionQueue | None = None,
                             tag: int = 0) -> CodesOp:
        """UNSAFE, as :meth:`MemKVClient.get_into_ptrs`, until the op is done: nothing writes
        the memory once it is (TIMEOUT included)."""
        return CodesOp(self._c.submit_get_into(list(keys), list(ptrs), list(sizes), None, queue,
                                               tag))

    def submit_delete(self, keys: Sequence[bytes], queue: _native.CompletionQueue | None = None,
                      tag: int = 0) -> CodesOp:
        return CodesOp(self._c.submit_delete(keys, queue, tag))

    def enable_mapped_reads(self, register: Callable[[int, int], None],
                            unregister: Callable[[int, int], None]) -> list[str | None]:
        """Map every same-host server's value memory (servers started with
        ``--shm-share-values``), calling ``register(ptr, nbytes)`` for each mapping and
        ``unregister(ptr, nbytes)`` before one goes; per server None, or why not."""
        return self._c.enable_mapped_reads(register, unregister)

    def submit_get_mapped(self, keys: Sequence[bytes], sizes: Sequence[int],
                          queue: _native.CompletionQueue | None = None,
                          tag: int = 0) -> CodesOp:
        """Where each value lies in this process, pinned until its ticket is released
        (``CodesOp.wait_mapped``)."""
        return CodesOp(self._c.submit_get_mapped(list(keys), [int(n) for n in sizes], queue, tag))

    def submit_release_mapped(self, ticket: int, queue: _native.CompletionQueue | None = None,
                              tag: int = 0) -> CodesOp:
        """Ends a mapped read's pins; its one status is OK when they held throughout."""
        return CodesOp(self._c.submit_release_mapped(int(ticket), queue, tag))

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """As :meth:`MemKVClient.register_buffer`: a block store holding this face registers
        its buffers (a pool, scratch slots) with the transport through it."""
        self._c.register_buffer(int(ptr), int(nbytes))

    def unregister_buffer(self, ptr: int) -> None:
        """As :meth:`MemKVClient.unregister_buffer`."""
        self._c.unregister_buffer(int(ptr))

    def close(self) -> None:
        """Drops the connections (once the I/O threads finish what was submitted), also for
        holders of this object such as a block store."""
        self._c = None  # type: ignore[assignment]  # closed: a later call fails on None


def _addresses(objs: Sequence[Any], writable: bool) -> tuple[list[int], list[int]]:
    ptrs: list[int] = []
    sizes: list[int] = []
    for o in objs:
        p, n = buffer_address(o, writable)
        ptrs.append(p)
        sizes.append(n)
    return ptrs, sizes


class MemKVClient:
    """Batched exists/put/get/delete against a cluster; keys are sharded by rendezvous hashing.

    Batch calls answer with a :class:`Status` per key; ``codes`` (a :class:`CodesClient`) makes
    the same calls answering with one ``bytes`` of codes per batch, the fast path."""

    def __init__(self, config: MemKVConfig, io_threads: int | None = None,
                 gpu_memory: bool = False) -> None:
        """Raises ValueError for a setting this host cannot honour (``transport: rdma`` without
        libfabric or without a provider domain matching ``rdma_devices``). ``gpu_memory`` asks
        the RDMA provider for a domain that also registers GPU memory (see :meth:`gpu_memory`);
        a provider without one still serves host memory."""
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
            gpu_memory,
            tls_ca=config.tls_ca,
            tls_server_name=config.tls_server_name,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
            tls_allow_rdma=config.tls_allow_rdma,
        )
        self.codes = CodesClient(self._c)

    @classmethod
    def from_config(
        cls, cfg: MemKVConfig | None = None, io_threads: int | None = None,
        gpu_memory: bool = False,
    ) -> MemKVClient:
        return cls(cfg if cfg is not None else load_config(), io_threads, gpu_memory)

    # -- blocking calls (GIL released during I/O) ------------------------------------------

    def exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> list[Status]:
        return _statuses(self.codes.exists(keys, lease_ms))

    def exists_lengths(self, keys: Sequence[bytes], lease_ms: int = 0) -> list[tuple[Status, int]]:
        st, lens = self.codes.exists_lengths(keys, lease_ms)
        return list(zip(_statuses(st), lens, strict=True))

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[Status]:
        return _statuses(self.codes.put(keys, values))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[Status]:
        return _statuses(self.codes.get_into(keys, buffers))

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[Status]:
        """Stores ``sizes[i]`` bytes at address ``ptrs[i]`` under ``keys[i]``.

        UNSAFE: nothing checks the addresses. The caller guarantees that every range is readable
        memory that stays valid and unchanged until this blocking call returns.
        """
        return _statuses(self.codes.put_ptrs(keys, ptrs, sizes))

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
        return _statuses(self.codes.get_into_ptrs(keys, ptrs, sizes))

    def delete(self, keys: Sequence[bytes]) -> list[Status]:
        return _statuses(self.codes.delete(keys))

    def by_server(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """As :meth:`CodesClient.by_server`."""
        return self.codes.by_server(keys)

    # -- submitted calls (native I/O threads; owners kept alive until done) ------------------

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> Op:
        return Op(self.codes.submit_exists(keys, lease_ms))

    def submit_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> Op:
        return Op(self.codes.submit_put(keys, values))

    def submit_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> Op:
        return Op(self.codes.submit_get_into(keys, buffers))

    # -- submitted raw-pointer calls announced on a completion queue (AsyncBlockClient) ------

    def completion_queue(self) -> _native.CompletionQueue:
        """As :meth:`CodesClient.completion_queue`."""
        return self.codes.completion_queue()

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: _native.CompletionQueue | None = None, tag: int = 0) -> Op:
        """UNSAFE, as :meth:`CodesClient.submit_put_ptrs`."""
        return Op(self.codes.submit_put_ptrs(keys, ptrs, sizes, queue, tag))

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: _native.CompletionQueue | None = None,
                             tag: int = 0) -> Op:
        """UNSAFE, as :meth:`CodesClient.submit_get_into_ptrs`."""
        return Op(self.codes.submit_get_into_ptrs(keys, ptrs, sizes, queue, tag))

    def submit_delete(self, keys: Sequence[bytes], queue: _native.CompletionQueue | None = None,
                      tag: int = 0) -> Op:
        return Op(self.codes.submit_delete(keys, queue, tag))

    def enable_mapped_reads(self, register: Callable[[int, int], None],
                            unregister: Callable[[int, int], None]) -> list[str | None]:
        """As :meth:`CodesClient.enable_mapped_reads`."""
        return self.codes.enable_mapped_reads(register, unregister)

    def submit_get_mapped(self, keys: Sequence[bytes], sizes: Sequence[int],
                          queue: _native.CompletionQueue | None = None, tag: int = 0) -> CodesOp:
        """As :meth:`CodesClient.submit_get_mapped` (statuses as codes: the block store's
        face)."""
        return self.codes.submit_get_mapped(keys, sizes, queue, tag)

    def submit_release_mapped(self, ticket: int, queue: _native.CompletionQueue | None = None,
                              tag: int = 0) -> CodesOp:
        """As :meth:`CodesClient.submit_release_mapped`."""
        return self.codes.submit_release_mapped(ticket, queue, tag)

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

    def tenants(self) -> dict[str, Tenant | None]:
        """The tenant our credential names on each server, from a connection's handshake (made
        now if none is open): None from a server without tenants. A server that does not answer
        is left out (logged): what it would say is not known."""
        out: dict[str, Tenant | None] = {}
        for addr, t, err in self._c.tenants():
            if err is not None:
                log.warning("memkv: cannot ask %s for our tenant: %s", addr, err)
                continue
            out[addr] = None if t is None else Tenant(*t)
        return out

    def ping(self) -> dict[str, float | None]:
        """Round-trip seconds per server, None for a server that does not answer."""
        return {addr: secs for addr, secs, _ in self._c.ping()}

    def server_of(self, key: bytes) -> str:
        return self.config.servers[self._c.server_of(key)]

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Registers [ptr, ptr + nbytes) with the RDMA transport once, as one region its blocks
        share (`RegisteringClient`); a no-op over TCP. With transport shm/auto, memory that is a
        shared mapping of a memfd or /dev/shm file (the tier's CPU pool) becomes a region local
        servers copy values into and out of (docs/shm.md); other memory moves over the socket.
        Raises ValueError if the fabric refuses."""
        self._c.register_buffer(int(ptr), int(nbytes))

    def unregister_buffer(self, ptr: int) -> None:
        """Undoes `register_buffer(ptr, ...)`; no transfer touching the region may be running."""
        self._c.unregister_buffer(int(ptr))

    def gpu_memory(self) -> tuple[bool, str]:
        """``(True, how)`` when transfers and `register_buffer` may name CUDA device memory (the
        transport is RDMA and its provider registers GPU memory, FI_HMEM; asked for with
        ``gpu_memory=True``), else ``(False, why not)``. Device memory it cannot move is refused
        with ValueError before any byte moves."""
        return self._c.gpu_memory()

    def rdma_provider(self) -> str | None:
        """The libfabric provider values move through (``verbs``, ``shm``, ...); None over TCP."""
        return self._c.rdma_provider()

    def close(self) -> None:
        """Drops the connections (once the I/O threads finish what was submitted)."""
        self.codes.close()
        self._c = None  # type: ignore[assignment]  # closed: a later call fails on None
