"""Keep vLLM's CPU-pool region from outliving its engine in /dev/shm.

Why: TieringOffloadingSpec backs the CPU pool with a named file,
/dev/shm/vllm_offload_<engine id>.mmap. Every worker maps it when it registers its KV caches (the
first one creates the file), then the scheduler maps it when it builds the offloading manager.
Unlike CPUOffloadingSpec, the tiering spec passes no barrier, so the name is removed only by a
clean shutdown of the process that created it: a SIGTERM/SIGINT of an API server, a SIGKILL or a
crash leaves the file, and all the RAM it holds, behind until reboot.

What: a mapping outlives its name. The engine core builds its scheduler only after every worker
has registered its KV caches, so once the scheduler has mapped the region as a joiner (a worker
created the file) every process that will map it has done so, and the name can go. The kernel
then frees the pool when the last mapping goes, however the processes end. This is what vLLM's
CPUOffloadingSpec does after its barrier. `MemKVTieringOffloadingSpec` (tiering_spec.py) applies
it; what a region object holds (its file, whether it created it) and the worker's shutdown come
through compat.

The ordering it relies on holds per host for every executor that builds one scheduler per engine
after its workers (multiprocessing, Ray, in-process). Workers on other hosts of a multi-host engine
map a file on their own host that no scheduler joins: that file keeps vLLM's behaviour (removed by
a clean shutdown only).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from memkv_vllm.vllm.compat import api

logger = logging.getLogger("vllm.memkv_shm_region")


def names_file(path: str, fd: int) -> bool:
    """True if `path` still names the file open as `fd` (not gone, not a newer file)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    ours = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (ours.st_dev, ours.st_ino)


def drop_name(path: str, fd: int, creator: bool) -> bool:
    """Unlink `path`, the name of the file open as `fd`, where the last process maps it.

    Does nothing if this process created the file (`creator`: the workers, which map first, may
    still have to find it by name) or if `path` no longer names that file. Returns True if the
    name was removed. Never raises: failing to unlink only keeps vLLM's own behaviour.
    """
    if creator:
        return False
    try:
        if not names_file(path, fd):
            return False
        os.unlink(path)
    except OSError as e:
        logger.warning("memkv: could not unlink the CPU pool's %s: %s", path, e)
        return False
    logger.info("memkv: unlinked %s once every process had mapped it; the pool's memory is "
                "freed when the engine exits, however it exits", path)
    return True


def drop_pool_name(region: Any) -> bool:
    """`drop_name` for the scheduler's mapping `region` of the CPU pool (None: not mapped yet)."""
    if region is None:
        return False
    try:
        file = api().pool_file(region)
    except Exception as e:  # vLLM changed its region: keep vLLM's own behaviour, loudly
        logger.warning("memkv: the CPU pool keeps its /dev/shm name until a clean shutdown: %s", e)
        return False
    return file is not None and drop_name(file.path, file.fd, file.creator)


def forget_dropped_name(region: Any) -> None:
    """Before the creating process's `region.cleanup()`: if the name is gone or names another file
    now, stop cleanup() from unlinking it (that would log a failure, or remove the region of a
    newer engine that reuses the engine id). Never raises."""
    a = api()
    try:
        file = a.pool_file(region)
        if file is None or not file.creator:
            return
        try:
            dropped = not names_file(file.path, file.fd)
        except OSError:
            dropped = True
        if dropped:
            a.keep_name_at_cleanup(region)
    except Exception as e:
        logger.warning("memkv: could not tell the CPU pool's clean-up that its name is gone: %s", e)


def forget_dropped_name_at_shutdown(worker: Any) -> None:
    """Make vLLM's own CPU-pool worker run `forget_dropped_name` on the region it owns before its
    shutdown cleans that region up (the worker has no hook of its own). Never raises."""
    a = api()
    try:
        region = a.worker_pool_region(worker)
        if region is not None:
            a.call_before_shutdown(worker, lambda: forget_dropped_name(region))
    except Exception as e:
        logger.warning("memkv: the CPU pool worker's shutdown may unlink a newer engine's pool "
                       "file of the same name: %s", e)
