"""Real filesystems for the disk tier's tests: a directory on tmpfs, and an ext4 filesystem in a
loop file (root only), unmounted and detached however the test ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def loop_unavailable() -> str | None:
    """Why an ext4 loop filesystem cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "making a loop filesystem needs root"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


@contextlib.contextmanager
def ext4_loop(size_mib: int, options: str = "errors=remount-ro") -> Iterator[tuple[Path, str]]:
    """A fresh ext4 filesystem of `size_mib` MiB mounted on a temporary directory; yields the
    mount point and the loop device's name (e.g. ``loop3``, its /sys/fs/ext4 entry)."""
    work = Path(tempfile.mkdtemp(prefix="memkv-ext4-"))
    image, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    dev = ""
    mounted = False
    try:
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        _run("mkfs.ext4", "-q", "-F", str(image))
        dev = _run("losetup", "-f", "--show", str(image)).strip()
        _run("mount", "-o", options, dev, str(mnt))
        mounted = True
        yield mnt, Path(dev).name
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True, timeout=60)
        if dev:
            subprocess.run(["losetup", "-d", dev], check=False, capture_output=True, timeout=60)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def tmpfs_dir() -> Iterator[Path]:
    """A directory on /dev/shm (tmpfs), removed after."""
    d = Path(tempfile.mkdtemp(prefix="memkv-disk-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def filesystem(kind: str, size_mib: int = 256) -> Iterator[Path]:
    """A directory on `kind` ("tmpfs" or "ext4"); skips the test when ext4 cannot be made."""
    if kind == "tmpfs":
        with tmpfs_dir() as d:
            yield d
        return
    why = loop_unavailable()
    if why:
        import pytest

        pytest.skip(why)
    with ext4_loop(size_mib) as (mnt, _):
        yield mnt
