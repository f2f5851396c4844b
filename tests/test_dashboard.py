"""The Grafana dashboard queries only metrics a real `memkv serve --metrics` exports (the tier's
half is checked where vLLM is installed: tests/tier/test_dashboard_tier.py), the tenant panels
those of a server with tenants."""

from __future__ import annotations

import urllib.request

import numpy as np
from dashboard import exposed, load, metric_names, queries
from disk_fs import tmpfs_dir
from test_tenants import KEY_A, client, tenant_server

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig


def scrape(server) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()


def test_every_server_metric_the_dashboard_queries_is_exported(memkv_server_factory) -> None:
    with tmpfs_dir() as disk:
        # With a disk tier, so that its series (memkv_disk_*, the disk rows of memkv_tier_*)
        # are exported too.
        srv = memkv_server_factory(metrics=True, extra=["--disk", str(disk), "--disk-size", "64M"])
        c = MemKVClient(MemKVConfig(servers=(srv.address,)))
        assert c.put([b"d/1"], [np.ones(4096, np.uint8)]) == [Status.OK]
        c.close()
        text = scrape(srv)
        srv.kill()
    # The tenant panels' metrics come from servers with tenants (the next test).
    names = {m for m in metric_names(load())
             if m.startswith("memkv_") and not m.startswith("memkv_tenant_")}
    missing = names - exposed(text)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    # What an operator looks at first is all there.
    for m in ("memkv_hits_total", "memkv_misses_total", "memkv_exists_hits_total",
              "memkv_bytes_in_total", "memkv_bytes_out_total", "memkv_evictions_total",
              "memkv_leases_granted_total", "memkv_leases_denied_total", "memkv_errors_total",
              "memkv_memory_used_bytes", "memkv_memory_capacity_bytes", "memkv_tier_bytes",
              "memkv_tier_hits_total", "memkv_tier_read_bytes_total", "memkv_tier_spills_total",
              "memkv_tier_promotions_total", "memkv_disk_spill_dropped_total"):
        assert m in names, m


def test_every_tenant_metric_the_dashboard_queries_is_exported_per_tenant(
        memkv_server_factory, tmp_path) -> None:
    srv = tenant_server(memkv_server_factory, tmp_path, metrics=True)
    assert client(srv, KEY_A).put([b"a/1"], [np.ones(4096, np.uint8)]) == [Status.OK]
    text = scrape(srv)
    names = {m for m in metric_names(load()) if m.startswith("memkv_tenant_")}
    assert names >= {"memkv_tenant_used_bytes", "memkv_tenant_quota_bytes",
                     "memkv_tenant_hits_total", "memkv_tenant_evictions_total",
                     "memkv_tenant_forbidden_total", "memkv_tenant_over_quota_total"}
    assert not names - exposed(text), names - exposed(text)
    for m in names:  # each sample carries the label the dashboard's variable selects by
        samples = [ln for ln in text.splitlines() if ln.startswith(m + "{")]
        assert samples and all('tenant="' in ln for ln in samples), m
    tenant_queries = [q for q in queries(load()) if "memkv_tenant_" in q]
    assert all('tenant=~"$tenant"' in q for q in tenant_queries if "label_values" not in q)


def test_the_dashboard_is_well_formed() -> None:
    dash = load()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance", "tenant"}
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["description"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    assert all(q.count("(") == q.count(")") for q in queries(dash))
