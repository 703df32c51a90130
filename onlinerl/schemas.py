"""Records that cross a component boundary (see docs/architecture.md for where each one lives).

Each record is stored as one JSON document (a Redis hash field or a stream entry field ``data``), so a reader never
has to reassemble it from many fields, and the schema can grow without a migration: readers ignore unknown keys.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from onlinerl.arms import STABLE, Arm

SCHEMA_VERSION = 1
SILENCE_MATCH = "silence"  # TrainingSample.match of a server-made "not shown" sample (feedback silence.py)


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, raw: bytes | str):
        return cls.model_validate(orjson.loads(raw))


GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS); the gateway sends 0 instead


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = Field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """Sampled by argmax: mu is a point mass that no softmax(logits / T) matches (vLLM still reports T = 1
        log-probs), so such a rollout is rated and counted but never trained."""
        return self.temperature is not None and self.temperature < GREEDY_BELOW


class SecretFindingRecord(BaseModel):
    """Where a rollout held a credential (onlinerl/secret_scan.py): ``field`` (``prompt`` or ``completion``), the
    rule's ``kind`` and the character span. Never the text: what is stored about a finding cannot leak it."""

    model_config = ConfigDict(extra="ignore")

    field: Literal["prompt", "completion"]
    kind: str
    start: int
    end: int


class RolloutRecord(_Record):
    """One completion the gateway served, as generated (before any client trimming)."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    tenant: str
    arm: Arm = STABLE
    policy_version: int
    line: str = Field(
        "",
        description="The policy line that served it: '' = the shared policy, else the project whose own adapter did "
        "(issue 39; policy_version counts on that line).",
    )
    served_model: str
    user_hash: str = ""
    prompt: str
    prompt_token_ids: list[int]
    completion: str
    completion_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_offsets: list[int] = Field(
        default_factory=list,
        description="vLLM's text_offset, kept for compatibility and read by nothing: it drifts on tokens holding part "
        "of a multi-byte character. The feedback join cuts by token bytes (onlinerl/tokens.py).",
    )
    finish_reason: str | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    created_at: float = Field(default_factory=time.time)
    finished_at: float | None = None
    canary: int | None = Field(
        None,
        description="The candidate version the policy table named when this stable- or candidate-arm rollout was "
        "routed (None: no canary running, or another arm): the canary whose per-user ledger "
        "(Keys.arm_users) counts it.",
    )
    secrets: list[SecretFindingRecord] = Field(
        default_factory=list,
        description="Credentials the gateway found in the prompt or completion (privacy.secretScreening). When "
        "non-empty the record is redacted: prompt, completion, token ids and log-probs are empty, so nothing of it "
        "can be trained or read back; feedback audits its rating `secret_detected`.",
    )

    @property
    def redacted(self) -> bool:
        """Recorded without its text and tokens because it held a credential."""
        return bool(self.secrets)

    @field_validator("arm", mode="before")
    @classmethod
    def _legacy_base_arm(cls, v: Any) -> Any:
        """Records written before the arms were unified called version 0's stable traffic ``base``."""
        return STABLE if v == "base" else v


class TrainingSample(_Record):
    """One rated completion: what the trainer learns from. Token lists hold only the tokens the user was shown."""

    schema_version: int = SCHEMA_VERSION
    event_id: str
    rollout_id: str
    tenant: str
    arm: str = STABLE
    policy_version: int
    line: str = Field(
        "",
        description="The policy line that served it: '' = the shared policy, else the project whose own adapter did "
        "(issue 39; policy_version counts on that line).",
    )
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    accepted: bool
    temperature: float = Field(
        1.0,
        gt=0,
        description="The temperature the completion was sampled at: the behaviour log-probs are under "
        "softmax(logits / temperature), and the trainer evaluates pi_theta the same way.",
    )
    shown_text: str = ""
    match: Literal["exact", "prefix", "trimmed", "unverified", "silence"] = "exact"  # SILENCE_MATCH: never shown
    rollout_created_at: float = 0.0
    feedback_at: float = Field(default_factory=time.time)
    user_hash: str = Field(
        "", description="The served rollout's user (RolloutRecord.user_hash): whose code it is (`onlinerl forget`)."
    )

    @property
    def unseen(self) -> bool:
        """A silence sample: the completion was never shown, so the trainer never makes it likelier (advantages.py)."""
        return self.match == SILENCE_MATCH


