#!/usr/bin/env python3
"""List or prune the CUDA images in an ELF shared object's .nv_fatbin section.

  python fatbin.py list  LIB.so [SM]
  python fatbin.py prune LIB.so SM OUT.so

prune zeroes the payload of every image a device of compute capability SM (90: Hopper) cannot
use: ELF images (cubins) for another SM, and PTX where that fatbin has an ELF image for SM or a
newer PTX <= SM. The headers stay, so the file keeps its size and layout (the CUDA runtime skips
images for other architectures without reading them) but compresses much better.
"""

from __future__ import annotations

import collections
import struct
import sys
from collections.abc import Iterator
from typing import NamedTuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


class Image(NamedTuple):
    fatbin: int  # offset of the fatbin header the image belongs to
    offset: int  # offset of the image's header
    kind: int
    sm: int
    header_size: int
    payload_size: int


def section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 section `name`."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    strtab = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        start = strtab + h[0]
        if data[start:data.index(b"\0", start)].decode() == name:
            return h[4], h[5]
    raise SystemExit(f"no section {name}")


def images(data: bytes, off: int, size: int) -> Iterator[Image]:
    end, p = off + size, off
    while p < end:
        if p % 8:
            p += 8 - p % 8
            continue
        magic, _version, header_size, fatbin_size = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8
            continue
        q, fatbin_end = p + header_size, p + header_size + fatbin_size
        while q < fatbin_end:
            kind, _v, image_header, payload = struct.unpack_from("<HHIQ", data, q)
            (sm,) = struct.unpack_from("<I", data, q + 28)
            yield Image(p, q, kind, sm, image_header, payload)
            q += image_header + payload
        p = fatbin_end


def main() -> int:
    cmd, path = sys.argv[1], sys.argv[2]
    keep = int(sys.argv[3]) if len(sys.argv) > 3 else 90
    data = bytearray(open(path, "rb").read())
    off, size = section(data, ".nv_fatbin")
    groups: dict[int, list[Image]] = collections.defaultdict(list)
    for image in images(data, off, size):
        groups[image.fatbin].append(image)
    sizes: collections.Counter[tuple[str, int]] = collections.Counter()
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    zeroed = unusable = 0
    for group in groups.values():
        has_elf = any(i.kind == KIND_ELF and i.sm == keep for i in group)
        ptx = [i.sm for i in group if i.kind == KIND_PTX and i.sm <= keep]
        best_ptx = max(ptx) if ptx else None
        unusable += not has_elf and best_ptx is None
        for i in group:
            label = {KIND_PTX: "ptx", KIND_ELF: "elf"}.get(i.kind, str(i.kind))
            sizes[label, i.sm] += i.payload_size
            counts[label, i.sm] += 1
            usable = (i.kind == KIND_ELF and i.sm == keep) or (
                not has_elf and i.kind == KIND_PTX and i.sm == best_ptx)
            if cmd == "prune" and not usable:
                start = i.offset + i.header_size
                data[start:start + i.payload_size] = bytes(i.payload_size)
                zeroed += i.payload_size
    for label, sm in sorted(sizes):
        print(f"{label} sm_{sm}: {counts[label, sm]} images, {sizes[label, sm] / 1e6:.1f} MB")
    print(f"{len(groups)} fatbins, {unusable} with nothing usable on sm_{keep}")
    print(f"section {size / 1e6:.1f} MB, images {sum(sizes.values()) / 1e6:.1f} MB")
    if cmd == "prune":
        with open(sys.argv[4], "wb") as f:
            f.write(data)
        print(f"zeroed {zeroed / 1e6:.1f} MB -> {sys.argv[4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
