"""memkv_vllm.vllm.metrics without vLLM: which store counters become which metric, and how
reports are cut (tests/tier/test_tier.py checks the same table through vLLM's real stats)."""

from __future__ import annotations

from memkv_vllm.vllm.metrics import METRICS, StatsReporter

BLOCKS, BYTES, BACKLOG = (METRICS[k].name for k in ("blocks", "bytes", "store_backlog_bytes"))


def test_counters_are_reported_as_increases_and_gauges_when_they_change() -> None:
    r = StatsReporter()
    first = r.changes({"store_blocks_ok": 3, "store_bytes": 300, "store_backlog_bytes": 100})
    assert first is not None
    assert set(first.counters) == {(BLOCKS, 3, ("store", "ok")), (BYTES, 300, ("store",))}
    assert first.gauges == ((BACKLOG, 100),)

    second = r.changes({"store_blocks_ok": 5, "store_bytes": 300, "store_backlog_bytes": 100})
    assert second is not None
    assert second.counters == ((BLOCKS, 2, ("store", "ok")),)  # the increase, not the total
    assert second.gauges == ()  # unchanged gauge: not sent again

    third = r.changes({"store_blocks_ok": 5, "store_bytes": 300, "store_backlog_bytes": 0})
    assert third is not None
    assert third.counters == () and third.gauges == ((BACKLOG, 0),)  # a gauge back to zero


def test_nothing_changed_is_no_report() -> None:
    r = StatsReporter()
    assert r.changes({}) is None
    now = {"lookup_hit": 1, "lookup_miss": 2}
    assert r.changes(now) is not None
    assert r.changes(now) is None


def test_every_counter_feeds_a_declared_metric_with_its_labels() -> None:
    names = {m.name: m for m in METRICS.values()}
    stats = {"lookup_hit": 1, "lookup_miss": 1, "lookup_pending": 1, "lookup_timeouts": 1,
             "load_blocks_ok": 1, "load_blocks_failed": 1, "store_blocks_ok": 1,
             "store_blocks_failed": 1, "store_blocks_shed": 1, "store_blocks_skipped": 1,
             "load_bytes": 1, "store_bytes": 1}
    changes = StatsReporter().changes(stats)
    assert changes is not None and len(changes.counters) == len(stats)
    for name, _, labels in changes.counters:
        assert names[name].kind == "counter" and len(labels) == len(names[name].labels)
