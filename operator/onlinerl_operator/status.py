"""The OnlineRLJob status: its schema (a pydantic model, also the CRD's status schema) and pure functions that derive
conditions and the phase from what the operator observed. No I/O here, so every rule is unit-testable."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from onlinerl.schemas import PolicyTable

ConditionType = Literal["Ready", "ServingReady", "FeedbackReady", "TrainerRunning", "PolicyPromoted", "Degraded"]
CONDITION_TYPES: tuple[str, ...] = ConditionType.__args__  # type: ignore[attr-defined]
Phase = Literal["Pending", "Running", "Suspended", "Degraded", "Failed", "Invalid"]
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Reason(StrEnum):
    """Every condition reason the operator writes: typed, so a reason is never a typo and tools can match on them."""

    INVALID_SPEC = "InvalidSpec"
    ALL_COMPONENTS_READY = "AllComponentsReady"
    COMPONENTS_NOT_READY = "ComponentsNotReady"
    READY = "Ready"
    NOT_READY = "NotReady"
    RUNNING = "Running"
    STARTING = "Starting"
    SUSPENDED = "Suspended"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    RESTARTING = "Restarting"
    COMPLETED = "Completed"
    NOT_CREATED = "NotCreated"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    GATE_FAILED = "GateFailed"
    BASE_MODEL = "BaseModel"
    UNKNOWN = "Unknown"
    PROBLEMS = "Problems"
    HEALTHY = "Healthy"
    # The Kubernetes API refused a reconcile step (Degraded): the step and what to do are in the message.
    API_FORBIDDEN = "ApiForbidden"  # 403: RBAC; retried slowly, an admin can grant it without a spec change
    API_INVALID = "ApiInvalid"  # 400/422: the rendered object is refused; retried on a spec change, or slowly
    API_CONFLICT = "ApiConflict"  # 409: someone else changed it; retried at once
    API_UNAVAILABLE = "ApiUnavailable"  # 429/5xx and anything else: retried with a delay
    # A pod-template fragment asks to change a field the operator owns (Degraded; the operator's value is kept).
    POD_TEMPLATE_CONFLICT = "PodTemplateConflict"


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_Status):
    """metav1.Condition: the format kubectl, Argo CD and `kubectl wait --for=condition=Ready` understand."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=REASON_PATTERN, max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class Endpoints(_Status):
    completions: str = Field("", description="In-cluster URL of the OpenAI-compatible completions API.")
    feedback: str = Field(
        "", description="In-cluster URL of stock Continue's training-data upload (its config.yaml data: destination)."
    )
    ingress: str = Field("", description="External base URL when an Ingress is enabled.")
    continue_config: str = Field(
        "",
        max_length=8192,
        description="config.yaml for stock Continue (VS Code, JetBrains) pointing at this job, through the Ingress "
        "when enabled: merge it into ~/.continue/config.yaml and put one of spec.auth's keys where it says "
        "<your-api-key>. The same config `onlinerl up` prints.",
    )


class ProjectLineStatus(_Status):
    """One project's own policy line (projects.adapters): what it serves and its newest rollout decision."""

    stable_version: int | None = Field(None, ge=0)
    candidate_version: int | None = Field(None, ge=0)
    pinned_version: int | None = Field(None, ge=0)
    paused: bool | None = None
    last_decision: str | None = Field(None, max_length=256, description="kind, version, actor and reason.")


