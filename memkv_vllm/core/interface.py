"""The internal contract between a serving stack and a KV block store, with no vLLM in it.

Two boundaries, each a `typing.Protocol` so that either side can be replaced without the other:

* `Offloader` — what a serving-stack adapter (the vLLM tier in memkv_vllm.vllm.tier, a test, another
  stack) calls: batched non-blocking lookups, load and store jobs over caller memory, completions,
  stats, buffer registration, close. `memkv_vllm.core.store.BlockStore` implements it over memkv.
* `BlockClient` — what an `Offloader` needs from the cluster below it: one asynchronous batched
  presence probe, two blocking batched transfers between raw memory and the cluster, and a
  batched delete. `AsyncBlockClient` is the same cluster with the transfers and the delete
  submitted too, each announcing its completion on a `CompletionQueue` by an integer tag, so
  that one thread waits for all of them; the block store drives that face, and runs a plain
  `BlockClient` through it on a small pool (memkv_vllm.core.completions).
  `memkv_vllm.core.client.MemKVClient`'s `codes` face implements both; `RegisteringClient` adds
  the optional registration step transports such as RDMA need, `ShardedClient` the placement that
  lets an offloader probe each server on its own deadline.

Direct mode (memkv_vllm.direct, memkv_vllm.offload) adds two more:

* `DirectOffloader` — an `Offloader` with the few operations direct mode's manager and its
  `KVOffloader` also need: verdicts known without probing, verdicts the owner learned itself,
  lease renewal before a load, and a wait for the next completion. `BlockStore` implements it.
* `LoadErrorReporter` / `LoadErrorListener` — how a connector that recomputes failed loads meets
  the offloading spec it drives: the spec's worker hands over the blocks of its failed loads
  instead of reporting the loads as failed, and the spec's manager hears that loads failed.
  memkv_vllm.vllm.spec implements both; memkv_vllm.vllm.connector uses them.

Threads: an `Offloader` belongs to ONE owner thread (vLLM: the scheduler thread). Every method is
called on that thread and returns without waiting on the network, except `drain()` and `close()`,
which wait by design. `AsyncBlockClient` submissions are made on the owner thread and on the
offloader's one harvester thread, and never block; `BlockClient` transfer methods are called on
I/O threads and may block for up to the client's per-operation timeout.

Failures are values, never exceptions: an unreachable, slow or broken cluster turns into MISS
verdicts, failed load keys (the caller recomputes) and dropped stores. Programming errors (a job
outside registered memory, an unknown buffer) raise `ValueError` at the call that made them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs


class Status(enum.IntEnum):
    """Per-key outcome of a `BlockClient` call; `memkv_vllm.core.client` returns these.

    0-11 are memkv's wire status codes; 16 and up are decided by the client itself and never sent
    (the native client defines the same numbers; a test checks they agree). An `Offloader` treats
    OK and OK_NO_LEASE as success and every other code as "this key did not transfer"; TIMEOUT
    additionally means the request may still be in flight (see `BlockClient`).

    PUT: ``OK`` means stored. ``TIMEOUT``, ``UNAVAILABLE`` and ``PROTOCOL_ERROR`` mean unknown
    (the value may have reached the server before the failure; a later GET then returns exactly
    these bytes or a miss, never other bytes). Every other status means not stored.
    """

    OK = 0
    NOT_FOUND = 1
    LENGTH_MISMATCH = 2
    TOO_LARGE = 3  # the value exceeds the server's limit; nothing stored
    NO_SPACE = 4
    UNAVAILABLE = 5  # the server is marked down after a failure (MemKVClient.health), or link broke
    CORRUPT = 6
    INVALID_KEY = 7
    OK_NO_LEASE = 8
    REMOTE_ACCESS = 9  # RDMA: the server's read/write of this key's buffer failed; GET: partial
    FORBIDDEN = 10  # outside the tenant's key prefix, or a write of a read-only tenant
    OVER_QUOTA = 11  # PUT: the tenant's quota is full and none of its own values could go
    TIMEOUT = 16  # the operation's deadline (op_timeout_s) passed before this key's answer
    REFUSED = 17  # the server refused the connection (nothing listens there)
    AUTH_FAILED = 18  # the server needs an auth key and ours is missing or wrong
    PROTOCOL_ERROR = 19  # the server's reply is not valid memkv protocol

    @staticmethod
    def is_ok(s: int) -> bool:
        """True when the value is there (EXISTS) or its bytes arrived (GET/PUT)."""
        return s == Status.OK or s == Status.OK_NO_LEASE


class Lookup(enum.Enum):
    """Answer of `Offloader.lookup`."""

    PENDING = "pending"  # not known yet: a probe is queued or outstanding; ask again next step
    HIT = "hit"  # present in the cluster as of the last probe or this offloader's own store
    MISS = "miss"  # absent, unreachable, or answered too late


@attrs.frozen
class Completion:
    """One finished job, returned exactly once by `Offloader.poll`."""

    job_id: int
    is_load: bool
    ok: bool  # every key transferred
    # Keys that transferred. Loads: exactly these destinations hold the stored bytes. Stores: these
    # keys are now in the cluster (including keys skipped because they were known to be there).
    ok_keys: tuple[bytes, ...]
    nbytes: int  # bytes actually transferred
    seconds: float  # submit -> last I/O done, on the offloader's clock
    shed: bool = False  # a store dropped unsent because of the backlog limit
    # Loads: keys the cluster turned out not to hold (any more), or held with a length no reader
    # can use (the offloader deletes those). The adapter may announce them as removed.
    gone_keys: tuple[bytes, ...] = ()
    # Loads in place (`DirectOffloader.submit_load_mapped`): the address of each of `ok_keys`'
    # values in this process (inside a same-host server's memory, mapped read-only), and the
    # tickets whose release (`DirectOffloader.submit_release`) ends their pins. The bytes there
    # are the stored ones only if that release succeeds.
    addresses: tuple[int, ...] = ()
    tickets: tuple[int, ...] = ()


@runtime_checkable
class ProbeHandle(Protocol):
    """An asynchronous operation: a presence probe started by `BlockClient.submit_exists`, or a
    transfer or delete submitted to an `AsyncBlockClient`."""

    def done(self) -> bool:
        """True once the answer is available. Never blocks."""
        ...

    def wait(self, timeout: float | None = None) -> Sequence[int] | None:
        """One status per key (for a probe: OK / OK_NO_LEASE = present, NOT_FOUND = absent, any
        other code = unknown), or None if not done within `timeout`. `wait(0)` after `done()`
        returned True, or after its tag came back from a `CompletionQueue`, returns the answer
        without blocking. May raise if the operation failed as a whole (a bug in the client)."""
        ...


@runtime_checkable
class CompletionQueue(Protocol):
    """Where operations submitted with it announce that they completed: each pushes its tag once,
    after its handle holds the answer (also when the operation failed as a whole)."""

    def wait(self, timeout: float | None = None) -> list[int]:
        """The tags pushed since the last call, in completion order. Blocks up to `timeout`
        seconds (None: no limit) for the first; an empty list after the timeout or `wake`."""
        ...

    def wake(self) -> None:
        """Make the running `wait`, or else the next one, return even without a tag."""
        ...


@runtime_checkable
class BlockClient(Protocol):
    """The cluster below an `Offloader`.

    Caller: the offloader. `submit_exists` is called on the offloader's owner thread and must not
    block; `get_into_ptrs` / `put_ptrs` / `delete` are called on I/O threads (the offloader runs a
    client that is not also an `AsyncBlockClient` on a pool of its own), concurrently with each
    other, and block until every key has an outcome.

    Memory guarantee the offloader relies on: a transfer method reads or writes the memory at
    `ptrs[i]` (exactly `sizes[i]` bytes) only while the call is running. `get_into_ptrs` writes a
    destination only after the server answered OK for that key with exactly `sizes[i]` bytes; if
    the transfer then dies part-way (TIMEOUT, UNAVAILABLE, PROTOCOL_ERROR), that destination holds
    unspecified bytes and its status says so: only OK destinations may be used. A call that runs
    into the client's per-operation deadline returns TIMEOUT for the keys it did not finish and
    writes none of their destinations after it returned. Raising instead of returning statuses is
    tolerated (all keys of the call count as failed) but never required.
    """

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> ProbeHandle:
        """Start one batched presence probe. `lease_ms` > 0 asks each server to keep the keys it
        holds for that long (a lookup hit then survives until its load). Non-blocking."""
        ...

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> Sequence[int]:
        """UNSAFE raw-pointer API: read each key into `sizes[i]` bytes at address `ptrs[i]`.
        One status per key; OK only if the stored value has exactly that length. The memory's
        owner is kept by the offloader's buffer registration (see `Offloader.register_buffer`)."""
        ...

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> Sequence[int]:
        """UNSAFE raw-pointer API: store `sizes[i]` bytes at address `ptrs[i]` under each key.
        One status per key."""
        ...

    def delete(self, keys: Sequence[bytes]) -> Sequence[int]:
        """Remove the keys from the cluster (absent keys are no error). One status per key."""
        ...


