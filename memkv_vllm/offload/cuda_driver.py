"""CUDA's driver library (libcuda), opened with ctypes: the one place memkv_vllm opens it."""

from __future__ import annotations

import ctypes
import os

_LIBCUDA = "libcuda.so.1"  # the driver's soname, as the NVIDIA driver installs it


def cuda_driver(*, loaded_only: bool = False) -> ctypes.CDLL:
    """The CUDA driver library. `loaded_only`: only if this process has it loaded already (torch
    loads it with its first CUDA call), so that asking never loads a driver into a process that
    does not use CUDA. OSError when it cannot be opened."""
    mode = os.RTLD_NOLOAD | os.RTLD_NOW if loaded_only else ctypes.DEFAULT_MODE
    return ctypes.CDLL(_LIBCUDA, mode=mode)