class JobStatus(_Status):
    """Everything a user needs from `kubectl get orl -o yaml`; kopf's own bookkeeping lives in annotations."""

    observed_generation: int | None = Field(None, ge=0)
    phase: Phase = "Pending"
    message: str = Field("", max_length=32768)
    conditions: list[Condition] = Field(default_factory=list)
    stable_version: int | None = Field(None, ge=0)
    candidate_version: int | None = Field(None, ge=0)
    pinned_version: int | None = Field(None, ge=0)
    canary_share: float | None = Field(None, ge=0, le=1)
    preview_version: int | None = Field(
        None, ge=0, description="Full weights: the version vLLM holds for the eval gate only (user requests wait)."
    )
    accept_rate: float | None = Field(None, ge=0, le=1, description="Accepted / shown of the stable version.")
    shown: int | None = Field(None, ge=0, description="Completions shown for the stable version.")
    samples_trained: int | None = Field(None, ge=0)
    trainer_step: int | None = Field(None, ge=0)
    last_checkpoint_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    trainer_restarts: int = Field(0, ge=0, description="Failed trainer Jobs recreated since the last spec change.")
    trainer_retry_after: str | None = Field(None, json_schema_extra={"format": "date-time"})
    trainer_nodes: int | None = Field(None, ge=1, description="Trainer pods the spec asks for (trainer.nodes).")
    trainer_ranks: int | None = Field(
        None, ge=1, description="Trainer processes in all: nodes x max(gpus, 1); rank 0 alone reads the stream."
    )
    trainer_ready_nodes: int | None = Field(None, ge=0, description="Trainer pods ready now.")
    redis_reachable: bool | None = None
    applied_rollback_to: int | None = Field(None, ge=0, description="spec.rollout.rollbackTo already carried out.")
    last_decision_id: str | None = Field(
        None, max_length=64, description="Newest rollout decision turned into an Event."
    )
    last_decision: str | None = Field(
        None, max_length=1024, description="Newest rollout decision: kind, version, actor and reason."
    )
    projects: dict[str, ProjectLineStatus | None] | None = Field(
        None,
        description="Each project's own policy line (projects.adapters), the first 50 by name (projectLines counts "
        "them all; `onlinerl status` shows every one). The fields above, and the PolicyPromoted condition, are the "
        "shared line's: a project line's decision never changes them (it is an Event naming the project).",
    )
    project_lines: int | None = Field(None, ge=0, description="Project policy lines in all (listed or registered).")
    project_decisions_after: str | None = Field(
        None,
        max_length=64,
        description="Stream id: project lines' rollout decisions up to it are turned into Events.",
    )
    endpoints: Endpoints = Field(default_factory=Endpoints)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def iso_from_epoch(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def epoch_from_iso(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class Observation:
    """What one reconcile/observe pass saw; the input of :func:`derive_conditions`."""

    generation: int | None = None
    invalid: str = ""  # non-empty: the spec cannot be rendered, with the reason
    serving_ready: bool | None = None
    serving_message: str = ""
    feedback_ready: bool | None = None
    feedback_message: str = ""
    trainer_state: Literal["running", "pending", "suspended", "failed", "retrying", "completed", "absent"] = "absent"
    trainer_message: str = ""
    stable_version: int | None = None
    candidate_version: int | None = None
    last_decision: str = ""  # "rollback v3: ..." — the newest gate/promote/rollback, shown on PolicyPromoted
    last_decision_kind: str = ""
    problems: list[str] = field(default_factory=list)  # degraded but running: Redis down, monitoring API missing
    failure_reason: Reason | None = None  # the reconcile step the API refused, if any (typed: see Reason)
    problem_reason: Reason | None = None  # a typed reason for the problems (else Problems), e.g. PodTemplateConflict
    failure_message: str = ""


def _cond(ctype: str, ok: bool | None, reason: Reason, message: str) -> dict[str, str]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": ctype, "status": status, "reason": str(reason), "message": message}


def derive_conditions(obs: Observation) -> list[dict[str, str]]:
    """The six standard conditions (without timestamps) from one observation."""
    if obs.invalid:
        msg = f"invalid spec: {obs.invalid}"
        return [
            _cond("Ready", False, Reason.INVALID_SPEC, msg),
            _cond("ServingReady", None, Reason.INVALID_SPEC, msg),
            _cond("FeedbackReady", None, Reason.INVALID_SPEC, msg),
            _cond("TrainerRunning", None, Reason.INVALID_SPEC, msg),
            _cond("PolicyPromoted", None, Reason.INVALID_SPEC, msg),
            _cond("Degraded", True, Reason.INVALID_SPEC, msg),
        ]
    trainer_ok = obs.trainer_state == "running"
    trainer_reason = {
        "running": Reason.RUNNING,
        "pending": Reason.STARTING,
        "suspended": Reason.SUSPENDED,
        "failed": Reason.BACKOFF_LIMIT_EXCEEDED,
        "retrying": Reason.RESTARTING,
        "completed": Reason.COMPLETED,
        "absent": Reason.NOT_CREATED,
    }[obs.trainer_state]
    promoted = obs.stable_version is not None and obs.stable_version > 0
    decision_reason = {"promote": Reason.PROMOTED, "rollback": Reason.ROLLED_BACK, "gate_fail": Reason.GATE_FAILED}.get(
        obs.last_decision_kind, ""
    )
    promoted_msg = (
        f"policy v{obs.stable_version} is stable"
        if promoted
        else "serving the base model (v0); no trained version promoted yet"
        if obs.stable_version == 0
        else "policy table not readable yet"
    )
    degraded_msgs = list(obs.problems)
    if obs.failure_reason is not None:
        degraded_msgs.insert(0, obs.failure_message)
    if obs.trainer_state in ("failed", "retrying"):
        degraded_msgs.insert(0, obs.trainer_message)
    trainer_fine = trainer_ok or obs.trainer_state == "suspended"
    ready = bool(obs.serving_ready and obs.feedback_ready and trainer_fine and not degraded_msgs)
    not_ready = [
        m
        for m, ok in (
            (obs.serving_message, obs.serving_ready),
            (obs.feedback_message, obs.feedback_ready),
            (obs.trainer_message, trainer_fine),
        )
        if not ok and m
    ]
    return [
        _cond(
            "Ready",
            ready,
            Reason.ALL_COMPONENTS_READY if ready else Reason.COMPONENTS_NOT_READY,
            "serving, feedback and trainer are up" if ready else "; ".join(not_ready + degraded_msgs),
        ),
        _cond(
            "ServingReady",
            obs.serving_ready,
            Reason.READY if obs.serving_ready else Reason.NOT_READY,
            obs.serving_message,
        ),
        _cond(
            "FeedbackReady",
            obs.feedback_ready,
            Reason.READY if obs.feedback_ready else Reason.NOT_READY,
            obs.feedback_message,
        ),
        _cond("TrainerRunning", trainer_ok, trainer_reason, obs.trainer_message),
        _cond(
            "PolicyPromoted",
            promoted if obs.stable_version is not None else None,
            decision_reason
            or (Reason.PROMOTED if promoted else Reason.BASE_MODEL if obs.stable_version == 0 else Reason.UNKNOWN),
            f"{promoted_msg}; last decision: {obs.last_decision}" if obs.last_decision else promoted_msg,
        ),
        _cond(
            "Degraded",
            bool(degraded_msgs),
            obs.failure_reason or (obs.problem_reason or Reason.PROBLEMS if degraded_msgs else Reason.HEALTHY),
            "; ".join(degraded_msgs) or "no problems seen",
        ),
    ]


def derive_phase(obs: Observation) -> str:
    if obs.invalid:
        return "Invalid"
    if obs.trainer_state == "failed":
        return "Failed"
    if obs.problems or obs.failure_reason is not None or obs.trainer_state == "retrying":
        return "Degraded"
    if not (obs.serving_ready and obs.feedback_ready):
        return "Pending"
    if obs.trainer_state == "suspended":
        return "Suspended"
    return "Running" if obs.trainer_state == "running" else "Pending"


def stamp_conditions(new: list[dict[str, str]], old: list[dict], generation: int | None, now: str) -> list[dict]:
    """Add lastTransitionTime (kept from ``old`` while the status value is unchanged) and observedGeneration."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        before = previous.get(c["type"])
        changed = before is None or before.get("status") != c["status"]
        stamped = {**c, "lastTransitionTime": now if changed else before.get("lastTransitionTime", now)}
        if generation is not None:
            stamped["observedGeneration"] = generation
        out.append(stamped)
    return out


def decision_text(kind: str, version: int | None, actor: str, reason: str) -> str:
    """A rollout decision on one line of status: ``rollback v3 by controller: ...``."""
    return f"{kind} v{version} by {actor}: {reason}"


def project_lines_status(
    tables: Mapping[str, PolicyTable], decided: Mapping[str, str], old: Mapping[str, Any] | None
) -> dict[str, dict[str, Any] | None]:
    """``status.projects`` from the shown lines' policy tables and their newest decision this pass (``decided``;
    else the one ``old`` shows). A line ``old`` shows and this pass does not is ``None``: the status is written as a
    JSON merge patch, where null removes a member."""
    old = old or {}
    out: dict[str, dict[str, Any] | None] = {}
    for name, t in tables.items():
        last = decided.get(name) or (old.get(name) or {}).get("lastDecision")
        out[name] = {
            "stableVersion": t.stable,
            "candidateVersion": t.candidate,
            "pinnedVersion": t.pinned,
            "paused": t.paused,
            "lastDecision": last[:256] if last else None,
        }
    out.update({name: None for name in old if name not in tables})
    return out
