"""Direct mode over the same-host transport: the offloader's host scratch is a memfd the server
maps, so values move by the server's copies into and out of the slots, not through the socket."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import entries, offloader, run
from layouts import LAYOUTS, block_bytes

from memkv_vllm.core.client import MemKVClient
from memkv_vllm.core.config import load_config
from memkv_vllm.core.store import BlockStore, StoreOptions
from memkv_vllm.offload import KVOffloader


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


def in_place_offloader(address: str, kv):
    client = MemKVClient.from_config(load_config({"servers": [address], "transport": "shm"}))
    return offloader(address, kv, client=client)


def lanes_mapped_here() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines()
            if "memkv-lane-" in line]


def test_loads_read_in_place_from_a_server_sharing_its_values(memkv_server_factory):
    srv = memkv_server_factory(memory="64M", lanes=2, extra=["--shm-share-values"])
    kv = LAYOUTS[sorted(LAYOUTS)[0]](32, "cpu")
    writer = in_place_offloader(srv.address, kv)
    src, dst = [1, 7, 20, 31], [3, 4, 5, 6]
    assert run(writer, 1, entries(b"mapped", 0, src), load=False).ok
    want = [block_bytes(kv, 0, b) for b in src]
    writer.close()
    for t in kv.tensors:
        t.view(torch.uint8).fill_(0)
    reader = in_place_offloader(srv.address, kv)
    assert "loads in place on" in reader.describe()
    maps = lanes_mapped_here()
    assert len(maps) >= 2 and all(" r--s " in m for m in maps), maps
    r = run(reader, 2, [e.__class__(e.key, 0, (d,)) for e, d in
                        zip(entries(b"mapped", 0, src), dst, strict=True)], load=True)
    assert r.ok and r.failed_block_ids == ()
    assert [block_bytes(kv, 0, b) for b in dst] == want
    # A key the server lacks fails its block and leaves it untouched.
    r = run(reader, 3, [e.__class__(b"absent-" + e.key, 0, (d,)) for e, d in
                        zip(entries(b"mapped", 0, src[:1]), [9], strict=True)], load=True)
    assert not r.ok and r.failed_block_ids == (9,)
    assert block_bytes(kv, 0, 9) == [bytes(len(p)) for p in want[0]]
    reader.close()


def test_loads_stay_in_scratch_without_shared_values(memkv_server):
    kv = LAYOUTS[sorted(LAYOUTS)[0]](32, "cpu")
    off = in_place_offloader(memkv_server.address, kv)
    assert "loads in place off" in off.describe()
    assert "--shm-share-values" in off.describe()
    off.close()


class _ServerGoneBeforeRelease:
    """The real block store, whose server is killed just before a load in place releases its
    pins: the moment a restarted, killed or cut-off server would take them."""

    def __init__(self, store: BlockStore, server) -> None:
        self._store, self._server = store, server

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def submit_release(self, job_id: int, tickets) -> None:
        self._server.kill()
        self._store.submit_release(job_id, tickets)


def test_a_load_in_place_whose_pins_were_lost_fails_its_blocks(memkv_server_factory):
    srv = memkv_server_factory(memory="64M", lanes=2, extra=["--shm-share-values"])
    kv = LAYOUTS[sorted(LAYOUTS)[0]](32, "cpu")
    writer = in_place_offloader(srv.address, kv)
    src, dst = [2, 3], [10, 11]
    assert run(writer, 1, entries(b"lost", 0, src), load=False).ok
    writer.close()
    client = MemKVClient.from_config(load_config({"servers": [srv.address], "transport": "shm",
                                                  "op_timeout_s": 5}))
    store = _ServerGoneBeforeRelease(BlockStore(client, StoreOptions()), srv)
    slot = -(-kv.max_value_bytes // 4096) * 4096
    reader = KVOffloader(kv, store, scratch_bytes=8 * slot)  # type: ignore[arg-type]
    assert "loads in place on" in reader.describe()
    r = run(reader, 2, [e.__class__(e.key, 0, (d,)) for e, d in
                        zip(entries(b"lost", 0, src), dst, strict=True)], load=True)
    assert srv.proc.poll() is not None, "the values arrived and their release was sent"
    # The blocks may hold the bytes, but nothing vouches for them once the pins are gone.
    assert not r.ok and sorted(r.failed_block_ids) == dst
    reader.close()
