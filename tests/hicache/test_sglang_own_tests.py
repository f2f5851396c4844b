"""SGLang's own storage-backend tests, from its wheel (sglang publishes no sdist of its newest
releases), run against the memkv backend where they apply (docs/sglang.md lists them):

* mooncake_store/test_mooncake_store.py `test_batch_operation`: batch_set_v1 / batch_exists /
  batch_get_v1 through a host pool stand-in of its own, MHA and MLA, TP ranks 0 to 3. Run with
  memkv's class in place of MooncakeStore, four configurations as its __main__ runs them.

Not applicable: its `test_single_operation` (set / get of a 4 KiB blob at a raw address under a
raw key: Mooncake's object API, where memkv's set / get move whole pages), aibrix_kvcache's
unit_test (reads AIBrix's own cache-manager metrics), and the tests of hf3fs, eic, simm and
tensorcast (their own clients).
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed in this venv: tests/hicache run in "
                    ".venv-sglang (bash scripts/setup-sglang.sh)")

from memkv_vllm.sglang import MemKVHiCacheStorage  # noqa: E402

MOONCAKE_TESTS = "sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store"


@pytest.fixture
def sglang_tests(memkv_server, monkeypatch):  # noqa: ANN001, ANN201
    """SGLang's test module with memkv's backend in MooncakeStore's place; the servers come
    from MEMKV_SERVERS, as its configurations carry no extra config."""
    mod = importlib.import_module(MOONCAKE_TESTS)
    made = []

    def memkv_store(config):  # noqa: ANN001, ANN202
        made.append(MemKVHiCacheStorage(config))
        return made[-1]

    monkeypatch.setattr(mod, "MooncakeStore", memkv_store)
    monkeypatch.setenv("MEMKV_SERVERS", memkv_server.address)
    yield mod
    for store in made:
        store.close()


@pytest.mark.parametrize(("is_mla", "tp_rank", "tp_size"),
                         [(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)])
def test_mooncake_batch_operation(sglang_tests, is_mla, tp_rank, tp_size):
    sglang_tests.test_batch_operation(sglang_tests.make_hicache_storage_config(
        is_mla_model=is_mla, tp_rank=tp_rank, tp_size=tp_size))
