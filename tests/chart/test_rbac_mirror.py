"""The chart's RBAC grants exactly what operator/rbac.yaml (the operator's own least-privilege statement) grants."""

from __future__ import annotations

import yaml

from tests.chart.helm import ROOT, by_kind, render

OPERATOR_RBAC = ROOT / "operator" / "rbac.yaml"


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule.get("apiGroups", [""])
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_chart_rbac_equals_operator_rbac() -> None:
    docs = [d for d in yaml.safe_load_all(OPERATOR_RBAC.read_text()) if d]
    theirs = grants([r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]])
    chart = render(None, False)
    ours = grants([r for d in by_kind(chart, "ClusterRole") for r in d["rules"]])
    assert ours == theirs, (
        f"only in chart: {sorted(ours - theirs)}; only in operator/rbac.yaml: {sorted(theirs - ours)}"
    )


def test_chart_rbac_covers_every_kind_the_operator_renders() -> None:
    """Independent of rbac.yaml: every apiVersion/kind the operator renders is granted create+patch."""
    import re

    source = (ROOT / "operator" / "onlinerl_operator" / "render.py").read_text()
    kinds = set(re.findall(r'"kind": "(\w+)"', source)) - {"OnlineRLJob"}
    plural = {
        "ConfigMap": "configmaps",
        "Service": "services",
        "PersistentVolumeClaim": "persistentvolumeclaims",
        "Deployment": "deployments",
        "StatefulSet": "statefulsets",
        "Job": "jobs",
        "Ingress": "ingresses",
        "NetworkPolicy": "networkpolicies",
        "ServiceMonitor": "servicemonitors",
        "PodMonitor": "podmonitors",
        "Secret": "secrets",
    }
    ours = grants([r for d in by_kind(render(None, False), "ClusterRole") for r in d["rules"]])
    granted = {(res, verb) for _, res, verb in ours}
    unknown = kinds - set(plural)
    assert not unknown, f"operator renders kinds the chart test does not know: {unknown}"
    for kind in kinds - {"Secret"}:
        for verb in ("get", "create", "patch", "delete"):
            assert (plural[kind], verb) in granted, f"operator renders {kind} but may not {verb} it"
    # The generated Redis password Secret is created once, never patched (that would change it under the pods).
    assert {v for r, v in granted if r == "secrets"} == {"get", "create"}
