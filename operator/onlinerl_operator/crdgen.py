"""Generate the OnlineRLJob CRD from the pydantic models: the config model IS the spec, JobStatus IS the status.

One source of truth: `tools/gen_crd.py` writes crds/onlinerljob.yaml from here, and a test fails when the committed
file is stale. JSON Schema (pydantic) differs from a Kubernetes *structural* schema, so :func:`structural` inlines
``$ref``s, turns ``anyOf [X, null]`` into ``nullable``, rewrites draft-2020 ``exclusiveMinimum: n`` into the OpenAPI v3
``minimum: n, exclusiveMinimum: true`` form, drops ``title``/``additionalProperties: false`` (structural schemas prune
unknown fields instead), and gives every object a ``default: {}`` so the API server applies nested defaults.
"""

from __future__ import annotations

import copy
from typing import Any

from onlinerl.config import OnlineRLConfig
from onlinerl.config_rules import RULES
from onlinerl_operator import constants as c
from onlinerl_operator.status import JobStatus

_DROP = {"title", "$defs"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **extra}
    return node


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON-Schema node (pydantic output) -> one Kubernetes structural-schema node."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf with {len(options)} non-null options structurally: {node}")
        merged = {**{k: v for k, v in node.items() if k != "anyOf"}, **_resolve(options[0], defs)}
        out = structural(merged, defs)
        if nullable:
            out["nullable"] = True
            if out.get("default") is None:
                out.pop("default", None)
        return out
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out["properties"] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out["additionalProperties"] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "default" and value is None:
            continue
        else:
            out[key] = copy.deepcopy(value)
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = "integer" if kinds == {int} else "string"
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("default", {})
    return out


def spec_schema() -> dict[str, Any]:
    raw = OnlineRLConfig.model_json_schema(by_alias=True)
    defs = raw.get("$defs", {})
    schema = structural(raw, defs)
    schema["properties"].pop("job")  # the job name is metadata.name
    schema["description"] = (
        "The onlinerl configuration (onlinerl.config.OnlineRLConfig) without `job`, which is metadata.name. "
        "Each component receives this spec as its config file."
    )
    model = schema["properties"]["model"]
    model["x-kubernetes-validations"] = [
        {
            "rule": "self == oldSelf",
            "message": (
                "spec.model is immutable: trained checkpoints belong to one base model; create a new OnlineRLJob"
            ),
        }
    ]
    attach_rules(schema)
    return schema


def attach_rules(spec: dict[str, Any]) -> None:
    """Each limit between fields (onlinerl.config_rules) as a CEL validation at its place in the spec schema: the
    API server refuses what the operator and `onlinerl config check` refuse, with the same message."""
    for rule in RULES:
        node = spec
        for part in filter(None, rule.at.split(".")):
            node = node["properties"][part]
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})


def status_schema() -> dict[str, Any]:
    raw = JobStatus.model_json_schema(by_alias=True)
    schema = structural(raw, raw.get("$defs", {}))
    schema["description"] = "Observed state, written only by the operator (status subresource)."
    schema["properties"]["conditions"]["x-kubernetes-list-type"] = "map"
    schema["properties"]["conditions"]["x-kubernetes-list-map-keys"] = ["type"]
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Stable", "type": "integer", "jsonPath": ".status.stableVersion", "description": "Stable policy version"},
    {"name": "Candidate", "type": "integer", "jsonPath": ".status.candidateVersion"},
    {
        "name": "Accept",
        "type": "number",
        "format": "float",
        "jsonPath": ".status.acceptRate",
        "description": "Accept rate of the stable version",
    },
    {"name": "Samples", "type": "integer", "jsonPath": ".status.samplesTrained", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{c.PLURAL}.{c.GROUP}", "labels": {"app.kubernetes.io/name": "onlinerl"}},
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "listKind": f"{c.KIND}List",
                "categories": ["onlinerl"],
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "An online RL loop for code completion: serving, feedback, trainer and rollout."
                            ),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {
                                    "type": "object",
                                    "properties": {
                                        "name": {
                                            "type": "string",
                                            "maxLength": 48,
                                            "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$",
                                        }
                                    },
                                },
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_yaml() -> str:
    import yaml

    header = "# GENERATED by tools/gen_crd.py from onlinerl.config.OnlineRLConfig: do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
