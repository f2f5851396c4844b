"""A fake `BlockClient` (an in-memory cluster that really moves bytes) and a hand-driven clock,
for testing the `Offloader` contract without a server, vLLM or sleeps."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence

from memkv_vllm.core.interface import Status


class FakeClock:
    """`BlockStore(clock=...)`: time moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProbe:
    """A probe the test answers (`answer()`) or leaves hanging."""

    def __init__(self, client: FakeClient, keys: list[bytes]) -> None:
        self.client, self.keys = client, keys
        self.statuses: list[int] | None = None

    def answer(self) -> None:
        with self.client.lock:
            self.statuses = [Status.OK if k in self.client.data else Status.NOT_FOUND
                             for k in self.keys]

    def done(self) -> bool:
        return self.statuses is not None

    def wait(self, timeout: float | None = None) -> list[int] | None:
        return self.statuses


class FakeClient:
    """In-memory cluster. Transfers copy real bytes between it and the given addresses.

    Knobs: `fail[key] = status` makes transfers of that key return it without moving bytes;
    `gate` (an Event) makes transfers wait until it is set; `during_call(n_keys)` runs inside
    each transfer (e.g. to advance a FakeClock); `auto_answer` answers probes at once.
    """

    def __init__(self, auto_answer: bool = True) -> None:
        self.data: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.fail: dict[bytes, int] = {}
        self.raise_on_transfer = False
        self.gate: threading.Event | None = None
        self.during_call: Callable[[int], None] | None = None
        self.auto_answer = auto_answer
        self.probes: list[FakeProbe] = []
        self.transfers: list[tuple[str, list[bytes]]] = []

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> FakeProbe:
        p = FakeProbe(self, list(keys))
        self.probes.append(p)
        if self.auto_answer:
            p.answer()
        return p

    def _transfer(self, op: str, keys: Sequence[bytes], ptrs: Sequence[int],
                  sizes: Sequence[int]) -> list[int]:
        if self.gate is not None:
            self.gate.wait()
        if self.during_call is not None:
            self.during_call(len(keys))
        if self.raise_on_transfer:
            raise OSError("connection reset")
        out = []
        with self.lock:
            self.transfers.append((op, list(keys)))
            for k, p, n in zip(keys, ptrs, sizes, strict=True):
                if k in self.fail:
                    out.append(self.fail[k])
                elif op == "put":
                    self.data[k] = ctypes.string_at(p, n)
                    out.append(Status.OK)
                elif k not in self.data:
                    out.append(Status.NOT_FOUND)
                elif len(self.data[k]) != n:
                    out.append(Status.LENGTH_MISMATCH)
                else:
                    ctypes.memmove(p, self.data[k], n)
                    out.append(Status.OK)
        return out

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> list[int]:
        return self._transfer("get", keys, ptrs, sizes)

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[int]:
        return self._transfer("put", keys, ptrs, sizes)

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        with self.lock:
            self.transfers.append(("delete", list(keys)))
            return [Status.OK if self.data.pop(k, None) is not None else Status.NOT_FOUND
                    for k in keys]


class RegisteringFakeClient(FakeClient):
    """A FakeClient whose transport wants memory registered, and checks that it was."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("register", ptr))
        self.registered[ptr] = nbytes

    def unregister_buffer(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]

    def _transfer(self, op: str, keys: Sequence[bytes], ptrs: Sequence[int],
                  sizes: Sequence[int]) -> list[int]:
        for p, n in zip(ptrs, sizes, strict=True):
            assert any(b <= p and p + n <= b + size for b, size in self.registered.items()), (
                "transfer outside registered memory")
        return super()._transfer(op, keys, ptrs, sizes)


class ShardedFakeClient(FakeClient):
    """A FakeClient of several servers (`ShardedClient`): a key lives on the server named by its
    first byte, so a test decides which probe answers and which one hangs."""

    def by_server(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        groups: dict[int, list[bytes]] = {}
        for k in keys:
            groups.setdefault(k[0], []).append(k)
        return list(groups.values())
