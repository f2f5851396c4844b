"""memkv's offloading metrics as vLLM exports them (tier and direct mode): the table of metrics,
and what changed in the store's counters since the last report.

This is product logic, not version translation: which `Offloader.stats()` counter feeds which
metric and label, and how a report is cut (counters as deltas, which vLLM adds up; gauges only
when their value changed). compat builds vLLM's objects from it (`metric_definitions`,
`connector_stats`); nothing here imports vLLM.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, NamedTuple

from memkv_vllm.vllm.compat import api


class Metric(NamedTuple):
    """One exported metric: its name, "counter" or "gauge", its label names and its help text."""

    name: str
    kind: str
    labels: tuple[str, ...]
    doc: str


_M = "vllm:kv_offload_memkv_"
METRICS: dict[str, Metric] = {
    "lookups": Metric(_M + "lookups", "counter", ("result",),
                      "memkv tier lookups by answer (hit, miss, pending)."),
    "lookup_timeouts": Metric(_M + "lookup_timeouts", "counter", (),
                              "memkv lookups answered MISS because the probe passed "
                              "lookup_timeout_s."),
    "blocks": Metric(_M + "blocks", "counter", ("op", "result"),
                     "Offloaded chunks moved by the memkv tier (op: load/store; result: ok, "
                     "failed, shed, skipped)."),
    "bytes": Metric(_M + "bytes", "counter", ("op",), "Bytes moved by the memkv tier."),
    "store_backlog_bytes": Metric(_M + "store_backlog_bytes", "gauge", (),
                                  "Bytes of queued or in-flight memkv stores."),
}
# Offloader.stats() counter -> (metric key, label values)
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookup_hit": ("lookups", ("hit",)),
    "lookup_miss": ("lookups", ("miss",)),
    "lookup_pending": ("lookups", ("pending",)),
    "lookup_timeouts": ("lookup_timeouts", ()),
    "load_blocks_ok": ("blocks", ("load", "ok")),
    "load_blocks_failed": ("blocks", ("load", "failed")),
    "store_blocks_ok": ("blocks", ("store", "ok")),
    "store_blocks_failed": ("blocks", ("store", "failed")),
    "store_blocks_shed": ("blocks", ("store", "shed")),
    "store_blocks_skipped": ("blocks", ("store", "skipped")),
    "load_bytes": ("bytes", ("load",)),
    "store_bytes": ("bytes", ("store",)),
}
# Offloader.stats() gauge -> metric key
_GAUGES = {"store_backlog_bytes": "store_backlog_bytes"}


class Changes(NamedTuple):
    """One report: counter increases (metric name, increase, label values) and gauge values
    (metric name, value)."""

    counters: tuple[tuple[str, int, tuple[str, ...]], ...]
    gauges: tuple[tuple[str, int], ...]


class StatsReporter:
    """What one tier or direct-mode manager reports to vLLM: each call to `report` sends what
    changed since the previous one. Scheduler thread only (vLLM's get_stats)."""

    def __init__(self) -> None:
        self._reported: collections.Counter[str] = collections.Counter()

    def changes(self, now: Mapping[str, int]) -> Changes | None:
        """What changed in `now` (Offloader.stats()) since the last call; None when nothing did.
        A counter that went down (a store reset) is not reported until it passes its old value:
        vLLM only adds increases."""
        counters = []
        for counter, (metric, labels) in _COUNTERS.items():
            value = now.get(counter, 0)
            if value > self._reported[counter]:
                counters.append((METRICS[metric].name, value - self._reported[counter], labels))
                self._reported[counter] = value
        gauges = []
        for gauge, metric in _GAUGES.items():
            value = now.get(gauge, 0)
            if value != self._reported["gauge:" + gauge]:
                gauges.append((METRICS[metric].name, value))
                self._reported["gauge:" + gauge] = value
        if not counters and not gauges:
            return None
        return Changes(tuple(counters), tuple(gauges))

    def report(self, now: Mapping[str, int]) -> Any:
        """vLLM's connector stats of `changes(now)`, or None when nothing changed."""
        changes = self.changes(now)
        return None if changes is None else api().connector_stats(changes)


def metric_definitions() -> dict[str, Any]:
    """vLLM's declarations of METRICS (what build_metric_definitions returns)."""
    return api().metric_definitions(METRICS.values())
