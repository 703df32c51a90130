"""Pure merging of pod-template fragments (onlinerl.pod_template) into the pods the operator renders.

Two steps, both pure functions:

1. :func:`merge_fragments` -- the job-wide ``spec.podTemplate`` and one component's ``spec.<component>.podTemplate``
   become that component's fragment: maps merged key by key and scalars taken from the component; lists appended (job
   first). One exception: ``nodeSelectorTerms`` are alternatives (ORed), so the component's terms replace the job's
   (appending would let the pod run on the job's nodes as well).
2. :func:`apply_fragment` -- the fragment over a rendered pod template. What the operator rendered wins: its labels
   (selectors, cleanup and the NetworkPolicies match them), its annotations (the config hash), and any field it set.
   A fragment that tries to change one is reported as a conflict (:func:`pod_template_problems`: the job turns
   Degraded with reason PodTemplateConflict, and the operator posts an Event), never a crash. Lists are appended
   after the operator's entries (tolerations, topologySpreadConstraints, imagePullSecrets).

The fragment reaches every pod a job creates: the serving, feedback and rollout Deployments, the Redis StatefulSet and
the trainer (Job, Indexed Job, or each Job of the JobSet).
"""

from __future__ import annotations

import copy
from typing import Any

from onlinerl.config import OnlineRLConfig

Manifest = dict[str, Any]
COMPONENTS = ("serving", "feedback", "trainer", "redis", "rollout")
REPLACED_LISTS = frozenset({"nodeSelectorTerms"})  # alternatives: the component's replace the job's


def merge_fragments(job: dict[str, Any], component: dict[str, Any]) -> dict[str, Any]:
    """``component`` over ``job`` (both in Kubernetes spelling): maps merged, component's scalars win, lists
    appended (except :data:`REPLACED_LISTS`)."""
    return _merge(job, component, path=())


def _merge(base: Any, over: Any, path: tuple[str, ...]) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = _merge(out[key], value, (*path, key)) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(over, list):
        if path and path[-1] in REPLACED_LISTS:
            return copy.deepcopy(over)
        return copy.deepcopy(base) + copy.deepcopy(over)
    return copy.deepcopy(over)


def component_fragment(cfg: OnlineRLConfig, component: str) -> dict[str, Any]:
    """The fragment for ``component``'s pods: its own ``podTemplate`` merged over the job-wide one."""
    if component not in COMPONENTS:
        raise ValueError(f"no pod template for component {component!r} (one of {', '.join(COMPONENTS)})")
    own = getattr(cfg, component).pod_template.as_kubernetes()
    return merge_fragments(cfg.pod_template.as_kubernetes(), own)


def apply_fragment(template: dict[str, Any], fragment: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``fragment`` over a rendered PodTemplateSpec. Returns the merged template and the conflicts: one line per
    field the fragment wanted to change that the operator owns (its value is kept)."""
    out = copy.deepcopy(template)
    conflicts: list[str] = []
    for part in ("metadata", "spec"):
        given = fragment.get(part) or {}
        if given:
            out[part] = _over_rendered(out.get(part) or {}, given, part, conflicts)
    return out, conflicts


def _over_rendered(rendered: Any, given: Any, path: str, conflicts: list[str]) -> Any:
    """``given`` added to ``rendered``: new keys added, lists appended, dicts merged; a different scalar where the
    operator set one is a conflict, and the operator's value stays."""
    if isinstance(rendered, dict) and isinstance(given, dict):
        out = dict(rendered)
        for key, value in given.items():
            if key in out:
                out[key] = _over_rendered(out[key], value, f"{path}.{key}", conflicts)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(rendered, list) and isinstance(given, list):
        return rendered + [copy.deepcopy(v) for v in given if v not in rendered]
    if rendered != given:
        conflicts.append(f"{path}: the operator sets {rendered!r}, podTemplate asks for {given!r}")
    return rendered


def pod_templates(manifest: Manifest) -> list[dict[str, Any]]:
    """Every PodTemplateSpec inside a workload manifest (Deployment, StatefulSet, Job: one; JobSet: one per
    replicated Job); the dicts themselves, so a caller may replace their contents."""
    kind = manifest.get("kind")
    spec = manifest.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return [spec["template"]]
    if kind == "JobSet":
        return [r["template"]["spec"]["template"] for r in spec.get("replicatedJobs") or []]
    return []


def customise(cfg: OnlineRLConfig, component: str, manifest: Manifest) -> tuple[Manifest, list[str]]:
    """The workload ``manifest`` of ``component`` with its fragment merged into every pod template it holds, and
    the conflicts (each prefixed with the kind and the component)."""
    fragment = component_fragment(cfg, component)
    if not any(fragment.values()):
        return manifest, []
    out = copy.deepcopy(manifest)
    conflicts = []
    for template in pod_templates(out):
        merged, found = apply_fragment(template, fragment)
        template.clear()
        template.update(merged)
        conflicts += [f"{out['kind']} {out['metadata']['name']} ({component}): {c}" for c in found]
    return out, conflicts
