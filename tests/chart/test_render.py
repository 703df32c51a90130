"""The chart lints strictly, renders over a matrix of values files with and without the monitoring API, and every
rendered manifest is valid Kubernetes (kubernetes-validate, strict, 1.29 and 1.33) or, for Prometheus-operator kinds,
structurally right. Behaviour of the switches (RBAC scope, Redis durability, monitoring auto/on/off) is asserted."""

from __future__ import annotations

import itertools
from pathlib import Path

import kubernetes_validate
import pytest

from tests.chart.helm import CHART, VALUES_FILES, by_kind, helm, render

K8S_VERSIONS = ("1.29", "1.33")
PROMETHEUS_KINDS = {"PrometheusRule", "PodMonitor", "ServiceMonitor"}
MATRIX = list(itertools.product(VALUES_FILES, (False, True)))
IDS = [f"{v.stem}-{'monitoring' if m else 'plain'}" for v, m in MATRIX]


def test_helm_lint_strict() -> None:
    for values in VALUES_FILES:
        out = helm("lint", "--strict", str(CHART), "-f", str(values)).stdout
        assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize(("values", "monitoring_api"), MATRIX, ids=IDS)
def test_every_manifest_validates(values: Path, monitoring_api: bool) -> None:
    docs = render(values, monitoring_api)
    assert docs, "rendered nothing"
    names = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"])
        assert key not in names, f"duplicate object {key}"
        names.add(key)
        assert len(doc["metadata"]["name"]) <= 63 or doc["kind"] == "CustomResourceDefinition"
        if doc["kind"] in PROMETHEUS_KINDS:
            check_prometheus_object(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {err.message} at {list(err.path)}"
                )


