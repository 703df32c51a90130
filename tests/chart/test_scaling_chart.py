"""The chart side of scaling: `jobDefaults` become the CRD's schema defaults, so a job created without a scaling
section still gets the chart's autoscaler, disruption budget and spread (rendered by the operator, validated for
Kubernetes 1.29 and 1.33); the operator's RBAC covers the new kinds; a wrong key fails the install by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.spec import parse_spec
from tests.chart.helm import CHART, VALUES_DIR, by_kind, helm, render
from tests.crd_schema import api_server_defaults, spec_schema

K8S = ("1.29", "1.33")
DEFAULTS = {
    "serving": {"replicas": 2},
    "scaling": {
        "serving": {"autoscale": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
        "feedback": {"maxUnavailable": 2},
        "spread": {"topologyKeys": ["kubernetes.io/hostname"], "whenUnsatisfiable": "DoNotSchedule"},
    },
}


def chart_crd(tmp_path: Path, job_defaults: dict[str, Any]) -> dict[str, Any]:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"jobDefaults": job_defaults}))
    out = helm("template", "orl", str(CHART), "--namespace", "onlinerl-system", "-f", str(values)).stdout
    (crd,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "CustomResourceDefinition"]
    return crd


def test_job_defaults_reach_a_job_that_leaves_them_out(tmp_path: Path) -> None:
    schema = spec_schema(chart_crd(tmp_path, DEFAULTS))
    spec = api_server_defaults(schema, {"auth": {"allowAnonymous": True}})
    cfg = parse_spec("demo", spec)
    assert cfg.serving.replicas == 2 and cfg.scaling.serving.autoscale.enabled
    assert cfg.scaling.serving.autoscale.max_replicas == 6 and cfg.scaling.feedback.max_unavailable == 2
    manifests = render_all(RenderContext(name="demo", namespace="team-a", uid="u-1", cfg=cfg))
    found = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    assert found[("HorizontalPodAutoscaler", "demo-serving")]["spec"]["maxReplicas"] == 6
    assert found[("PodDisruptionBudget", "demo-serving")]["spec"]["maxUnavailable"] == 1
    (spread,) = found[("Deployment", "demo-serving")]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "DoNotSchedule"
    for m in manifests:
        if m["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "Deployment"):
            for version in K8S:
                kubernetes_validate.validate(m, version, strict=True)
    # A job that sets the field keeps its own value: defaults only fill what is absent.
    own = api_server_defaults(
        schema, {"auth": {"allowAnonymous": True}, "scaling": {"serving": {"autoscale": {"maxReplicas": 3}}}}
    )
    assert parse_spec("demo", own).scaling.serving.autoscale.max_replicas == 3
    assert parse_spec("demo", own).scaling.serving.autoscale.enabled  # the sibling default still applies


def test_without_job_defaults_the_crd_is_the_generated_one(tmp_path: Path) -> None:
    source = yaml.safe_load((CHART / "files" / "crds" / "onlinerljob.yaml").read_text())
    assert chart_crd(tmp_path, {})["spec"] == source["spec"]
    defaults = spec_schema(chart_crd(tmp_path, {}))["properties"]["scaling"]["properties"]["serving"]
    assert defaults["properties"]["autoscale"]["properties"]["enabled"]["default"] is False


@pytest.mark.parametrize(
    ("job_defaults", "path"),
    [
        ({"scaling": {"bogus": 1}}, "jobDefaults.scaling.bogus"),
        (
            {"scaling": {"serving": {"autoscale": {"maxReplica": 4}}}},
            "jobDefaults.scaling.serving.autoscale.maxReplica",
        ),
        ({"job": "x"}, "jobDefaults.job"),
    ],
)
def test_a_job_default_that_is_not_a_spec_field_fails_the_install(
    tmp_path: Path, job_defaults: dict[str, Any], path: str
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"jobDefaults": job_defaults}))
    proc = helm("template", "orl", str(CHART), "-f", str(values), check=False)
    assert proc.returncode != 0
    assert f"{path}: not a field of the OnlineRLJob spec" in proc.stderr


def test_operator_rbac_covers_the_scaling_and_jobset_kinds() -> None:
    roles = by_kind(render(None, False), "ClusterRole")
    (role,) = [r for r in roles if any("onlinerljobs" in rule["resources"] for rule in r["rules"])]
    for group, resource in (
        ("autoscaling", "horizontalpodautoscalers"),
        ("policy", "poddisruptionbudgets"),
        ("keda.sh", "scaledobjects"),
        ("jobset.x-k8s.io", "jobsets"),
    ):
        verbs = {v for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}
        assert verbs == {"get", "create", "patch", "delete"}, (group, resource, verbs)


def test_the_job_defaults_values_file_reaches_the_rendered_trainer_and_autoscalers() -> None:
    """tests/chart/values/job-defaults.yaml (also linted and validated by test_render's matrix) end to end."""
    (crd,) = by_kind(render(VALUES_DIR / "job-defaults.yaml", False), "CustomResourceDefinition")
    cfg = parse_spec("demo", api_server_defaults(spec_schema(crd), {"auth": {"allowAnonymous": True}}))
    assert cfg.trainer.nodes == 2 and cfg.scaling.feedback.autoscale.enabled
    manifests = render_all(RenderContext(name="demo", namespace="team-a", uid="u-1", cfg=cfg))
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert {("HorizontalPodAutoscaler", "demo-serving"), ("HorizontalPodAutoscaler", "demo-feedback")} <= kinds
    assert {("Service", "demo-trainer-ranks"), ("Job", "demo-trainer")} <= kinds
    for m in manifests:
        if m["kind"] not in ("ServiceMonitor", "PodMonitor"):
            for version in K8S:
                kubernetes_validate.validate(m, version, strict=True)