class AuditEntry(_Record):
    """A feedback event that is not trained on, kept for inspection."""

    event_id: str
    tenant: str
    outcome: str
    reason: str
    accepted: bool | None = None
    completion: str = ""
    prompt_digest: str = ""
    received_at: float = Field(default_factory=time.time)
    rollout_id: str = Field("", description="The served rollout the event joined, when it joined one.")
    first_outcome: str = Field("", description="duplicate only: outcome of the delivery that counted.")
    first_entry_id: str = Field("", description="duplicate only: stream id of the delivery that counted.")
    stream_id: str = Field("", description="trainer only: the samples-stream entry it refused (invalid or stale).")
    user_hash: str = Field(
        "", description="feedback: the sending key's user hash (onlinerl.auth.user_hash): `onlinerl forget` finds it."
    )


class CompletionOutcome(BaseModel):
    """Continue's AutocompleteOutcome upload (RLinf fork). Unknown fields are tolerated and ignored."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    completion_id: str = Field(alias="completionId", min_length=1, max_length=256)
    accepted: bool
    completion: str = Field("", max_length=65536)
    prompt: str = Field("", max_length=1_000_000)
    prefix: str = Field("", max_length=1_000_000)
    suffix: str = Field("", max_length=1_000_000)
    filepath: str = ""
    model_provider: str = Field("", alias="modelProvider")
    model_name: str = Field("", alias="modelName")
    timestamp: str = ""
    time: float | None = None
    unique_id: str = Field("", alias="uniqueId")
    num_lines: int | None = Field(None, alias="numLines")
    cache_hit: bool = Field(False, alias="cacheHit")


class CheckpointManifest(_Record):
    """``manifest.json`` inside ``v{N}/``: written last, so a directory with a manifest is complete."""

    schema_version: int = SCHEMA_VERSION
    job: str
    version: int = Field(ge=1)
    parent_version: int = Field(ge=0)
    line: str = Field("", description="The policy line this version belongs to: '' = shared, else the project.")
    kind: Literal["lora", "full"]
    base_model: str
    created_at: float = Field(default_factory=time.time)
    step: int = 0
    sample_ids: list[str] = Field(default_factory=list, description="Stream ids trained into this version.")
    sample_id_range: tuple[str, str] | None = None
    sample_count: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict, description="Relative path -> sha256 hex.")
    rebased_from: int | None = Field(
        None,
        description="Set on the first version trained after a manual rollback: the trainer's version whose weights "
        "it dropped (parent_version is then the rollback's target, whose weights it trained from).",
    )
    rollback_at: float | None = Field(
        None,
        description="The manual rollback (policy rollback_at) this version's lineage follows; copied from the parent, "
        "so a trainer resuming this version knows it has rebased onto that rollback already.",
    )
    contributors: dict[str, list[str]] = Field(
        default_factory=dict,
        description="tenant -> user hashes whose samples were trained into this version (since its parent): the "
        "lineage `onlinerl forget` reports (which versions learned from a user's code).",
    )


class PolicyTable(BaseModel):
    """The live routing table (Redis hash ``policy``). Version 0 is the base model."""

    stable: int = 0
    candidate: int | None = None
    canary_share: float = 0.0
    pinned: int | None = None
    paused: bool = False
    hold: int | None = Field(
        None,
        description="stable a human fixed (rollback, pin): under strategy direct the reloader never raises stable "
        "while set, and the rollout controller gates, canaries and promotes nothing (canary, bluegreen); the next "
        "manual decision (resume) clears it",
    )
    hold_by: str = Field("", description="who set the hold: the actor of that decision (cli:<user>, operator)")
    hold_at: float = Field(0.0, description="when the hold was set (unix s); 0 without a hold")
    rollback_to: int | None = Field(
        None,
        description="the last manual rollback's target: the trainer rebases onto its weights before it trains "
        "again (kept after resume; the next rollback replaces it)",
    )
    rollback_at: float = Field(0.0, description="when that rollback was made (unix s): the trainer's rebase marker")
    split: Literal["key", "request"] = Field(
        "key",
        description="how the canary splits users: key (each API key keeps one arm: sha256 of the key against "
        "canary_share), or request (each request drawn against canary_share; its record carries the arm, so its "
        "outcome counts there): a few-user canary (rollout.fewUsers: decide), set by the rollout controller",
    )
    preview: int | None = Field(
        None,
        description="full-weight mode: the version the eval gate previews (vLLM holds it for eval requests only, "
        "user requests wait); set and cleared by the rollout controller, ignored after preview_until",
    )
    preview_until: float = Field(0.0, description="wall-clock end of the preview: past it the reloader restores stable")
    updated_at: float = 0.0

    def previewing(self, now: float) -> int | None:
        """The version under preview at ``now`` (None: none, or its deadline has passed)."""
        return self.preview if self.preview is not None and now < self.preview_until else None

    def to_redis(self) -> dict[str, str]:
        return {
            "stable": str(self.stable),
            "candidate": "" if self.candidate is None else str(self.candidate),
            "canary_share": repr(self.canary_share),
            "pinned": "" if self.pinned is None else str(self.pinned),
            "paused": "1" if self.paused else "0",
            "hold": "" if self.hold is None else str(self.hold),
            "hold_by": self.hold_by,
            "hold_at": repr(self.hold_at),
            "rollback_to": "" if self.rollback_to is None else str(self.rollback_to),
            "rollback_at": repr(self.rollback_at),
            "split": self.split,
            "preview": "" if self.preview is None else str(self.preview),
            "preview_until": repr(self.preview_until),
            "updated_at": repr(self.updated_at or time.time()),
        }

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> PolicyTable:
        d = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }

        def opt_int(key: str) -> int | None:
            return int(d[key]) if d.get(key) not in (None, "") else None

        return cls(
            stable=int(d.get("stable") or 0),
            candidate=opt_int("candidate"),
            canary_share=float(d.get("canary_share") or 0.0),
            pinned=opt_int("pinned"),
            paused=d.get("paused") == "1",
            hold=opt_int("hold"),
            hold_by=d.get("hold_by") or "",
            hold_at=float(d.get("hold_at") or 0.0),
            rollback_to=opt_int("rollback_to"),
            rollback_at=float(d.get("rollback_at") or 0.0),
            split="request" if d.get("split") == "request" else "key",
            preview=opt_int("preview"),
            preview_until=float(d.get("preview_until") or 0.0),
            updated_at=float(d.get("updated_at") or 0.0),
        )


class PolicyVersionState(_Record):
    """What the reloader knows of one version (Redis hash ``versions``). ``ready``: full-weight mode, the manifest
    checked and the weights switchable, but not in vLLM (one version at a time): the blue/green gate may take it.
    ``previewing``: full-weight mode, vLLM holds it for the eval gate's requests only (user requests wait)."""

    version: int
    state: Literal["announced", "loading", "loaded", "ready", "previewing", "failed", "retired", "gate_failed"] = (
        "announced"
    )
    path: str = ""
    served_model: str = ""
    failures: int = 0
    error: str = ""
    updated_at: float = Field(default_factory=time.time)
    rollback_at: float = Field(
        0.0,
        description="the manual rollback (policy rollback_at) the version's lineage follows, from its announcement: "
        "a version whose marker is not the table's was trained on weights a rollback dropped, and is never gated "
        "or made stable",
    )

    def follows(self, table: PolicyTable) -> bool:
        """Trained on the lineage the last manual rollback set (any version, when there was none)."""
        return table.rollback_to is None or self.rollback_at == table.rollback_at


def adapter_name(job: str, version: int) -> str:
    """The vLLM model name a shared-line version is served under: unique per version, never reused (no
    load_inplace). A project line's: ``onlinerl.lines.adapter_name``."""
    return f"{job}-v{version}"
