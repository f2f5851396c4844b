"""Direct mode's loads in place inside GPU engines: a memkv server on this host started with
--shm-share-values, engines over its same-host transport. Engine B (a new process after A) must
copy every full prefix block of both prompts straight out of the server's memory (its startup
log says loads in place are on) and answer exactly as A did.
"""

from __future__ import annotations

import uuid

import pytest
from engines import PREFIX_TOKENS, PROMPT_BLOCKS, direct_config, run_engine, same_outputs
from memkv_procs import MemKVServer

pytestmark = pytest.mark.gpu

N_VALUES = 2 * PROMPT_BLOCKS  # main + control, one value per full block


def in_place_config(server: str, prefix: str) -> dict:
    cfg = direct_config(server, prefix)
    cfg["kv_connector_extra_config"]["transport"] = "shm"
    return cfg


def test_engine_b_loads_in_place_out_of_the_servers_memory(
        gpu_model, engine_args, tmp_path) -> None:
    server = MemKVServer(memory="256M", lanes=2, extra=["--shm-share-values"]).start()
    try:
        prefix = f"gpu-in-place-{uuid.uuid4().hex[:8]}"
        cfg = in_place_config(server.address, prefix)
        a = run_engine(gpu_model, tmp_path, "a", cfg, engine_args, server=server.address,
                       wait_items=N_VALUES)
        hits = server.stats()["hits"]
        b = run_engine(gpu_model, tmp_path, "b", cfg, engine_args)
        for rec in b["prompts"].values():
            assert rec["cached"] == PREFIX_TOKENS
        assert server.stats()["hits"] - hits == N_VALUES
        assert "loads in place on" in (tmp_path / "b.log").read_text()
        same_outputs(a, b)
    finally:
        server.kill()
