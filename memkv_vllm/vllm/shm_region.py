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
CPUOffloadingSpec does after its barrier. The helpers work on the region object's attributes
(`mmap_path`, `fd`, `_creator`), which are the same in every vLLM generation the plugin supports;
`tiering_spec_class()` applies them on every platform (the CPU platform's spec derives from it),
reaching vLLM only through compat.

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


def _names_our_file(fd: int, path: str) -> bool:
    """True if `path` still names the file open as `fd` (not gone, not a newer file)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    ours = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (ours.st_dev, ours.st_ino)


def drop_name_after_last_mapping(region: Any) -> bool:
    """Unlink the region's /dev/shm name; call where the last process maps it (the scheduler).

    Does nothing unless this mapping joined a file another process created (so the workers were
    first, as the engine core orders it) and the name still names that file. Returns True if the
    name was removed. Never raises: failing to unlink only keeps vLLM's own behaviour.
    """
    path, fd = getattr(region, "mmap_path", None), getattr(region, "fd", None)
    if path is None or fd is None or getattr(region, "_creator", True):
        return False
    try:
        if not _names_our_file(fd, path):
            return False
        os.unlink(path)
    except OSError as e:
        logger.warning("memkv: could not unlink the CPU pool's %s: %s", path, e)
        return False
    logger.info("memkv: unlinked %s once every process had mapped it; the pool's memory is "
                "freed when the engine exits, however it exits", path)
    return True


def forget_dropped_name(region: Any) -> None:
    """Before the creating process's cleanup(): if the name is gone or names another file now,
    stop cleanup() from unlinking it (that would log a failure, or remove the region of a newer
    engine that reuses the engine id)."""
    path, fd = getattr(region, "mmap_path", None), getattr(region, "fd", None)
    if not getattr(region, "_creator", False) or path is None or fd is None:
        return
    try:
        if not _names_our_file(fd, path):
            region._creator = False
    except OSError:
        region._creator = False


def forget_dropped_name_at_shutdown(worker: Any, region: Any) -> None:
    """Make `worker.shutdown()` call `forget_dropped_name(region)` before the shutdown that
    cleans `region` up: vLLM's own CPU-pool worker owns its region and has no hook of its own."""
    if region is None:
        return
    shutdown = worker.shutdown

    def shutdown_keeping_newer_names() -> None:
        forget_dropped_name(region)
        shutdown()

    worker.shutdown = shutdown_keeping_newer_names


_spec_cls: type | None = None


def tiering_spec_class() -> type:
    """vLLM's TieringOffloadingSpec whose CPU pool loses its /dev/shm name once the scheduler
    mapped it (every platform; built lazily, imports vLLM through compat)."""
    global _spec_cls
    if _spec_cls is None:

        class NamelessPoolTieringOffloadingSpec(api().tiering_spec_class()):  # type: ignore[misc]
            """Upstream TieringOffloadingSpec; the scheduler drops the pool's name (module doc)."""

            def get_manager(self) -> Any:
                manager = super().get_manager()
                # The scheduler maps the pool last: its name can go now.
                drop_name_after_last_mapping(api().scheduler_region(self))
                return manager

            def get_worker(self, kv_caches: Any) -> Any:
                fresh = getattr(self, "_memkv_worker_hooked", None) is None
                worker = super().get_worker(kv_caches)
                if fresh:
                    forget_dropped_name_at_shutdown(worker, api().worker_pool_region(worker))
                    self._memkv_worker_hooked = worker
                return worker

        _spec_cls = NamelessPoolTieringOffloadingSpec
    return _spec_cls