@runtime_checkable
class AsyncBlockClient(Protocol):
    """The cluster below an `Offloader`, with transfers and deletes submitted rather than blocking.

    Caller: the offloader, on its owner thread and its harvester thread; no method blocks. Each
    `submit_*` starts one batched operation and returns its handle at once; with a `queue` (made
    by `completion_queue`), the operation's `tag` is pushed onto it once the handle holds the
    answer, so one thread waits on the queue for all of them instead of one per operation.
    Answers and failures are those of the matching `BlockClient` method. An operation's deadline
    (the client's per-operation timeout) counts from its submission.

    Memory guarantee the offloader relies on: a submitted transfer reads or writes the memory at
    `ptrs[i]` (exactly `sizes[i]` bytes) only until its handle reports completion (`done()`, or
    its tag on the queue), TIMEOUT included: after that it touches none of it. A destination is
    written only for a key answered OK with exactly `sizes[i]` bytes, as for `BlockClient`.
    The memory's owner is kept by the offloader's buffer registration.
    """

    def completion_queue(self) -> CompletionQueue:
        """A new queue for this client's `submit_*` calls."""
        ...

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> ProbeHandle:
        """As `BlockClient.submit_exists`."""
        ...

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: CompletionQueue | None = None,
                             tag: int = 0) -> ProbeHandle:
        """UNSAFE raw-pointer API: `BlockClient.get_into_ptrs`, submitted."""
        ...

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: CompletionQueue | None = None, tag: int = 0) -> ProbeHandle:
        """UNSAFE raw-pointer API: `BlockClient.put_ptrs`, submitted."""
        ...

    def submit_delete(self, keys: Sequence[bytes], queue: CompletionQueue | None = None,
                      tag: int = 0) -> ProbeHandle:
        """`BlockClient.delete`, submitted."""
        ...


