"""The Grafana dashboard queries only tier metrics the memkv tier declares to vLLM (vLLM exports
a counter as NAME_total, a gauge as NAME)."""

from __future__ import annotations

from dashboard import load, metric_names

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.tier import MemKVSecondaryTierManager


def test_every_tier_metric_the_dashboard_queries_is_declared() -> None:
    # What the tier really hands vLLM's metric registry, not a copy of its table.
    counter = api().kvb.OffloadingCounterMetadata
    declared = {name + ("_total" if isinstance(meta, counter) else "")
                for name, meta in MemKVSecondaryTierManager.build_metric_definitions({}).items()}
    used = {m for m in metric_names(load()) if m.startswith("vllm:")}
    assert used, "the dashboard shows no tier metric"
    assert not used - declared, f"not declared by the memkv tier: {used - declared}"
    for m in ("vllm:kv_offload_memkv_store_backlog_bytes",
              "vllm:kv_offload_memkv_lookup_timeouts_total",
              "vllm:kv_offload_memkv_lookups_total", "vllm:kv_offload_memkv_bytes_total"):
        assert m in used, m
