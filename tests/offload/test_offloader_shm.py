"""Direct mode over the same-host transport: the offloader's host scratch is a memfd the server
maps, so values move by the server's copies into and out of the slots, not through the socket."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import entries, offloader, run
from layouts import LAYOUTS, block_bytes

from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import load_config


def server_maps_scratch(srv) -> bool:
    return "/memfd:memkv-scratch" in Path(f"/proc/{srv.proc.pid}/maps").read_text()


def test_values_move_through_the_scratch_the_server_maps(memkv_server):
    kv = LAYOUTS[sorted(LAYOUTS)[0]](32, "cpu")
    client = MemKVClient.from_config(load_config({"servers": [memkv_server.address],
                                                  "transport": "shm"}))
    off = offloader(memkv_server.address, kv, client=client)
    assert "memfd scratch" in off.describe()
    src, dst = [2, 9, 30], [4, 5, 6]
    assert run(off, 1, entries(b"shm", 0, src), load=False).ok
    assert server_maps_scratch(memkv_server), "the server copied out of the scratch memfd"
    want = [block_bytes(kv, 0, b) for b in src]
    for t in kv.tensors:
        t.view(torch.uint8).fill_(0)
    r = run(off, 2, [e.__class__(e.key, 0, (d,)) for e, d in
                     zip(entries(b"shm", 0, src), dst, strict=True)], load=True)
    assert r.ok and r.failed_block_ids == ()
    assert [block_bytes(kv, 0, b) for b in dst] == want
    base = off.mover.io.data_ptr()
    off.close()
    # Other tests' offloaders may still be mapped until collected: look for this one's only.
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if line.startswith(f"{base:x}-") and "memkv-scratch" in line]
    assert not mapped, f"scratch left mapped: {mapped}"
