"""`RedisBlockClient`: the `BlockClient` of memkv_vllm.core.interface over Redis / Valkey.

Selected by ``backend: redis`` (docs/redis.md); works against a Redis Cluster (the slot map,
MOVED / ASK redirections, topology refresh after a failover and replica reads are redis-py's) and
against one standalone Redis or Valkey server. The same `BlockStore` runs on top of it, so the
tier and direct mode use it unchanged.

How memkv's guarantees map onto an engine that has no checksums, no leases and no length-checked
reads:

* **Keys**: ``{tag}`` + the memkv key (tier path names or direct-mode binary keys, unchanged).
  The tag is 4 hex digits of a hash of the key, so keys of one batch spread over the cluster's
  slots (and nodes), and braces inside a memkv key (a user prefix, binary digests) can never
  become the hash tag and pin a whole namespace onto one slot.
* **Values**: payload + a 16-byte trailer (magic ``mkR1``, CRC-32 of the payload, payload
  length). A GET is used only when the trailer's magic, length and CRC all match; a value of
  another length is ``LENGTH_MISMATCH`` (the block store deletes it), a corrupt one ``CORRUPT``
  (deleted here). Either way the caller's memory is not written: a miss, never wrong bytes.
* **Leases**: Redis has none. A probe with ``lease_ms > 0`` uses ``TOUCH`` instead of ``EXISTS``,
  which refreshes the key's LRU clock so that ``allkeys-lru`` evicts it last, but cannot forbid
  eviction: a hit may still turn into a miss at load time (measured in docs/redis.md).
* **Failures are values**: a node down, a failover in progress (CLUSTERDOWN, TRYAGAIN), a timeout
  or a refused login turns the affected keys into UNAVAILABLE / TIMEOUT / AUTH_FAILED. Keys are
  sent as one pipeline per cluster node, so a dead node fails its own keys only.
* **Threads**: calls may run concurrently (redis-py keeps a connection pool per node);
  `submit_exists` runs the probe on a small thread pool and returns at once, and the submitted
  transfers and deletes of `AsyncBlockClient` (what the block store drives) run on a pool of
  ``io_threads`` threads, each announcing its completion on a `TagQueue`. Socket waits release
  the GIL; building commands and parsing replies (hiredis) hold it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

from memkv_vllm.core.completions import FutureOp, SubmittedCalls, TagQueue
from memkv_vllm.core.config import MemKVConfig
from memkv_vllm.core.interface import CompletionQueue, Status

__all__ = ["TRAILER_BYTES", "RedisBlockClient", "frame_value", "redis_key", "unframe_value"]

log = logging.getLogger("memkv_client.redis")

VALUE_MAGIC = b"mkR1"
_TRAILER = struct.Struct("<4sIQ")  # magic, CRC-32 of the payload, payload length
TRAILER_BYTES = _TRAILER.size
# After a failed connect (no server answered), wait this long before trying again: a dead
# cluster must not cost a connect timeout on every call.
_RECONNECT_BACKOFF_S = 1.0
# Commands that may go to a replica when redis_read_from_replicas is set.
_READS = frozenset({"GET", "EXISTS", "TOUCH"})


def _slow_path_errors() -> tuple[type[BaseException], ...]:
    """Replies the fast cluster path hands to redis-py's ClusterPipeline (MovedError is an
    AskError)."""
    from redis import exceptions as rx

    return (rx.AskError, rx.TryAgainError, rx.ClusterDownError, rx.ConnectionError)


def redis_key(key: bytes) -> bytes:
    """The Redis key of a memkv key: a 4-hex-digit hash tag in front (see the module doc)."""
    tag = hashlib.blake2b(key, digest_size=2).hexdigest().encode()
    return b"{" + tag + b"}" + key


def frame_value(ptr: int, size: int) -> bytearray:
    """`size` bytes at `ptr` followed by their trailer: the one copy a PUT makes."""
    buf = bytearray(size + TRAILER_BYTES)
    if size:
        ctypes.memmove((ctypes.c_char * len(buf)).from_buffer(buf), ptr, size)
    view = memoryview(buf)
    _TRAILER.pack_into(buf, size, VALUE_MAGIC, zlib.crc32(view[:size]), size)
    return buf


def unframe_value(value: bytes | None, size: int) -> Status:
    """Whether a GET's reply is a usable value of `size` bytes: OK, NOT_FOUND, LENGTH_MISMATCH
    (a well-formed value of another length) or CORRUPT (no trailer, or its CRC disagrees)."""
    if value is None:
        return Status.NOT_FOUND
    if len(value) < TRAILER_BYTES:
        return Status.CORRUPT
    magic, crc, n = _TRAILER.unpack_from(value, len(value) - TRAILER_BYTES)
    if magic != VALUE_MAGIC or n != len(value) - TRAILER_BYTES:
        return Status.CORRUPT
    if n != size:
        return Status.LENGTH_MISMATCH
    if zlib.crc32(memoryview(value)[:n]) != crc:
        return Status.CORRUPT
    return Status.OK


def _status_of(err: BaseException) -> Status:
    """The per-key status of a redis-py exception (a failed key, never a raise)."""
    from redis import exceptions as rx

    if isinstance(err, rx.TimeoutError):
        return Status.TIMEOUT
    if isinstance(err, (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)):
        return Status.AUTH_FAILED
    if isinstance(err, rx.OutOfMemoryError):
        return Status.NO_SPACE  # maxmemory reached under a noeviction policy
    if isinstance(err, rx.ConnectionError) and "refused" in str(err).lower():
        return Status.REFUSED
    if isinstance(err, rx.ResponseError) and "bulk" in str(err).lower():
        return Status.TOO_LARGE  # over the server's proto-max-bulk-len
    return Status.UNAVAILABLE


class _Probe:
    """`interface.ProbeHandle` over a future of status codes."""

    __slots__ = ("_fut",)

    def __init__(self, fut: concurrent.futures.Future[bytes]) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> bytes | None:
        try:
            return self._fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return None


class RedisBlockClient:
    """`memkv_vllm.core.interface.BlockClient` over Redis Cluster or one standalone Redis / Valkey.

    Answers in status codes, one ``bytes`` per batch (byte i = key i's `Status` number), like
    `memkv_vllm.core.client.CodesClient`; ``codes`` is the client itself so callers written for
    `MemKVClient` (``client.codes``) take it unchanged. Never raises for a server failure.
    """

    def __init__(self, config: MemKVConfig, io_threads: int | None = None) -> None:
        """Raises ValueError for a configuration it cannot use (not backend redis, several
        servers in standalone mode) and ImportError naming the package when redis-py is
        missing. Connects lazily: an unreachable cluster is a miss, not a startup failure."""
        if config.backend != "redis":
            raise ValueError(f"RedisBlockClient needs backend 'redis', got {config.backend!r}")
        if config.redis_mode == "standalone" and len(config.servers) != 1:
            raise ValueError("redis_mode 'standalone' takes exactly one server")
        try:
            import redis  # noqa: F401
        except ImportError as e:
            raise ImportError("backend 'redis' needs redis-py: pip install 'memkv-vllm[redis]' "
                              "(redis and hiredis)") from e
        self.config = config
        self._lock = threading.Lock()
        self._redis: Any = None  # redis.RedisCluster or redis.Redis, made on first use
        self._cluster = False
        self._next_connect = 0.0
        self._up = True
        self._probes = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(4, io_threads or config.io_threads)),
            thread_name_prefix="memkv-redis-probe")
        self._calls = SubmittedCalls(io_threads or config.io_threads, "memkv-redis-io")
        self.codes = self
        self._slow_errors = _slow_path_errors()
        try:
            from hiredis import pack_command
        except ImportError:  # redis-py without hiredis still works, just slower
            self._hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None = None
        else:
            self._hiredis_pack = pack_command
        from redis.cluster import LoadBalancingStrategy

        # Reads (GET, EXISTS, TOUCH) round-robin over a shard's primary and replicas when asked.
        self._replica_reads = (LoadBalancingStrategy.ROUND_ROBIN
                               if config.redis_read_from_replicas else None)

    @property
    def mode(self) -> str | None:
        """"cluster" or "standalone" once connected (redis_mode auto decides then), else None."""
        if self._redis is None:
            return None
        return "cluster" if self._cluster else "standalone"

    # ------------------------------------------------------------------ connection
    def _common_kwargs(self) -> dict[str, Any]:
        c = self.config
        kw: dict[str, Any] = {
            "username": c.redis_username,
            "password": c.redis_password,
            "socket_timeout": c.op_timeout_s,
            "socket_connect_timeout": c.connect_timeout_s,
        }
        if c.servers[0].startswith("rediss://"):
            kw.update(ssl=True, ssl_ca_certs=c.redis_tls_ca, ssl_certfile=c.redis_tls_cert,
                      ssl_keyfile=c.redis_tls_key)
        return kw

    def _hosts(self) -> list[tuple[str, int]]:
        out = []
        for s in self.config.servers:
            host, _, port = s.partition("://")[2].rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out

    def _connect(self) -> Any:
        """The redis-py client, made on first use; raises (caught by the callers) while no
        server answers, at most once per backoff period."""
        if self._redis is not None:
            return self._redis
        with self._lock:
            if self._redis is not None:
                return self._redis
            if time.monotonic() < self._next_connect:
                raise ConnectionError("redis: no server answered recently; retrying later")
            try:
                self._redis = self._make_client()
            except Exception:
                self._next_connect = time.monotonic() + _RECONNECT_BACKOFF_S
                raise
            return self._redis

    def _make_client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode
        from redis.retry import Retry

        kw = self._common_kwargs()
        mode = self.config.redis_mode
        if mode == "auto":
            mode = self._detect_mode(kw)
        # One quick retry of a broken connection (not of a timeout: that would double
        # op_timeout_s): redirections (MOVED / ASK) are followed without counting, and a
        # failover is a miss rather than seconds of backoff on the engine's I/O threads.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        if mode == "cluster":
            self._cluster = True
            return redis.RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._hosts()],
                require_full_coverage=False, retry=retry,
                load_balancing_strategy=self._replica_reads, **kw)
        self._cluster = False
        if len(self.config.servers) > 1:
            log.warning("redis backend: %s runs standalone; using it alone, not the other %d "
                        "server(s) listed (standalone Redis does not shard)",
                        self.config.servers[0], len(self.config.servers) - 1)
        host, port = self._hosts()[0]
        return redis.Redis(host=host, port=port, retry=retry, **kw)

    def _detect_mode(self, kw: dict[str, Any]) -> Literal["cluster", "standalone"]:
        import redis

        last: Exception | None = None
        for host, port in self._hosts():
            try:
                with redis.Redis(host=host, port=port, **kw) as r:
                    info = r.info("cluster")
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError):
                raise  # the same credentials fail everywhere: AUTH_FAILED, not "no server"
            except redis.RedisError as e:
                last = e
                continue
            return "cluster" if int(info.get("cluster_enabled", 0)) == 1 else "standalone"
        raise ConnectionError(f"redis: no server of {','.join(self.config.servers)} answered "
                              f"({last})")

    def _note(self, ok: bool, why: str = "") -> None:
        """Log the first failure after success and the first success after failure, once."""
        if ok != self._up:
            self._up = ok
            if ok:
                log.info("redis backend reachable again")
            else:
                log.warning("redis backend failing: %s (keys are misses until it recovers)", why)

    # ------------------------------------------------------------------ batches
    def _run(self, commands: Sequence[tuple[Any, ...]], rkeys: Sequence[bytes]) -> list[Any]:
        """One reply (value or exception instance) per command; command i is about rkeys[i]."""
        try:
            r = self._connect()
        except Exception as e:
            self._note(False, str(e))
            return [e] * len(commands)
        if not self._cluster:
            out = self._pipeline(r, commands)
        else:
            out = self._run_cluster(r, commands, rkeys)
        errs = [x for x in out if isinstance(x, BaseException)]
        self._note(len(errs) < len(out) or not out, str(errs[0]) if errs else "")
        return out

    def _run_cluster(self, r: Any, commands: Sequence[tuple[Any, ...]],
                     rkeys: Sequence[bytes]) -> list[Any]:
        """Fast path: the commands of each node, by redis-py's slot map, go out as one raw
        pipeline on that node's connection pool, all nodes written before any is read. Slow
        path for what that could not settle (MOVED / ASK during a slot migration, TRYAGAIN,
        CLUSTERDOWN, a connection error, a slot without a node during a failover): redis-py's
        ClusterPipeline, which follows redirections and refreshes the slot map. A dead node
        thus fails its own keys only; every other node's keys go through."""
        from redis import exceptions as rx
        from redis.crc import key_slot

        groups: dict[str, tuple[Any, list[int]]] = {}
        slow: list[int] = []
        for i, k in enumerate(rkeys):
            try:
                node = r.nodes_manager.get_node_from_slot(
                    key_slot(k), load_balancing_strategy=self._replica_reads
                    if commands[i][0] in _READS else None)
            except Exception:  # e.g. SlotNotCoveredError while a failover runs
                slow.append(i)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        out: list[Any] = [None] * len(commands)
        sent = []
        for node, idx in groups.values():
            try:
                pool = r.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
            except Exception as e:
                for i in idx:
                    out[i] = e
                continue
            try:
                conn.send_packed_command(self._pack(conn, [commands[i] for i in idx]),
                                         check_health=False)
            except Exception as e:
                conn.disconnect()
                pool.release(conn)
                for i in idx:
                    out[i] = e
                continue
            sent.append((pool, conn, idx))
        for pool, conn, idx in sent:
            read = 0
            try:
                for i in idx:
                    try:
                        out[i] = conn.read_response()
                    except rx.ResponseError as e:  # this command's error reply; read on
                        out[i] = e
                    read += 1
            except Exception as e:  # the connection broke: this and the rest are unknown
                conn.disconnect()
                for i in idx[read:]:
                    out[i] = e
            finally:
                pool.release(conn)
        slow += [i for i, x in enumerate(out) if isinstance(x, self._slow_errors)]
        if slow:
            slow.sort()
            for i, res in zip(slow, self._pipeline(r, [commands[i] for i in slow]), strict=True):
                out[i] = res
        return out

    def _pack(self, conn: Any, commands: list[tuple[Any, ...]]) -> Any:
        """The wire bytes of `commands`. Key-only commands (probes, GET, DEL) go straight
        through hiredis's packer: redis-py's per-command wrapper costs more than the packing.
        SET keeps redis-py's packer, which sends large values as they are instead of copying
        them into the packed command."""
        if self._hiredis_pack is None or commands[0][0] == "SET":
            return conn.pack_commands(commands)
        return [b"".join(map(self._hiredis_pack, commands))]

    def _pipeline(self, r: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """redis-py's own pipeline (standalone, or the cluster's redirect-following one)."""
        try:
            p = r.pipeline(transaction=False)
            for c in commands:
                p.execute_command(*c)
            res = p.execute(raise_on_error=False)
        except Exception as e:
            return [e] * len(commands)
        if len(res) != len(commands):
            e2 = RuntimeError(f"redis pipeline answered {len(res)} replies for {len(commands)}")
            return [e2] * len(commands)
        return list(res)

    @staticmethod
    def _codes(results: Sequence[Any], ok: Callable[[Any], Status]) -> bytes:
        return bytes(_status_of(x) if isinstance(x, BaseException) else ok(x) for x in results)

    # ------------------------------------------------------------------ BlockClient
    def exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> bytes:
        """Blocking presence check. `lease_ms` > 0 uses TOUCH (refreshes the LRU clock, the
        nearest thing Redis has to a lease); 0 uses EXISTS (leaves eviction order alone)."""
        cmd = "TOUCH" if lease_ms > 0 else "EXISTS"
        rkeys = [redis_key(bytes(k)) for k in keys]
        res = self._run([(cmd, k) for k in rkeys], rkeys)
        return self._codes(res, lambda n: Status.OK if int(n) > 0 else Status.NOT_FOUND)

    def submit_exists(self, keys: Sequence[bytes], lease_ms: int = 0) -> _Probe:
        return _Probe(self._probes.submit(self._probe, list(keys), lease_ms, time.monotonic()))

    def _probe(self, keys: list[bytes], lease_ms: int, submitted: float) -> bytes:
        # A probe that waited in the queue longer than an operation may take (a slow or stuck
        # cluster: the scheduler keeps submitting one per step) answers TIMEOUT without I/O, so
        # the backlog drains at once instead of each stale probe waiting out its own timeout.
        if time.monotonic() - submitted > self.config.op_timeout_s:
            return bytes([Status.TIMEOUT]) * len(keys)
        return self.exists(keys, lease_ms)

    def get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                      ) -> bytes:
        """UNSAFE: as `BlockClient.get_into_ptrs`. A destination is written only for a value
        whose trailer (magic, length, CRC) matches, and only during this call."""
        rkeys = [redis_key(bytes(k)) for k in keys]
        res = self._run([("GET", k) for k in rkeys], rkeys)
        out = bytearray(len(keys))
        corrupt: list[bytes] = []
        for i, v in enumerate(res):
            if isinstance(v, BaseException):
                out[i] = _status_of(v)
                continue
            st = unframe_value(v, int(sizes[i]))
            if st == Status.OK and sizes[i]:
                ctypes.memmove(int(ptrs[i]), v, int(sizes[i]))
            elif st == Status.CORRUPT:
                corrupt.append(rkeys[i])
            out[i] = st
        if corrupt:
            # No reader can use them; a later store rewrites the block.
            log.warning("redis backend: %d value(s) failed their checksum; deleting them",
                        len(corrupt))
            self._run([("DEL", k) for k in corrupt], corrupt)
        return bytes(out)

    def put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
                 ) -> bytes:
        """UNSAFE: as `BlockClient.put_ptrs`. The memory is read (copied once into the framed
        value) before anything is sent."""
        rkeys = [redis_key(bytes(k)) for k in keys]
        cmds = [("SET", k, frame_value(int(p), int(n)))
                for k, p, n in zip(rkeys, ptrs, sizes, strict=True)]
        res = self._run(cmds, rkeys)
        return self._codes(res, lambda _: Status.OK)

    def delete(self, keys: Sequence[bytes]) -> bytes:
        rkeys = [redis_key(bytes(k)) for k in keys]
        res = self._run([("DEL", k) for k in rkeys], rkeys)
        return self._codes(res, lambda _: Status.OK)

    # ------------------------------------------------------------------ AsyncBlockClient
    def completion_queue(self) -> TagQueue:
        return TagQueue()

    def submit_get_into_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int],
                             sizes: Sequence[int], queue: CompletionQueue | None = None,
                             tag: int = 0) -> FutureOp:
        """`get_into_ptrs` on the I/O pool; `tag` is pushed onto `queue` once it returned."""
        return self._calls.submit(self.get_into_ptrs, keys, ptrs, sizes, queue=queue, tag=tag)

    def submit_put_ptrs(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int],
                        queue: CompletionQueue | None = None, tag: int = 0) -> FutureOp:
        """`put_ptrs` on the I/O pool; `tag` as for `submit_get_into_ptrs`."""
        return self._calls.submit(self.put_ptrs, keys, ptrs, sizes, queue=queue, tag=tag)

    def submit_delete(self, keys: Sequence[bytes], queue: CompletionQueue | None = None,
                      tag: int = 0) -> FutureOp:
        """`delete` on the I/O pool; `tag` as for `submit_get_into_ptrs`."""
        return self._calls.submit(self.delete, keys, queue=queue, tag=tag)

    def close(self) -> None:
        """Stops the probe and I/O threads (after running calls finish) and closes the
        connections."""
        self._probes.shutdown(wait=True)
        self._calls.shutdown(wait=True)
        with self._lock:
            r, self._redis = self._redis, None
        if r is not None:
            try:
                r.close()
            except Exception as e:
                log.warning("redis backend: closing the connections failed: %s", e)
