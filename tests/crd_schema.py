"""The OnlineRLJob CRD's spec schema as the API server uses it: where it sits, and its structural defaulting."""

from __future__ import annotations

import copy
from typing import Any


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def api_server_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: absent fields with a default get it, then their children."""
    if not isinstance(obj, dict) or "properties" not in schema:
        return obj
    out = dict(obj)
    for key, prop in schema["properties"].items():
        if key not in out and "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
        if key in out:
            out[key] = api_server_defaults(prop, out[key])
    return out
