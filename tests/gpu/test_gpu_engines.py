"""Two GPU engines, A then B (a new process), in tier mode, in direct mode and through memkv's
recompute connector; and the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which
vLLM refuses for any KV connector unless its cumem allocator is on (--enable-cumem-allocator).

Engine A computes both prompts cold and its stores reach one memkv server; engine B must take
every full prefix block of both from memkv and answer exactly as A did (engines.py says which
outputs are compared, and why the control prompt).
"""

from __future__ import annotations

import uuid

import pytest
from engines import (
    DEVICE,
    PREFIX_TOKENS,
    PROMPT_BLOCKS,
    direct_config,
    expanded,
    refused,
    run_engine,
    same_outputs,
    tier_config,
)
from memkv_procs import MemKVServer

pytestmark = pytest.mark.gpu

N_VALUES = 2 * PROMPT_BLOCKS  # main + control, one value per full block
MODES = ("tier", "direct")


def config(mode: str, server: str, prefix: str) -> dict:
    return tier_config(server, prefix) if mode == "tier" else direct_config(server, prefix)


@pytest.fixture(scope="module")
def server():
    s = MemKVServer(memory="256M", lanes=2).start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def engines_a(server, gpu_model, engine_args, tmp_path_factory) -> dict:
    """Per mode, engine A's result, its namespace and its work folder (A runs once per mode)."""
    done: dict = {}

    def get(mode: str) -> dict:
        if mode not in done:
            work = tmp_path_factory.mktemp(f"gpu-{mode}")
            prefix = f"gpu-{mode}-{uuid.uuid4().hex[:8]}"
            before = server.stats()["items"]
            a = run_engine(gpu_model, work, "a", config(mode, server.address, prefix),
                           engine_args, server=server.address, wait_items=before + N_VALUES)
            done[mode] = {"a": a, "prefix": prefix, "work": work}
        return done[mode]

    return get


def reader(mode: str, a: dict, server: MemKVServer, model: str, engine_args: dict,
           name: str, kv: dict | None = None, env: dict | None = None) -> dict:
    """Engine B over A's namespace: asserts it took both prompts' prefixes from memkv."""
    hits = server.stats()["hits"]
    b = run_engine(model, a["work"], name, kv or config(mode, server.address, a["prefix"]),
                   engine_args, env=env)
    for rec in b["prompts"].values():
        assert rec["cached"] == PREFIX_TOKENS  # every full block, from a new process
    assert server.stats()["hits"] - hits == N_VALUES
    return b


@pytest.mark.parametrize("mode", MODES)
def test_engine_b_takes_the_prefix_from_memkv_and_answers_as_a(
        mode, server, engines_a, gpu_model, engine_args) -> None:
    a = engines_a(mode)
    assert all(rec["cached"] == 0 for rec in a["a"]["prompts"].values())
    # The control prompt ends like the main one: its outputs differ only through its prefix.
    assert a["a"]["prompts"]["control"]["logprobs"] != a["a"]["prompts"]["main"]["logprobs"]
    b = reader(mode, a, server, gpu_model, engine_args, "b")
    same_outputs(a["a"], b)


def test_the_recompute_connector_loads_what_direct_mode_stored(
        server, engines_a, gpu_model, engine_args) -> None:
    a = engines_a("direct")
    kv = direct_config(server.address, a["prefix"], connector="MemKVOffloadingConnector")
    c = reader("direct", a, server, gpu_model, engine_args, "connector", kv=kv)
    same_outputs(a["a"], c)


@pytest.mark.skipif(DEVICE != "cuda", reason="the cumem allocator needs CUDA")
@pytest.mark.parametrize("mode", MODES)
def test_expandable_segments_need_the_cumem_allocator(
        mode, server, engines_a, gpu_model, engine_args) -> None:
    a = engines_a(mode)
    kv = config(mode, server.address, a["prefix"])
    why = refused(gpu_model, a["work"], "expandable", kv, engine_args, expanded())
    assert "expandable_segments:True" in why and "enable_cumem_allocator" in why
    b = reader(mode, a, server, gpu_model, {**engine_args, "enable_cumem_allocator": True},
               "expandable-cumem", env=expanded())
    same_outputs(a["a"], b)
