"""Properties of key placement (rendezvous hashing), through the native code the client uses."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from memkv_vllm._native import rendezvous

servers_st = st.lists(
    st.tuples(st.integers(1, 254), st.integers(1024, 65535)).map(lambda t: f"10.0.0.{t[0]}:{t[1]}"),
    min_size=1, max_size=12, unique=True,
)
keys_st = st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=50)


@given(servers_st, keys_st, st.randoms())
def test_placement_ignores_list_order(servers, keys, rnd):
    shuffled = servers[:]
    rnd.shuffle(shuffled)
    for k in keys:
        assert servers[rendezvous(k, servers)] == shuffled[rendezvous(k, shuffled)]


@given(servers_st, st.text(min_size=1, max_size=20).map(lambda s: f"10.9.9.9:{len(s) + 1000}"),
       keys_st)
def test_adding_a_server_moves_keys_only_to_it(servers, new, keys):
    if new in servers:
        return
    grown = servers + [new]
    for k in keys:
        after = grown[rendezvous(k, grown)]
        assert after in (servers[rendezvous(k, servers)], new)


@given(servers_st, keys_st)
def test_removing_a_server_moves_only_its_keys(servers, keys):
    if len(servers) < 2:
        return
    gone, rest = servers[0], servers[1:]
    for k in keys:
        before = servers[rendezvous(k, servers)]
        if before != gone:
            assert rest[rendezvous(k, rest)] == before


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 16))
def test_balance_within_bound(n):
    """With 20,000 block-like keys, every server's share is within 12% of the mean."""
    servers = [f"10.1.0.{i}:7390" for i in range(n)]
    counts = [0] * n
    total = 20_000
    for i in range(total):
        counts[rendezvous(b"prefix/model_abc/%016x.bin" % (i * 2654435761), servers)] += 1
    mean = total / n
    assert max(abs(c - mean) for c in counts) <= 0.12 * mean, counts


def test_placement_is_the_same_in_another_process():
    servers = ["a:1", "b:2", "c:3", "d:4"]
    keys = [b"k%d" % i for i in range(200)]
    here = [rendezvous(k, servers) for k in keys]
    code = ("from memkv_vllm._native import rendezvous;"
            f"print([rendezvous(k, {servers!r}) for k in {keys!r}])")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert eval(there) == here