class MappedHandle(ProbeHandle, Protocol):
    """A submitted mapped read (`MappedReadClient.submit_get_mapped`)."""

    def wait_mapped(self, timeout: float | None = None
                    ) -> tuple[Sequence[int], Sequence[int], int] | None:
        """(one status per key, the address of each OK value (0 for others), the ticket that
        pins them (0: none)), or None if not done within `timeout`; `wait_mapped(0)` after the
        op's tag came back returns without blocking."""
        ...


@runtime_checkable
class MappedReadClient(Protocol):
    """An `AsyncBlockClient` that reads values in place, out of a same-host server's memory
    mapped into this process (`memkv serve --shm-share-values`). Callers: as for
    `AsyncBlockClient`; no method but `enable_mapped_reads` blocks."""

    def enable_mapped_reads(self, register: Callable[[int, int], None],
                            unregister: Callable[[int, int], None]) -> list[str | None]:
        """BLOCKING: map every server's memory now; per server None, or why not."""
        ...

    def submit_get_mapped(self, keys: Sequence[bytes], sizes: Sequence[int],
                          queue: CompletionQueue | None = None, tag: int = 0) -> MappedHandle:
        """Where each key's value (of `sizes[i]` bytes) lies, pinned until its ticket's
        release."""
        ...

    def submit_release_mapped(self, ticket: int, queue: CompletionQueue | None = None,
                              tag: int = 0) -> ProbeHandle:
        """Ends a ticket's pins; one status: OK when the servers held them throughout."""
        ...


