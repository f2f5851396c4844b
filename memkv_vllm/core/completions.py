"""Submitted operations announced on a completion queue, for clients whose I/O runs in Python.

The native client (`memkv_vllm._native`) runs submitted operations on its own I/O threads and
announces each on a `_native.CompletionQueue` by its tag. `TagQueue` and `SubmittedCalls` give
clients written in Python (the Redis backend, a `BlockClient` with blocking transfers only) the
same interface, `memkv_vllm.core.interface.AsyncBlockClient`, over a small thread pool;
`PooledBlockClient` wraps a blocking `BlockClient` in it, which is how `BlockStore` drives one.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

from memkv_vllm.core.interface import BlockClient, CompletionQueue, ProbeHandle

__all__ = ["FutureOp", "PooledBlockClient", "SubmittedCalls", "TagQueue"]


class TagQueue:
    """`interface.CompletionQueue` in Python: the tags of completed operations, handed out once."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._tags: list[int] = []
        self._woken = False

    def push(self, tag: int) -> None:
        with self._cv:
            self._tags.append(tag)
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> list[int]:
        with self._cv:
            self._cv.wait_for(lambda: self._tags or self._woken, timeout)
            self._woken = False
            tags, self._tags = self._tags, []
            return tags

    def wake(self) -> None:
        with self._cv:
            self._woken = True
            self._cv.notify_all()


class FutureOp:
    """`interface.ProbeHandle` over a future: `wait` returns the call's answer, None on timeout,
    and raises what the call raised."""

    __slots__ = ("_fut",)

    def __init__(self, fut: concurrent.futures.Future[Any]) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._fut.result(None if timeout is None else max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            return None


def _own(queue: CompletionQueue | None) -> TagQueue | None:
    """`queue` as a queue Python threads can push onto (one `completion_queue()` made)."""
    if queue is None or isinstance(queue, TagQueue):
        return queue
    raise TypeError(f"not a queue of this client: {queue!r}")


class SubmittedCalls:
    """Blocking calls run on at most `threads` pool threads (started as needed), each returned as
    a `FutureOp` whose tag is pushed onto its queue once the call returned or raised."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                           thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any, queue: CompletionQueue | None = None,
               tag: int = 0) -> FutureOp:
        """`queue`: one a `completion_queue()` of this module made (a `TagQueue`)."""
        queue = _own(queue)
        fut = self._pool.submit(fn, *args)
        if queue is not None:
            # Runs once the future holds its result (or at once if it already does).
            fut.add_done_callback(lambda _: queue.push(tag))
        return FutureOp(fut)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


class PooledBlockClient:
    """`interface.AsyncBlockClient` over a `BlockClient` whose transfers block: each submitted
    transfer or delete runs on one of `threads` pool threads. Probes go to the client's own
    `submit_exists`; `client` is the wrapped client (registration is forwarded by its owner)."""

    def __init__(self, client: BlockClient, threads: int) -> None:
        self.client = client
        self._calls = SubmittedCalls(threads, "memkv-io")

    def completion_queue(self) -> TagQueue:
        return TagQueue()

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> ProbeHandle:
        return self.client.submit_exists(keys, lease_ms)

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: CompletionQueue | None = None,
                             tag: int = 0) -> FutureOp:
        return self._calls.submit(self.client.get_into_ptrs, keys, ptrs, sizes,
                                  queue=queue, tag=tag)

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: CompletionQueue | None = None, tag: int = 0) -> FutureOp:
        return self._calls.submit(self.client.put_ptrs, keys, ptrs, sizes, queue=queue,
                                  tag=tag)

    def submit_delete(self, keys: Sequence[bytes], queue: CompletionQueue | None = None,
                      tag: int = 0) -> FutureOp:
        return self._calls.submit(self.client.delete, keys, queue=queue, tag=tag)

    def shutdown(self) -> None:
        """Stops the pool threads once what runs finished (without waiting for it)."""
        self._calls.shutdown(wait=False)
