"""The CRD: generated from the config model (and up to date), structural, valid, and accepting the examples."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl_operator.crdgen import build_crd, render_yaml
from onlinerl_operator.reconcile import compose_status
from onlinerl_operator.spec import SpecError, parse_spec
from onlinerl_operator.status import Observation
from tests.operator.helpers import (
    CRD_FILE,
    EXAMPLES,
    committed_crd,
    spec_jsonschema,
    status_jsonschema,
    strip_none,
    version_schema,
)

K8S_VERSIONS = ("1.29", "1.33")


def test_committed_crd_is_generated_from_the_models() -> None:
    assert CRD_FILE.read_text() == render_yaml(), "crds/onlinerljob.yaml is stale: run python tools/gen_crd.py"


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_crd_manifest_validates_strictly(k8s: str) -> None:
    kubernetes_validate.validate(committed_crd(), k8s, strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules the API server enforces."""
    bad = []
    if (
        "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        bad.append(f"{path or '<root>'}: no type")
    for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "$defs", "title", "const"):
        if forbidden in node:
            bad.append(f"{path}: {forbidden}")
    if node.get("additionalProperties") is False or ("additionalProperties" in node and "properties" in node):
        bad.append(f"{path}: additionalProperties with properties")
    for flag in ("exclusiveMinimum", "exclusiveMaximum"):
        if flag in node and not isinstance(node[flag], bool):
            bad.append(f"{path}: {flag} must be a boolean in OpenAPI v3")
    if "default" in node and node["default"] is None:
        bad.append(f"{path}: default null")
    for name, sub in (node.get("properties") or {}).items():
        bad += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


def test_schema_is_structural_and_covers_the_issue() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert crd["spec"]["group"] == "onlinerl.dev" and version["name"] == "v1alpha1"
    assert crd["spec"]["scope"] == "Namespaced" and "orl" in crd["spec"]["names"]["shortNames"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Stable": ".status.stableVersion",
        "Candidate": ".status.candidateVersion",
        "Accept": ".status.acceptRate",
        "Samples": ".status.samplesTrained",
        "Age": ".metadata.creationTimestamp",
    }
    spec = schema["properties"]["spec"]["properties"]
    assert "job" not in spec  # metadata.name
    assert spec["model"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    # types, enums, bounds and defaults come through from the pydantic model
    trainer = spec["trainer"]["properties"]
    assert trainer["zeroStage"] == {"type": "integer", "enum": [2, 3], "default": 2}
    assert trainer["weights"]["enum"] == ["lora", "full"]
    clip = trainer["algorithm"]["properties"]["clipEps"]
    assert clip["minimum"] == 0 and clip["exclusiveMinimum"] is True and clip["maximum"] == 1
    assert trainer["algorithm"]["properties"]["dualClip"]["nullable"] is True
    assert spec["serving"]["properties"]["replicas"] == {"type": "integer", "default": 1, "minimum": 0, "maximum": 1000}
    assert spec["monitoring"]["properties"]["serviceMonitor"]["enum"] == ["on", "off", "auto"]
    assert spec["rollout"]["properties"]["pinnedVersion"]["nullable"] is True
    for section in ("model", "serving", "feedback", "redis", "trainer", "storage", "ingress", "monitoring", "rollout"):
        assert spec[section]["default"] == {}, f"{section}: nested defaults need default: {{}}"
    # every config field is in the CRD: the model is the one source of truth
    assert set(spec) == set(OnlineRLConfig.model_json_schema(by_alias=True)["properties"]) - {"job"}


def _example_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}#{i}", d) for p in EXAMPLES for i, d in enumerate(yaml.safe_load_all(p.read_text())) if d]


@pytest.mark.parametrize("name,doc", _example_docs(), ids=[n for n, _ in _example_docs()])
def test_examples_are_valid(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] != "OnlineRLJob":
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(doc, k8s, strict=True)
        return
    schema = version_schema(committed_crd())
    jsonschema.validate(doc["spec"], spec_jsonschema())
    jsonschema.validate(
        doc["metadata"]["name"],
        {
            "type": "string",
            **{k: schema["properties"]["metadata"]["properties"]["name"][k] for k in ("pattern", "maxLength")},
        },
    )
    parse_spec(doc["metadata"]["name"], doc["spec"])  # the cross-field rules pass too


def test_examples_cover_cpu_single_gpu_and_eight_gpus() -> None:
    jobs = [d for _, d in _example_docs() if d["kind"] == "OnlineRLJob"]
    gpus = sorted(d["spec"].get("trainer", {}).get("gpus", 0) for d in jobs)
    assert gpus == [0, 1, 8]
    big = next(d for d in jobs if d["spec"]["trainer"]["gpus"] == 8)["spec"]["trainer"]
    assert big["weights"] == "full" and big["zeroStage"] == 3


def test_schema_rejects_what_it_should() -> None:
    schema = spec_jsonschema()
    for bad in (
        {"trainer": {"zeroStage": 1}},
        {"serving": {"replicas": -1}},
        {"trainer": {"weights": "qlora"}},
        {"rollout": {"canaryShare": 1.5}},
        {"trainer": {"algorithm": {"clipEps": 0}}},
        {"serving": {"replica": 2}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"auth": {"allowAnonymous": True}, "trainer": {"weights": "full"}}, "serving.weightsMode"),
        ({"auth": {"allowAnonymous": True}, "trainer": {"batchSize": 4, "microBatchSize": 8}}, "microBatchSize"),
        ({}, "auth.apiKeysSecret"),
        ({"auth": {"allowAnonymous": True}, "model": {"fimTemplate": "nope"}}, "model.fimTemplate"),
        ({"auth": {"allowAnonymous": True}, "serving": {"replicas": "many"}}, "serving.replicas"),
        ({"auth": {"allowAnonymous": True}, "job": "x"}, "metadata.name"),
    ],
)
def test_semantic_errors_name_the_field(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecError, match=needle.replace(".", r"\.")):
        parse_spec("demo", spec)


@pytest.mark.parametrize(
    "obs",
    [
        Observation(generation=1),
        Observation(generation=3, invalid="trainer.weights must match"),
        Observation(
            generation=2,
            serving_ready=True,
            feedback_ready=True,
            trainer_state="running",
            stable_version=4,
            candidate_version=5,
        ),
        Observation(
            generation=2,
            serving_ready=True,
            feedback_ready=False,
            trainer_state="failed",
            trainer_message="failed 3 times",
            problems=["Redis not reachable"],
        ),
    ],
)
def test_composed_status_validates_against_the_crd(obs: Observation) -> None:
    status = compose_status(
        {},
        obs,
        obs.generation,
        {"trainerRestarts": 2, "acceptRate": 0.31, "stableVersion": 4, "lastCheckpointTime": "2026-11-20T10:00:00Z"},
        "2026-11-20T10:00:01Z",
    )
    jsonschema.validate(strip_none(status), status_jsonschema())
    assert [c["type"] for c in status["conditions"]] == [
        "Ready",
        "ServingReady",
        "FeedbackReady",
        "TrainerRunning",
        "PolicyPromoted",
        "Degraded",
    ]
