"""Key layout properties: injective over what changes KV bytes, stable across processes."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from memkv_vllm.core.keys import MAX_KEY_BYTES, KeyLayout, safe_model_name

# Prefix segments as users write them ("kv/prod"); leading/trailing slashes are not significant.
_seg = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12)
short_prefixes = st.lists(_seg, max_size=3).map("/".join)
# Long enough that a key passes MAX_KEY_BYTES and its namespace gets folded into a digest.
long_prefixes = st.lists(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=120, max_size=200),
    min_size=4, max_size=5).map("/".join)
prefixes = st.one_of(short_prefixes, long_prefixes)
_name = st.text(min_size=1, max_size=200).filter(lambda s: "\x00" not in s)
# Past _MAX_MODEL_CHARS characters, and multi-byte: the cut is by characters, the limit in bytes.
long_models = st.text(alphabet="αβγ🙂/abc", min_size=97, max_size=300)
models = st.one_of(
    st.sampled_from(["/tmp/tinymodel", "meta-llama/Llama-3.1-8B", "Qwen/Qwen3-0.6B"]),
    _name,
    long_models,
)
fields = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["float32", "bfloat16", "float16", "fp8_e4m3", "auto"]),
        "tp_size": st.integers(1, 8),
        "tokens_per_hash": st.sampled_from([16, 32, 128]),
        "blocks_per_chunk": st.integers(1, 16),
        "hash_algo": st.sampled_from(["sha256", "sha256_cbor", "xxhash"]),
        "none_hash": st.binary(min_size=4, max_size=8).map(bytes.hex),
        "kv_cache_layout": st.sampled_from(["HND", "LBHNC", "NHD"]),
        "value_bytes": st.integers(1, 1 << 24),
    }
)
hashes = st.one_of(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16))
groups = st.integers(0, 7)
ranks = st.integers(0, 7)
inputs = st.tuples(prefixes, models, fields, ranks, hashes, groups)


def _key(inp: tuple) -> bytes:
    prefix, model, f, rank, h, g = inp
    return KeyLayout(prefix=prefix, model=model, fields=f, rank=rank).key(h, g)


@settings(max_examples=400, deadline=None)
@given(inputs, inputs)
def test_distinct_inputs_never_share_a_key(a: tuple, b: tuple) -> None:
    if a != b:
        assert _key(a) != _key(b)
    else:
        assert _key(a) == _key(b)


@settings(max_examples=200, deadline=None)
@given(inputs, st.sampled_from(["prefix", "model", "fields", "rank", "hash", "group"]), st.data())
def test_changing_one_component_changes_the_key(inp: tuple, which: str, data) -> None:
    # The pairwise test rarely draws near-identical inputs; this one changes exactly one part.
    prefix, model, f, rank, h, g = inp
    if which == "prefix":
        prefix = data.draw(prefixes.filter(lambda p: p != prefix))
    elif which == "model":
        model = data.draw(models.filter(lambda m: m != model))
    elif which == "fields":
        name = data.draw(st.sampled_from(sorted(f)))
        f = {**f, name: data.draw(fields)[name]}
        if f == inp[2]:
            return
    elif which == "rank":
        rank = data.draw(ranks.filter(lambda r: r != rank))
    elif which == "hash":
        h = data.draw(hashes.filter(lambda x: x != h))
    else:
        g = data.draw(groups.filter(lambda x: x != g))
    assert _key((prefix, model, f, rank, h, g)) != _key(inp)


@settings(max_examples=100, deadline=None)
@given(inputs)
def test_keys_are_short_enough_and_look_like_filemapper_names(inp: tuple) -> None:
    k = _key(inp)
    assert len(k) <= MAX_KEY_BYTES
    assert k.endswith(inp[4].hex().encode() + b".bin")
    assert f"_g{inp[5]}/".encode() in k


@settings(max_examples=100, deadline=None)
@given(st.tuples(long_prefixes, models, fields, ranks, hashes, groups),
       st.tuples(long_prefixes, models, fields, ranks, hashes, groups))
def test_long_namespaces_are_folded_and_still_never_collide(a: tuple, b: tuple) -> None:
    ka, kb = _key(a), _key(b)
    for inp, k in ((a, ka), (b, kb)):
        assert len(k) <= MAX_KEY_BYTES
        ns, rest = k.split(b"/", 1)
        assert len(ns) == 24 and int(ns, 16) >= 0  # the folded namespace: a digest
        assert rest.endswith(inp[4].hex().encode() + b".bin")
    assert (ka == kb) == (a == b)


@settings(max_examples=100, deadline=None)
@given(short_prefixes, long_models, fields)
def test_long_model_names_are_cut_to_a_bounded_segment(prefix: str, model: str, f: dict) -> None:
    layout = KeyLayout(prefix=prefix, model=model, fields=f)
    segment = layout.namespace.rsplit("/", 1)[-1]
    assert "/" not in segment.removesuffix("_r0")
    assert segment.startswith(safe_model_name(model))
    assert len(safe_model_name(model)) <= 96 < len(model)
    # the tail of the name stays readable, the rest is a digest of the whole name
    assert safe_model_name(model).endswith(model.replace("/", "_")[-83:])
    other = KeyLayout(prefix=prefix, model=model + "x", fields=f)
    assert other.key(b"h" * 32, 0) != layout.key(b"h" * 32, 0)


@settings(max_examples=20, deadline=None)
@given(st.lists(inputs, min_size=1, max_size=5))
def test_same_inputs_give_the_same_key_in_another_process(batch: list[tuple]) -> None:
    # Python's str hash is randomized per process; a key must not depend on it (or on dict order).
    payload = json.dumps(
        [[p, m, f, r, h.hex(), g] for p, m, f, r, h, g in batch], ensure_ascii=True
    )
    code = (
        "import json,sys\n"
        "from memkv_vllm.core.keys import KeyLayout\n"
        "for p,m,f,r,h,g in json.loads(sys.stdin.read()):\n"
        "    f = dict(reversed(list(f.items())))\n"
        "    print(KeyLayout(prefix=p, model=m, fields=f, rank=r).key(bytes.fromhex(h), g).hex())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "random", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    ).stdout.split()
    assert out == [_key(inp).hex() for inp in batch]
