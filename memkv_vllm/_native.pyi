# Types of the PyO3 extension memkv_vllm._native (native/crates/memkv-py/src/lib.rs), which
# mypy cannot read from the shared object. Keep it in step with the #[pyo3(signature)]s there:
# tests/test_native_stub.py compares it with the built module (mypy's stubtest). RdmaTestPeer,
# a test-only class that memkv_vllm does not use, is left out.
#
# Per-key outcomes are one `bytes` of status codes per batch (byte i: key i's
# memkv_vllm.core.interface.Status number). Buffers cross as (address, length) pairs.

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, final

MAX_KEY_LEN: int
__version__: str

@final
class Op:
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bytes | None: ...
    def wait_lengths(self, timeout: float | None = None) -> tuple[bytes, list[int]] | None: ...
    # Mapped reads: (status codes, address of each OK value or 0, ticket).
    def wait_mapped(self, timeout: float | None = None) -> tuple[bytes, list[int], int] | None: ...

@final
class CompletionQueue:
    def __new__(cls) -> CompletionQueue: ...
    def wait(self, timeout: float | None = None) -> list[int]: ...
    def wake(self) -> None: ...

@final
class Client:
    def __new__(
        cls,
        servers: Sequence[str],
        auth_key: bytes | None = None,
        connections_per_server: int = 2,
        connect_timeout_s: float = 1.0,
        op_timeout_s: float = 10.0,
        io_threads: int = 8,
        transport: Literal["tcp", "rdma", "auto", "shm"] = "tcp",
        rdma_devices: Sequence[str] = ...,
        gpu_memory: bool = False,
        *,
        tls_ca: str | None = None,
        tls_server_name: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_allow_rdma: bool = False,
    ) -> Client: ...
    def exists(self, keys: Iterable[bytes], lease_ms: int = 0) -> bytes: ...
    def exists_lengths(
        self, keys: Iterable[bytes], lease_ms: int = 0
    ) -> tuple[bytes, list[int]]: ...
    def delete(self, keys: Iterable[bytes]) -> bytes: ...
    def put(self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]) -> bytes: ...
    def get_into(
        self, keys: Sequence[bytes], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> bytes: ...
    # Each submit_* pushes `tag` onto `queue` (if given) once the Op is complete.
    def submit_exists(
        self,
        keys: Iterable[bytes],
        lease_ms: int = 0,
        queue: CompletionQueue | None = None,
        tag: int = 0,
    ) -> Op: ...
    def submit_delete(
        self, keys: Iterable[bytes], queue: CompletionQueue | None = None, tag: int = 0
    ) -> Op: ...
    # `owner` is kept alive until the transfer is over.
    def submit_put(
        self,
        keys: Sequence[bytes],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        owner: object | None = None,
        queue: CompletionQueue | None = None,
        tag: int = 0,
    ) -> Op: ...
    def submit_get_into(
        self,
        keys: Sequence[bytes],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        owner: object | None = None,
        queue: CompletionQueue | None = None,
        tag: int = 0,
    ) -> Op: ...
    # Mapped reads (servers started with --shm-share-values): None per server whose memory is
    # mapped, else why not.
    def enable_mapped_reads(
        self, register: Callable[[int, int], None], unregister: Callable[[int, int], None]
    ) -> list[str | None]: ...
    def submit_get_mapped(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        queue: CompletionQueue | None = None,
        tag: int = 0,
    ) -> Op: ...
    def submit_release_mapped(
        self, ticket: int, queue: CompletionQueue | None = None, tag: int = 0
    ) -> Op: ...
    # [(address, answer or None, error or None)] per server.
    def ping(self) -> list[tuple[str, float | None, str | None]]: ...
    def stats(self) -> list[tuple[str, str | None, str | None]]: ...
    # [(address, (tenant name, key prefix, read-only) or None, error or None)] per server.
    def tenants(self) -> list[tuple[str, tuple[str, bytes, bool] | None, str | None]]: ...
    # [(address, up, last failure's status code, its reason, seconds since it)] per server.
    def health(self) -> list[tuple[str, bool, int | None, str | None, float | None]]: ...
    def server_of(self, key: bytes) -> int: ...
    def servers(self) -> list[str]: ...
    def register_buffer(self, ptr: int, nbytes: int) -> None: ...
    def unregister_buffer(self, ptr: int) -> None: ...
    def gpu_memory(self) -> tuple[bool, str]: ...
    def rdma_provider(self) -> str | None: ...

def rendezvous(key: bytes, servers: Sequence[str]) -> int: ...
def canonical_server(text: str) -> str: ...
def cli_main(argv: Sequence[str]) -> int: ...
def gpu_scratch_verdict(
    gpu: str,
    rdma_devices: Sequence[str] = ...,
    sysfs: str = "/sys",
    device_memory: tuple[bool, str] = ...,
) -> tuple[bool, str]: ...
def nic_for_gpu(
    gpu: str, rdma_devices: Sequence[str] = ..., sysfs: str = "/sys"
) -> tuple[str, str] | None: ...
def memory_kind(ptr: int) -> tuple[Literal["host", "cuda"], int | None]: ...
def statuses() -> list[tuple[str, int]]: ...