def check_prometheus_object(doc: dict) -> None:
    """No schema for CRD-typed kinds in kubernetes-validate: check the fields Prometheus operator requires."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    if doc["kind"] == "PrometheusRule":
        assert spec["groups"], "empty rule groups"
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
                assert rule["alert"].isidentifier() and rule["expr"].strip()
                assert rule["labels"]["severity"] in {"critical", "warning", "info"}
                assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    else:
        assert spec["selector"]["matchLabels"]
        endpoints = spec.get("podMetricsEndpoints") or spec.get("endpoints")
        assert endpoints and all(e["port"] and e["path"] == "/metrics" for e in endpoints)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_operator_deployment_runs_the_operator_module_with_probes() -> None:
    docs = render(None, False)
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "onlinerl_operator"]  # operator/onlinerl_operator/__main__.py
    env = _env(container)
    assert env["ONLINERL_OPERATOR_NAMESPACES"] == "" and env["ONLINERL_LOG_LEVEL"] == "INFO"
    assert env["ONLINERL_OPERATOR_INTERVAL"] == "10"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == 8080  # docs/architecture.md: operator port
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert pod["serviceAccountName"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert container["image"] == "ghcr.io/onlinerl/onlinerl-operator:0.1.0"  # tag defaults to appVersion


def test_operator_constants_match_the_chart() -> None:
    from onlinerl_operator import constants

    assert constants.OPERATOR_PORT == 8080
    assert constants.GROUP == "onlinerl.dev" and constants.PLURAL == "onlinerljobs"


def _rules(docs, kind: str) -> list[dict]:
    return [rule for role in by_kind(docs, kind) for rule in role["rules"]]


def test_rbac_is_least_privilege_and_cluster_wide_by_default() -> None:
    docs = render(None, False)
    assert not by_kind(docs, "Role")
    rules = _rules(docs, "ClusterRole")
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
    secrets = [r for r in rules if "secrets" in r["resources"]]
    # Secrets: read by name, and created once (a job's generated Redis password); never listed, patched or deleted.
    assert secrets and all(set(r["verbs"]) <= {"get", "create"} for r in secrets), "secrets: get and create only"
    granted = {(g, res) for r in rules for g in r["apiGroups"] for res in r["resources"]}
    for needed in [
        ("onlinerl.dev", "onlinerljobs"),
        ("onlinerl.dev", "onlinerljobs/status"),
        ("apps", "deployments"),
        ("apps", "statefulsets"),
        ("", "services"),
        ("", "configmaps"),
        ("", "persistentvolumeclaims"),
        ("batch", "jobs"),
        ("networking.k8s.io", "ingresses"),
        ("monitoring.coreos.com", "servicemonitors"),
        ("monitoring.coreos.com", "podmonitors"),
        ("", "events"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
    ]:
        assert needed in granted, f"operator lacks {needed}"
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "orl-onlinerl", "namespace": "onlinerl-system"}
        ]


def test_watch_namespaces_gives_roles_only_there() -> None:
    docs = render(VALUES_FILES[[v.stem for v in VALUES_FILES].index("namespaced")], False)
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    cluster_resources = {res for r in _rules(docs, "ClusterRole") for res in r["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces"}, "only discovery stays cluster-wide"
    env = _env(by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0])
    assert env["ONLINERL_OPERATOR_NAMESPACES"] == "team-a,team-b"
    assert env["ONLINERL_LOG_LEVEL"] == "DEBUG" and env["TZ"] == "UTC"


def _values(stem: str) -> Path:
    return next(v for v in VALUES_FILES if v.stem == stem)


def test_redis_is_durable_and_persistent() -> None:
    docs = render(_values("shared-redis"), False)
    (sts,) = by_kind(docs, "StatefulSet")
    conf = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-config"))
    lines = conf["data"]["valkey.conf"].splitlines()
    for setting in ("appendonly yes", "appendfsync always", "maxmemory-policy noeviction", "maxmemory 4gb"):
        assert setting in lines
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    assert set(secrets) == {"orl-onlinerl-redis", "demo-redis-urls", "second-job-redis-urls"}
    components = ("gateway", "reloader", "feedback", "trainer", "rollout", "operator")
    users = [f"{job}.{c}" for job in ("demo", "second-job") for c in components] + ["admin"]
    assert sorted(secrets["orl-onlinerl-redis"]["data"]) == sorted(users)
    assert all(len(secrets["orl-onlinerl-redis"]["data"][u]) > 20 for u in users)
    assert secrets["demo-redis-urls"]["metadata"]["namespace"] == "team-a"
    assert sorted(secrets["demo-redis-urls"]["data"]) == sorted(components)
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "/etc/redis-acl/start.sh", "/etc/valkey/valkey.conf"]


def test_redis_existing_secret_and_no_volume() -> None:
    docs = render(_values("redis-existing-secret-no-persistence"), False)
    assert not by_kind(docs, "Secret"), "an existing Secret must not be shadowed by a chart one"
    sts = by_kind(docs, "StatefulSet")[0]
    assert "volumeClaimTemplates" not in sts["spec"]
    env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[0]["valueFrom"]["secretKeyRef"] == {"name": "my-redis-password", "key": "demo.gateway"}
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"my-redis-password"}


@pytest.mark.parametrize(
    ("stem", "monitoring_api", "expected"),
    [
        ("default", False, set()),
        ("default", True, {"PrometheusRule", "PodMonitor"}),
        ("monitoring-on", False, {"PrometheusRule", "PodMonitor"}),
        ("monitoring-off", True, set()),
    ],
)
def test_monitoring_objects_follow_the_api_and_the_switch(stem: str, monitoring_api: bool, expected: set) -> None:
    docs = render(_values(stem), monitoring_api)
    assert {d["kind"] for d in docs} & PROMETHEUS_KINDS == expected


def test_monitoring_labels_and_group_by_reach_the_rules() -> None:
    docs = render(_values("monitoring-on"), False)
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all("by (namespace, service)" in e for e in exprs if "by (" in e)
    assert any("[2h]" in e and "- 0.03" in e for e in exprs)
    assert all(r["labels"]["team"] == "ml-platform" for g in rule["spec"]["groups"] for r in g["rules"])


def test_dashboards_ship_as_labelled_configmaps() -> None:
    docs = render(_values("monitoring-on"), False)
    maps = [c for c in by_kind(docs, "ConfigMap") if "grafana_dashboard" in c["metadata"]["labels"]]
    assert {c["metadata"]["namespace"] for c in maps} == {"monitoring"}
    files = {name for c in maps for name in c["data"]}
    assert files == {p.name for p in (CHART / "dashboards").glob("*.json")}
    for c in maps:
        assert c["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, body),) = c["data"].items()
        assert body.rstrip() == (CHART / "dashboards" / name).read_text().rstrip(), "dashboard altered in transit"
    assert not [c for c in by_kind(render(_values("monitoring-off"), False), "ConfigMap")]


def test_schema_rejects_bad_values_with_the_path() -> None:
    for flag, path in [
        ("redis.bogus=1", "/redis"),
        ("operator.logLevel=loud", "/operator/logLevel"),
        ("monitoring.prometheusRule=maybe", "/monitoring/prometheusRule"),
        ("monitoring.alerts.acceptRateWindow=soon", "/monitoring/alerts/acceptRateWindow"),
    ]:
        proc = helm("template", "orl", str(CHART), "--set", flag, check=False)
        assert proc.returncode != 0 and path in proc.stderr, (flag, proc.stderr)
