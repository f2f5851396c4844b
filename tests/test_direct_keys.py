"""Direct-mode key layout: every field that changes KV bytes separates namespaces, the rank
separates keys, and the same inputs give the same key in another process."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memkv_vllm.direct.keys import DirectKeyLayout, weights_fingerprint

BASE = DirectKeyLayout(model="meta-llama/Llama-3.1-8B", weights="hub:" + "a" * 40,
                       dtype="bfloat16", tp_size=4, block_size=16, kv_layout="HND",
                       hash_algo="sha256", hash_seed=b"\x01" * 32, spec_prefix="")

FIELDS = {
    "model": st.text(min_size=1, max_size=40),
    "weights": st.text(min_size=1, max_size=70),
    "dtype": st.sampled_from(["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "float32"]),
    "tp_size": st.integers(1, 64),
    "block_size": st.sampled_from([16, 32, 64, 128, 256, 512]),
    "kv_layout": st.sampled_from(["HND", "NHD", "LBHNC", "mla", "cross_layer"]),
    "hash_algo": st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    "hash_seed": st.binary(min_size=1, max_size=32),
    "spec_prefix": st.text(max_size=30),
}


@given(field=st.sampled_from(sorted(FIELDS)), data=st.data(),
       block_hash=st.binary(min_size=16, max_size=32), group=st.integers(0, 7))
def test_each_field_separates_keys(field, data, block_hash, group):
    value = data.draw(FIELDS[field].filter(lambda v: v != getattr(BASE, field)
                                           and not (field == "hash_seed"
                                                    and v.hex() == BASE.hash_seed)))
    other = attrs.evolve(BASE, **{field: value})
    rank = 0
    assert other.key(block_hash, group, rank) != BASE.key(block_hash, group, rank)
    assert other.prefix != BASE.prefix


@given(block_hash=st.binary(min_size=16, max_size=32), group=st.integers(0, 1 << 20),
       r1=st.integers(0, 3), r2=st.integers(0, 3))
def test_rank_and_group_separate_keys_inside_one_namespace(block_hash, group, r1, r2):
    k1, k2 = BASE.key(block_hash, group, r1), BASE.key(block_hash, group, r2)
    assert k1.startswith(BASE.prefix) and k2.startswith(BASE.prefix)
    assert (k1 == k2) == (r1 == r2)
    assert BASE.key(block_hash, group + 1, r1) != k1
    assert len(k1) == 4 + 16 + 2 + 4 + len(block_hash)


def test_the_spec_prefix_leads_every_key():
    """A tenant's keys must start with its prefix on the server: the spec prefix is the start."""
    layout = attrs.evolve(BASE, spec_prefix="team-a/")
    key = layout.key(b"h" * 32, 0, 1)
    assert key.startswith(b"team-a/mkD1") and key.startswith(layout.prefix)
    assert BASE.key(b"h" * 32, 0, 1).startswith(b"mkD1")


def test_rank_outside_tp_size_raises():
    with pytest.raises(ValueError, match="TP size"):
        BASE.key(b"h" * 32, 0, 4)


def test_same_inputs_give_the_same_key_in_another_process():
    code = ("from memkv_vllm.direct.keys import DirectKeyLayout as L;"
            "l = L(model='meta-llama/Llama-3.1-8B', weights='hub:' + 'a' * 40, dtype='bfloat16',"
            " tp_size=4, block_size=16, kv_layout='HND', hash_algo='sha256',"
            " hash_seed=b'\\x01' * 32, spec_prefix='');"
            "print(l.key(bytes(range(32)), 3, 2).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PYTHONPATH": ":".join(
                             p for p in sys.path if p)})
    assert out.stdout.strip() == BASE.key(bytes(range(32)), 3, 2).hex()


def test_weights_fingerprint(tmp_path):
    assert weights_fingerprint("org/model", "b" * 40) == "hub:" + "b" * 40
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    assert weights_fingerprint(str(snap)) == "hub:" + "c" * 40
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights-1")
    (ckpt / ".cache").mkdir()
    (ckpt / ".cache" / "lock").write_bytes(b"x")
    first = weights_fingerprint(str(ckpt))
    (ckpt / ".cache" / "lock").write_bytes(b"y")  # tool state does not count
    assert weights_fingerprint(str(ckpt)) == first
    (ckpt / "model.safetensors").write_bytes(b"weights-2")  # same name and size, new weights
    assert weights_fingerprint(str(ckpt)) != first
    with pytest.raises(ValueError, match="fingerprint"):
        weights_fingerprint("org/not-a-local-dir")
