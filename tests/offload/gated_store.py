"""`GatedStore`: a stand-in for the `BlockStore` under a `KVOffloader` whose I/O finishes only
when the test answers it, over the in-memory cluster of tests/fakes.py (real bytes move between
the offloader's scratch slots and that cluster). A test of the offloader then decides which values
are on the network, which arrive, and in what order: no server, no sleeps, no timing."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
from fakes import FakeClient

from memkv_vllm.core.interface import Completion, Status
from memkv_vllm.offload import KVOffloader


@attrs.frozen
class IO:
    """One store call the offloader made: a batch of values on the network."""

    io_id: int
    is_load: bool
    keys: tuple[bytes, ...]
    ptrs: tuple[int, ...]
    sizes: tuple[int, ...]


class GatedStore:
    """The store calls `KVOffloader` makes (register_buffer, submit_*, poll, wait_any, close).
    Submitted I/O waits in `in_flight()` until `answer` finishes it."""

    def __init__(self, client: FakeClient | None = None) -> None:
        self.client = client if client is not None else FakeClient()
        self._cv = threading.Condition()
        self._in_flight: dict[int, IO] = {}  # in submit order
        self._answered: list[Completion] = []  # not taken by `poll` yet
        self.closed = False

    def register_buffer(self, ptr: int, nbytes: int, owner: object = None) -> None:
        pass  # the fake cluster copies from and to any address

    def mapped_reads(self, register: object, unregister: object) -> str | None:
        return "the gated store only moves values through scratch slots"

    def submit_load(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                    sizes: Sequence[int]) -> None:
        self._submit(True, job_id, keys, ptrs, sizes)

    def submit_store(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                     sizes: Sequence[int]) -> None:
        self._submit(False, job_id, keys, ptrs, sizes)

    def _submit(self, is_load: bool, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                sizes: Sequence[int]) -> None:
        with self._cv:
            assert job_id not in self._in_flight, f"I/O id {job_id} submitted twice"
            self._in_flight[job_id] = IO(job_id, is_load, tuple(keys), tuple(ptrs), tuple(sizes))

    def in_flight(self) -> list[IO]:
        with self._cv:
            return list(self._in_flight.values())

    def answer(self, io_id: int, ok: bool = True) -> None:
        """Finish one I/O. `ok`: the fake cluster moves the bytes (a key it lacks fails, as
        NOT_FOUND); otherwise every value fails (as a timeout would) and no byte moves."""
        self.answer_together([io_id], ok)

    def answer_together(self, io_ids: Sequence[int], ok: bool = True) -> None:
        """Finish several I/Os as `answer` does, all visible to the same `poll`."""
        done = [self._finish(i, ok) for i in io_ids]
        with self._cv:
            self._answered.extend(done)
            self._cv.notify_all()

    def _finish(self, io_id: int, ok: bool) -> Completion:
        with self._cv:
            io = self._in_flight.pop(io_id)
        if not ok:
            statuses = [Status.TIMEOUT] * len(io.keys)
        elif io.is_load:
            statuses = self.client.get_into_ptrs(io.keys, io.ptrs, io.sizes)
        else:
            statuses = self.client.put_ptrs(io.keys, io.ptrs, io.sizes)
        good = [Status.is_ok(s) for s in statuses]
        ok_keys = tuple(k for k, g in zip(io.keys, good, strict=True) if g)
        nbytes = sum(n for n, g in zip(io.sizes, good, strict=True) if g)
        return Completion(io_id, io.is_load, all(good), ok_keys, nbytes, 0.0)

    def poll(self) -> list[Completion]:
        with self._cv:
            out, self._answered = self._answered, []
            self._cv.notify_all()
        return out

    def wait_any(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._answered), timeout)

    def wait_taken(self, timeout: float = 10.0) -> bool:
        """BLOCKING: until `poll` has taken every answer."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._answered, timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True


def deliver(off: KVOffloader, store: GatedStore, io_id: int, ok: bool = True) -> None:
    """Answer one I/O and return once `off` has acted on it. The offloader polls the store only
    under its lock and keeps holding it until it has scattered, settled and started the next
    batches; so once the answer is taken, any public call (all of them take the lock, its lock
    rule) returns only after that step, and the next `in_flight()` is exact."""
    store.answer(io_id, ok)
    assert store.wait_taken(), "the offloader never took the answer"
    off.has_pending_jobs()
