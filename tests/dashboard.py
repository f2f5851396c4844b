"""The Grafana dashboard in deploy/grafana/ and the metric names its queries use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "memkv-dashboard.json"
# Names of the two metric families the dashboard reads: the server's and the vLLM tier's.
METRIC = re.compile(r"\b(memkv_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL string: panel targets and templating queries."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def metric_names(dash: dict[str, Any]) -> set[str]:
    return {m for q in queries(dash) for m in METRIC.findall(q)}


def exposed(prometheus_text: str) -> set[str]:
    """Metric names in a Prometheus text exposition (samples, not comments)."""
    return {re.split(r"[{ ]", line, maxsplit=1)[0]
            for line in prometheus_text.splitlines() if line and not line.startswith("#")}
