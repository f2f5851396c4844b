"""Host scratch in shared memory: a memfd mapped `MAP_SHARED`, pinned for the GPU where one is.

Why: a memkv server on this host (`transport: shm | auto`) copies values straight into and out of
a client buffer that is a shared-memory mapping (the client passes its descriptor; docs/shm.md).
Private memory, torch's pinned allocations included, cannot be handed over, so its values cross
the unix socket in frames: two more copies. A memfd mapping registered with CUDA
(`cudaHostRegister`) copies to and from the GPU as fast as torch's pinned memory, so the same
slots serve both sides: the server writes a value in, the copy engine or the copy kernel reads it
out, and no byte is copied twice on the host.

Anything that fails here (no memfd, no CUDA registration) falls back to what scratch was before:
torch's pinned memory for a GPU, plain memory for host KV. The transport then uses its socket
path for those values, which is slower, never wrong.

No vLLM imports.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

logger = logging.getLogger("vllm.memkv_shared_host")

# cudaHostRegisterPortable: pinned for every CUDA context of the process, as torch's pinned
# allocations are (a worker may touch its scratch from another device context).
_REGISTER_PORTABLE = 1
# cudaHostRegisterReadOnly: the GPU only reads the memory (a same-host server's values, mapped
# read-only: registering them without it fails).
_REGISTER_READ_ONLY = 8


class SharedHostBuffer:
    """`nbytes` of scratch as a uint8 tensor (`tensor`); `shared` says whether it is a memfd
    mapping the same-host transport can take, `pinned` whether CUDA registered it."""

    def __init__(self, torch: Any, nbytes: int, pin: bool, name: str = "memkv-scratch") -> None:
        self._torch = torch
        self._map: mmap.mmap | None = None
        self._fd = -1
        self.pinned = False
        self.shared = False
        self.reason = ""
        try:
            self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(self._fd, nbytes)
            # The descriptor stays open for the buffer's life: the client finds a memfd's file
            # through /proc/self/fd, its only way back to it.
            self._map = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED | _populate(),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            self.shared = True
        except (OSError, ValueError, AttributeError) as e:
            self._release_map()
            self.reason = f"no memfd scratch ({e}): values take the transport's socket path"
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.pinned = pin
            return
        if pin:
            err = _host_register(torch, int(self.tensor.data_ptr()), nbytes)
            if err is None:
                self.pinned = True
            else:
                # Unpinned memory would halve every GPU copy; pinned private memory only costs
                # the same-host path its shortcut, so pinning wins.
                self._release_map()
                self.shared = False
                self.reason = (f"cudaHostRegister of the memfd scratch failed ({err}): pinned "
                               "private scratch instead, values take the transport's socket path")
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
        if self.shared:
            self.reason = "memfd scratch" + (", pinned" if self.pinned else "")

    def close(self) -> None:
        """Unpin and unmap. The caller has dropped every view of `tensor` and no copy uses it."""
        if self.shared and self.pinned:
            _host_unregister(self._torch, int(self.tensor.data_ptr()))
            self.pinned = False
        self.tensor = self._torch.empty(0, dtype=self._torch.uint8)
        self._release_map()

    def _release_map(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes with the last of them.
                logger.debug("memkv scratch mapping still exported; left to the garbage collector")
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _populate() -> int:
    # Fault the pages in at map time so the first transfers do not pay for it (Linux only).
    return getattr(mmap, "MAP_POPULATE", 0)


def register_read_only(torch: Any, ptr: int, nbytes: int) -> None:
    """Pin `[ptr, ptr + nbytes)`, a read-only mapping, for the GPU's reads; RuntimeError with
    the reason when CUDA refuses."""
    err = _host_register(torch, ptr, nbytes, _REGISTER_PORTABLE | _REGISTER_READ_ONLY)
    if err is not None:
        raise RuntimeError(f"cudaHostRegister (read-only) of {nbytes} bytes failed: {err}")


def unregister(torch: Any, ptr: int) -> None:
    """Undo `register_read_only(ptr, ...)`; a failure is logged."""
    _host_unregister(torch, ptr)


def _host_register(torch: Any, ptr: int, nbytes: int, flags: int = _REGISTER_PORTABLE
                   ) -> str | None:
    """None if CUDA pinned `[ptr, ptr + nbytes)`, else why not."""
    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(ptr, nbytes, flags)
    except Exception as e:  # no CUDA runtime bindings in this torch
        return str(e)
    code = int(getattr(err, "value", err))
    return None if code == 0 else f"cudaError {code}"


def _host_unregister(torch: Any, ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception as e:
        logger.warning("memkv: cudaHostUnregister of the scratch failed: %s", e)
