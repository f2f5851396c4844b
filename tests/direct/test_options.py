"""The direct-mode keys of kv_connector_extra_config: defaults, and a clear error per bad value."""

from __future__ import annotations

import pytest

from memkv_vllm.core.config import ConfigError
from memkv_vllm.direct.options import DirectOptions, parse_options


def test_defaults_are_the_replaced_products() -> None:
    o = parse_options({"spec_name": "MemKVOffloadingSpec", "block_size": 256})
    assert o == DirectOptions(client_overrides={})
    assert (o.scratch_medium, o.num_threads, o.scratch_mb_per_thread) == ("auto", 4, 128)
    assert (o.load_threads, o.store_threads, o.wait_timeout_s) == (4, 4, 120.0)
    assert (o.lookup_miss_ttl_s, o.lookup_hit_ttl_s, o.spec_prefix) == (30.0, 30.0, "")
    assert o.prefix_wait_s == 10.0
    assert o.scratch_bytes == 4 * 128 << 20


def test_values_and_split_pools() -> None:
    o = parse_options({"memkv_scratch_medium": "host", "memkv_num_threads": "3",
                       "memkv_store_threads": 1, "memkv_wait_timeout_s": 0.5,
                       "memkv_lookup_miss_ttl": 0, "memkv_spec_prefix": "blue",
                       "memkv_prefix_wait_s": 0.5,
                       "servers": ["h:1"], "op_timeout_s": 2})
    assert (o.scratch_medium, o.num_threads, o.load_threads, o.store_threads) == ("host", 3, 3, 1)
    assert (o.wait_timeout_s, o.lookup_miss_ttl_s, o.spec_prefix) == (0.5, 0.0, "blue")
    assert o.prefix_wait_s == 0.5
    # Client settings given next to the spec keys are passed on; vLLM's own keys are not.
    assert dict(o.client_overrides) == {"servers": ["h:1"], "op_timeout_s": 2}


@pytest.mark.parametrize(("key", "value"), [
    ("memkv_scratch_medium", "disk"), ("memkv_num_threads", 0), ("memkv_num_threads", "x"),
    ("memkv_num_threads", True), ("memkv_scratch_mb_per_thread", -1),
    ("memkv_load_threads", 1000), ("memkv_wait_timeout_s", 0), ("memkv_wait_timeout_s", "nan"),
    ("memkv_lookup_hit_ttl", -1), ("memkv_spec_prefix", 3), ("memkv_num_thread", 2),
    ("memkv_prefix_wait_s", -1),
])
def test_a_bad_value_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_options({key: value})
    assert e.value.key == key and key in str(e.value)
