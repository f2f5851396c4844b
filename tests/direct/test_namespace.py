"""The namespace a worker publishes: geometry and generation separate it, a model whose weights
cannot be identified stops the start."""

from __future__ import annotations

import pytest

from memkv_vllm.direct.namespace import worker_layout


def layout(tmp_path, **kw: object):
    weights = tmp_path / "model.safetensors"
    if not weights.exists():
        weights.write_bytes(b"weights")
    args: dict = {"model": str(tmp_path), "revision": None, "dtype": "bfloat16", "tp_size": 2,
                  "tokens_per_chunk": 256, "kv_layout": "LBHNC", "api": "0.31",
                  "value_bytes": [4096], "ref_bytes": [[2048, 2048]], "hash_algo": "sha256",
                  "spec_prefix": ""}
    return worker_layout(**{**args, **kw})


@pytest.mark.parametrize("change", [
    {"value_bytes": [8192]}, {"ref_bytes": [[1024, 3072]]}, {"api": "0.25"},
    {"kv_layout": "HND"}, {"hash_algo": "xxhash"}, {"spec_prefix": "blue"}, {"dtype": "float16"},
])
def test_each_input_separates_the_namespace(tmp_path, change) -> None:
    assert layout(tmp_path).prefix != layout(tmp_path, **change).prefix
    assert layout(tmp_path).prefix == layout(tmp_path).prefix


def test_new_weights_under_the_same_path_get_a_new_namespace(tmp_path) -> None:
    before = layout(tmp_path).prefix
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert layout(tmp_path).prefix != before


def test_a_model_that_cannot_be_identified_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot tell which weights"):
        layout(tmp_path, model="no-such-org/no-such-model-memkv-test")
