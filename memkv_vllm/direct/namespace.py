"""The key namespace a direct-mode worker publishes: `DirectKeyLayout` from what it knows."""

from __future__ import annotations

import os
from collections.abc import Sequence

from memkv_vllm.direct.keys import DirectKeyLayout, weights_fingerprint

# Bumped whenever the bytes of a value change for the same KV (memkv_vllm.offload.paged).
VALUE_LAYOUT = "v1"


def model_weights(model: str, revision: str | None) -> str:
    """`weights_fingerprint` of `model`; a hub name is looked up in the local hub cache (vLLM
    has downloaded it by the time a worker registers its KV cache)."""
    try:
        return weights_fingerprint(model, revision)
    except ValueError:
        pass
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as e:
        raise ValueError(f"memkv direct mode: cannot tell which weights {model!r} are (not a "
                         f"local directory, and no hub snapshot in the local cache: {e}); the "
                         f"key namespace needs them") from None
    return weights_fingerprint(path, revision)


def worker_layout(*, model: str, revision: str | None, dtype: str, tp_size: int,
                  tokens_per_chunk: int, kv_layout: str, api: str,
                  value_bytes: Sequence[int], ref_bytes: Sequence[Sequence[int]],
                  hash_algo: str | None, spec_prefix: str) -> DirectKeyLayout:
    """The namespace of one worker. Everything that changes a value's bytes for one block hash
    is in it: the KV geometry (each group's value length and per-layer bytes) as well as vLLM's
    layout, the API generation and the value layout version."""
    geometry = (f"{kv_layout};api={api};values={VALUE_LAYOUT}:{list(value_bytes)};"
                f"refs={[list(r) for r in ref_bytes]}")
    return DirectKeyLayout(
        model=model, weights=model_weights(model, revision), dtype=dtype, tp_size=tp_size,
        block_size=tokens_per_chunk, kv_layout=geometry, hash_algo=hash_algo or "default",
        # The seed of vLLM's block-hash chain: PYTHONHASHSEED where set, else vLLM's default.
        hash_seed=os.environ.get("PYTHONHASHSEED", ""), spec_prefix=spec_prefix)
