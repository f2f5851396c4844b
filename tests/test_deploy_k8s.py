"""deploy/k8s as Kubernetes will take it: every manifest validated against the API server's
schemas (kubernetes-validate, strict: unknown fields are errors) for the oldest and newest
Kubernetes it ships, the ServiceMonitor against the Prometheus Operator's CRD (its generated
models, cloudcoil-models-prometheus-operator), and the facts that tie the files together: the
memory limit derived from --memory, the probes on the endpoint the server serves, the servers
the engines list, and flags that `memkv serve` has."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from memkv_procs import memkv_command

from memkv_vllm.core.config import load_config

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
# Kubernetes releases validated against: the oldest still supported by cloud providers' extended
# support when this was written, and the newest kubernetes-validate has.
OLDEST = "1.29.0"
# What the server uses beyond --memory and --max-buffer-memory, with room: measured at 4.6 MiB
# idle and 5.7 MiB under 16 busy connections (docs/deploy.md#kubernetes).
OVERHEAD = 64 << 20
NO_VALIDATOR = "kubernetes-validate is not installed (scripts/test.sh installs it into .venv)"


def manifests() -> dict[str, dict[str, Any]]:
    """Every object of deploy/k8s but the kustomization, by kind."""
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(f.read_text()):
                out[doc["kind"]] = doc
    return out


def size_bytes(text: str) -> int:
    """A size as memkv takes it (8G, 512M: binary units) or as Kubernetes writes it (8768Mi)."""
    m = re.fullmatch(r"(\d+)([KMGT])i?", text)
    assert m, text
    return int(m[1]) << (10 * "KMGT".index(m[2]) + 10)


def server_container() -> dict[str, Any]:
    (c,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_every_manifest_is_valid_for_the_kubernetes_api() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=NO_VALIDATOR)
    objs = manifests()
    assert set(objs) == {"Service", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor",
                         "Deployment"}
    newest = kv.latest_version()
    for kind, obj in objs.items():
        if kind == "ServiceMonitor":
            continue  # a custom resource: its CRD's schema, below
        for version in (OLDEST, newest):
            kv.validate(obj, version, strict=True)
    bad = {**objs["Service"], "spec": {**objs["Service"]["spec"], "clusterIp": "None"}}
    with pytest.raises(kv.ValidationError):  # the check itself: a misspelt field is refused
        kv.validate(bad, newest, strict=True)


def test_the_servicemonitor_is_valid_for_the_prometheus_operator_crd() -> None:
    models = pytest.importorskip(
        "cloudcoil.models.prometheus_operator.v1",
        reason="cloudcoil-models-prometheus-operator is not installed (scripts/test.sh installs it"
        " into .venv)")
    sm = manifests()["ServiceMonitor"]
    parsed = models.ServiceMonitor.model_validate(sm)
    # The models ignore fields they do not know: what they kept must be all there was.
    assert parsed.model_dump(by_alias=True, exclude_unset=True) == sm
    spec = sm["spec"]
    assert spec["selector"]["matchLabels"].items() <= \
        manifests()["Service"]["metadata"]["labels"].items()
    assert [e["port"] for e in spec["endpoints"]] == ["metrics"]


def test_the_kustomization_deploys_every_manifest() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(k["resources"]) == sorted(files)


def test_the_memory_limit_is_memory_plus_buffers_plus_overhead_and_cpus_are_pinned() -> None:
    c = server_container()
    memory = size_bytes(env_of(c)["MEMKV_MEMORY"])
    buffers = size_bytes(c["args"][c["args"].index("--max-buffer-memory") + 1])
    res = c["resources"]
    assert res["requests"] == res["limits"], "Guaranteed QoS: the CPU manager pins only those"
    assert size_bytes(res["limits"]["memory"]) == memory + buffers + OVERHEAD
    assert re.fullmatch(r"\d+", res["limits"]["cpu"]), "whole CPUs, or no exclusive cores"


def test_the_probes_ask_the_metrics_port_for_healthz() -> None:
    c = server_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert env_of(c)["MEMKV_METRICS"] == f"0.0.0.0:{ports['metrics']}"
    assert env_of(c)["MEMKV_LISTEN"] == f"0.0.0.0:{ports['data']}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe


def test_the_server_takes_every_flag_and_variable_the_manifest_sets() -> None:
    c = server_container()
    assert c["args"][0] == "serve"
    helptext = subprocess.run(memkv_command() + ["serve", "--help"], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    for flag in (a for a in c["args"] if a.startswith("--")):
        assert f"{flag} <" in helptext, flag
    for name in env_of(c):
        assert f"[env: {name}]" in helptext, name
    assert env_of(c)["MEMKV_AUTH_KEY"] == {"secretKeyRef": {"name": "memkv-auth",
                                                            "key": "auth-key"}}


def test_the_engines_list_every_server_by_its_stable_name() -> None:
    objs = manifests()
    sts, svc = objs["StatefulSet"], objs["Service"]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert objs["PodDisruptionBudget"]["spec"]["selector"] == sts["spec"]["selector"]
    data_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["data"]
    (engine,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = env_of(engine)
    name = sts["metadata"]["name"]
    cfg = load_config(env={"MEMKV_SERVERS": env["MEMKV_SERVERS"], "MEMKV_AUTH_KEY": "ab" * 32,
                           "MEMKV_OP_TIMEOUT_S": env["MEMKV_OP_TIMEOUT_S"]})
    assert cfg.servers == tuple(f"{name}-{i}.{svc['metadata']['name']}:{data_port}"
                                for i in range(sts["spec"]["replicas"]))
    assert env["MEMKV_AUTH_KEY"] == env_of(server_container())["MEMKV_AUTH_KEY"]
    kvt = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    extra = kvt["kv_connector_extra_config"]
    assert kvt["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] == "MemKVTieringOffloadingSpec"
    assert [t["type"] for t in extra["secondary_tiers"]] == ["memkv"]
    assert cfg.op_timeout_s < 5, "below the tier's lookup timeout (docs/deploy.md)"
