"""The operator's own pod from the chart's values (real helm): every scheduling field a platform needs reaches the
pod, and operator.podLabels cannot take the labels the Deployment's selector matches. Validity of the rendered pod on
Kubernetes 1.29 and 1.33 is test_render.py's (it renders every values file, this one included)."""

from __future__ import annotations

from tests.chart.helm import VALUES_DIR, by_kind, render

PLACEMENT = VALUES_DIR / "operator-pod-placement.yaml"


def operator_deployment(values=None) -> dict:
    (deploy,) = by_kind(render(values, False), "Deployment")
    return deploy


def test_every_pod_field_of_the_values_reaches_the_operator_pod() -> None:
    template = operator_deployment(PLACEMENT)["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"node-pool": "platform"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "platform", "effect": "NoSchedule"}
    ]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["amd64", "arm64"]
    assert pod["priorityClassName"] == "platform-critical"
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    annotations = template["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert len(annotations["checksum/crd"]) == 16  # the chart's own annotation is kept


def test_pod_labels_cannot_take_the_selector_labels() -> None:
    deploy = operator_deployment(PLACEMENT)
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "operator"  # values asked for not-the-operator
    assert all(labels[k] == v for k, v in selector.items())


def test_defaults_leave_the_optional_fields_out() -> None:
    pod = operator_deployment()["spec"]["template"]["spec"]
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName"):
        assert field not in pod, field
    assert "topologySpreadConstraints" not in pod
