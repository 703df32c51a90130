"""From an OnlineRLJob spec to a validated OnlineRLConfig, plus the cross-field rules a schema cannot express.

Both failure kinds raise :class:`SpecError` with a message that names the field and what to change; the handlers
turn it into an ``InvalidSpec`` condition instead of retrying forever (a crash loop helps nobody).
"""

from __future__ import annotations

from typing import Any

from onlinerl.config import ConfigError, OnlineRLConfig, from_mapping
from onlinerl.config_rules import refusals


class SpecError(ValueError):
    """The spec cannot be deployed as written; the message says which field to fix."""


def semantic_problems(cfg: OnlineRLConfig) -> list[str]:
    """Rules across fields: each entry names the fields and the fix. The limits between spec fields are
    onlinerl.config_rules (also the CRD's CEL rules and `onlinerl config check`); the job's name is metadata's."""
    problems = refusals(cfg.dump(), cluster=True)
    if not cfg.job[:1].isalpha():
        problems.append(f"metadata.name {cfg.job!r} must start with a letter (it prefixes Service names)")
    return problems


def parse_spec(name: str, spec: dict[str, Any] | None) -> OnlineRLConfig:
    """Validate ``spec`` (camelCase) as the config of job ``name``; raise SpecError naming every bad field."""
    data = dict(spec or {})
    if "job" in data:
        raise SpecError("spec.job is not a field: the job name is metadata.name")
    data["job"] = name
    try:
        cfg = from_mapping(data)
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    problems = semantic_problems(cfg)
    if problems:
        raise SpecError("; ".join(problems))
    return cfg
