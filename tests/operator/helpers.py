"""Schema helpers for the operator tests: the CRD as committed, and its schemas usable by jsonschema."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "onlinerljob.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def example_jobs() -> dict[str, dict[str, Any]]:
    """metadata.name -> spec of every OnlineRLJob in examples/."""
    out = {}
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "OnlineRLJob":
                out[doc["metadata"]["name"]] = doc["spec"]
    return out


def committed_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes) -> JSON Schema for the `jsonschema` package: nullable -> type [t, null], boolean
    exclusive bounds -> numeric ones, x-kubernetes-* dropped; also forbid unknown fields the way kubectl's strict
    field validation does."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(flag) is True:
            out[flag] = out.pop(bound)
        elif out.get(flag) is False:
            out.pop(flag)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def strip_none(value: Any) -> Any:
    """What a JSON merge patch leaves stored: null members removed."""
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


def status_jsonschema() -> dict[str, Any]:
    return to_jsonschema(copy.deepcopy(version_schema(committed_crd())["properties"]["status"]))


def spec_jsonschema() -> dict[str, Any]:
    return to_jsonschema(copy.deepcopy(version_schema(committed_crd())["properties"]["spec"]))