@runtime_checkable
class RegisteringClient(Protocol):
    """A `BlockClient` whose transport needs memory registered before it moves bytes (RDMA
    registers each region with the NIC once; registering per transfer would cost more than the
    transfer). The offloader forwards its own `register_buffer` / `unregister_buffer` calls."""

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, ptr + nbytes) usable by later transfers. May raise (the offloader's
        `register_buffer` then raises too)."""
        ...

    def unregister_buffer(self, ptr: int) -> None:
        """Undo `register_buffer(ptr, ...)`. No transfer touching the region is running."""
        ...


@runtime_checkable
class ShardedClient(Protocol):
    """A `BlockClient` whose keys each live on one of several servers, and which says where. The
    offloader then probes each server's keys as a probe of its own: a silent server (a partition)
    runs into the lookup deadline with its own keys only, while the other servers' answers arrive
    as they come. One probe over all servers would answer when its slowest server does."""

    def by_server(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """`keys` grouped by the server that holds each, in their order within a group; no empty
        groups. Pure placement: no I/O."""
        ...


class Offloader(Protocol):
    """A KV block store used by one serving-stack adapter.

    Caller and thread: the adapter, always on one owner thread (vLLM: the scheduler thread of the
    scheduler process). Unless stated otherwise a method is non-blocking and does no network I/O
    on the calling thread.

    Memory: loads and stores move bytes between the cluster and caller memory given as
    (address, size) per key. That memory must lie inside a buffer registered with
    `register_buffer`, and must stay mapped and untouched by the caller from submit until the
    job's `Completion` has been returned by `poll`. After that the offloader never touches it.

    Failures never raise (see the module doc); a job always completes.
    """

    def register_buffer(self, ptr: int, nbytes: int, owner: object = None) -> None:
        """Declare [ptr, ptr + nbytes) as memory jobs may address; `owner` (e.g. the numpy
        array) is kept referenced until `unregister_buffer`. Forwarded to a `RegisteringClient`.
        Raises ValueError if the range overlaps an already registered buffer."""
        ...

    def unregister_buffer(self, ptr: int) -> None:
        """Forget the buffer registered at `ptr`. Raises ValueError if no buffer starts there or if
        a job addressing it has not completed yet (drain and poll first)."""
        ...

    def lookup(self, key: bytes) -> Lookup:
        """Presence of `key`, from the verdict cache or PENDING.

        A key with no fresh verdict is queued for the next `flush_lookups` and answers PENDING;
        once its probe answered, HIT or MISS are cached (HIT for a while, MISS briefly, since
        another engine may store the key). A probe unanswered after the lookup timeout makes its
        keys MISS: a slow cluster never stalls the caller.
        """
        ...

    def cancel_lookups(self, keys: Sequence[bytes]) -> None:
        """Drop keys queued since the last flush (e.g. those of a preempted request): they are
        not probed. Keys already probing or decided are unaffected."""
        ...

    def flush_lookups(self) -> None:
        """Send every key queued since the last flush as ONE asynchronous batched probe. Call once
        per scheduling step."""
        ...

    def has_pending_lookups(self) -> bool:
        """True while keys are queued or a probe is outstanding."""
        ...

    def submit_load(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                    sizes: Sequence[int]) -> None:
        """Start reading `keys` into the caller memory. Loads are never shed. Keys that fail are
        cached as MISS; a value found with another length than requested is deleted from the
        cluster (no reader of this namespace can use it). A key that timed out is a failed key
        like any other: the client writes nothing once its operation completed
        (`AsyncBlockClient`), so the job completes as soon as its operations did."""
        ...

    def submit_store(self, job_id: int, keys: Sequence[bytes], ptrs: Sequence[int],
                     sizes: Sequence[int]) -> None:
        """Start writing caller memory under `keys`. Keys known present are skipped (reported as
        stored). A store that would take the queued + in-flight store bytes past the backlog limit
        is shed: completed at once with `shed=True`, nothing sent. Stored keys become HIT."""
        ...

    def poll(self) -> list[Completion]:
        """Completions of finished jobs: every submitted job id exactly once, in no fixed order."""
        ...

    def drain(self, timeout: float | None = None) -> bool:
        """BLOCKING: wait until no job has I/O running. True if drained within `timeout`; then the
        completion of every submitted job is available: the next `poll` returns all those not
        returned yet (what vLLM's reset_cache relies on)."""
        ...

    def has_pending_jobs(self) -> bool:
        """True while some submitted job has not been returned by `poll` yet."""
        ...

    def stats(self) -> dict[str, int]:
        """Cumulative counters since creation plus current gauges (`store_backlog_bytes`,
        `jobs_in_flight`). Cheap; for metrics."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """BLOCKING: wait for running I/O (so caller memory is no longer touched), stop the I/O
        threads and end every buffer registration. Idempotent. Later jobs complete failed
        without I/O."""
        ...


class DirectOffloader(Offloader, Protocol):
    """An `Offloader` as direct mode uses it: the scheduler's `DirectManager` and each worker's
    `KVOffloader` (memkv_vllm.direct, memkv_vllm.offload) call these too.

    Caller and thread: the owner thread, as for every `Offloader` method (the scheduler thread for
    the manager; for a `KVOffloader`, whichever thread holds its lock), except `wait_any`, which
    the `KVOffloader`'s progress thread calls without that lock while the owner goes on.

    Failures never raise: a renewal that cannot start or does not find a value only makes later
    lookups miss.
    """

    def known_hit(self, key: bytes) -> bool:
        """Is `key` known to be in the cluster (an unexpired HIT verdict, from a probe or from a
        store of this offloader)? Never probes, never queues a probe, counts no lookup."""
        ...

    def mark_missing(self, keys: Sequence[bytes]) -> None:
        """Answer MISS for `keys` for the failed-load verdict lifetime: the owner learned that the
        cluster does not hold them usefully (a load of them failed elsewhere, e.g. on a worker
        whose store is not this one). Replaces any verdict they have."""
        ...

    def renew_leases(self, keys: Sequence[bytes]) -> None:
        """Ask the cluster again to keep `keys` for the lookup lease, because loads of them are
        about to start and the lease their lookup took may have run out (a HIT answered from the
        verdict cache is older than its lease). Non-blocking: the answer is read by a later
        `flush_lookups`; a key it does not find turns MISS as by `mark_missing`, so later lookups
        do not lead to the same failed load. `has_pending_lookups` is True until then. Does
        nothing without a cluster or with leases off."""
        ...

    def mapped_reads(self, register: Callable[[int, int], None],
                     unregister: Callable[[int, int], None]) -> str | None:
        """Turn loads in place on: every server's value memory is mapped into this process now
        (servers on this host started with `--shm-share-values`), `register(ptr, nbytes)` is
        called for each mapping (a GPU engine registers it with CUDA) and
        `unregister(ptr, nbytes)` before one goes. None when every server's is mapped, else why
        not (then `submit_load_mapped` must not be used). Called once, before any job."""
        ...

    def submit_load_mapped(self, job_id: int, keys: Sequence[bytes],
                           sizes: Sequence[int]) -> None:
        """A load in place: the job's Completion names, for each OK key, where its value lies
        (`Completion.addresses`) and the tickets pinning them (`Completion.tickets`), which the
        caller releases with `submit_release` once its copies out of them are done, also when
        some keys failed. Non-blocking, as `submit_load`."""
        ...

    def submit_release(self, job_id: int, tickets: Sequence[int]) -> None:
        """End the pins of `tickets`. The job's Completion is ok when the servers held every
        value until now: only then were the bytes copied out of them the stored ones.
        Non-blocking."""
        ...

    def wait_any(self, timeout: float) -> bool:
        """BLOCKING: wait until some job has finished that `poll` has not returned yet, at most
        `timeout` seconds. True if one has. Any thread may call it, concurrently with the owner's
        calls (it only watches the completions); for owners that also wait on other work (device
        copies) and cannot block in `drain` until every job is done."""
        ...


@runtime_checkable
class LoadErrorReporter(Protocol):
    """An offloading worker that can hand the blocks of its failed loads to the connector that
    drives it, which has the serving stack recompute them, instead of reporting those loads as
    failed transfers.

    Until `recompute_failed_loads` is called, a load that did not write all its blocks is
    reported failed (vLLM's stock OffloadingConnector then stops the engine: it has no way to
    recompute, and generating from KV that was never loaded would be worse).

    Caller and thread: the connector (memkv_vllm.vllm.connector, worker side), on the thread that
    submits the worker's jobs and collects them (vLLM's worker thread). Failures: neither method
    raises.
    """

    def recompute_failed_loads(self) -> None:
        """From now on answer a failed load as a success and keep the destination blocks it did
        not write for `take_load_errors`. Called once, before the first job."""
        ...

    def take_load_errors(self) -> set[int]:
        """The destination block ids of the failed loads answered since the last call, each once.
        A block is handed out no earlier than the collection that answered its job, so the
        scheduler still sees the request waiting for that load when the ids arrive."""
        ...


@runtime_checkable
class LoadErrorListener(Protocol):
    """An offloading manager that wants to hear of failed loads before their jobs complete.

    Caller and thread: the connector (memkv_vllm.vllm.connector, scheduler side), on the scheduler
    thread, when workers' load errors arrive, before it completes the jobs they belong to.
    Failures: never raises.
    """

    def on_load_errors(self) -> None:
        """Some of the loads in flight failed: stop answering HIT for what they were loading, so
        the recomputed requests do not look the same chunks up, load them and fail again."""
        ...
