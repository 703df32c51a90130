"""What the rollout writes to Redis: one decision record per decision, one state per version it has judged.

``rollout`` (hash ``version -> RolloutState JSON``) is the controller's own index of verdicts. It is kept apart from
``versions`` (written by the reloader) so each hash has one writer and neither can overwrite the other's state.
:class:`ArmStats` is what it reads: the counters of one (version, arm), shared because `onlinerl status` shows them
too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field

from onlinerl.schemas import _Record

DecisionKind = Literal[
    "gate_pass", "gate_fail", "promote", "rollback", "hold", "pin", "unpin", "pause", "resume", "supersede"
]
VersionVerdict = Literal["canary", "gate_failed", "promoted", "rolled_back", "superseded"]


class RolloutState(_Record):
    """The rollout's verdict on one version. ``canary`` is the only non-final state."""

    version: int
    state: VersionVerdict
    started_at: float = 0.0
    stable_version: int = 0
    baseline: dict[str, Any] = Field(default_factory=dict, description="stable arm counters when the canary started")
    last_look: int = -1
    guardrail_breach_looks: int = Field(0, description="consecutive evaluated looks that broke a guardrail")
    decided_at: float | None = None
    previous_stable: int | None = Field(None, description="for a promoted version: the stable it replaced")
    kept: bool = Field(
        False,
        description="for a promoted version: kept without a proven win (within noise at the last look, or at the "
        "end of a blue/green watch); the drift guard counts these in a row",
    )
    reason: str = ""


class DecisionRecord(_Record):
    """One entry of the ``decisions`` stream (field ``data``)."""

    decision: DecisionKind
    version: int | None = Field(None, description="the version decided on (candidate, pinned or rollback target)")
    stable: int | None = Field(None, description="stable version when the decision was taken")
    reason: str = ""
    actor: str = "controller"
    figures: dict[str, Any] = Field(default_factory=dict)
    at: float = Field(default_factory=time.time)


COUNTER_FIELDS = ("shown", "accepted", "rejected", "empty", "served", "shown_chars", "accepted_chars")


@dataclass(frozen=True)
class ArmStats:
    """The counters of one (version, arm), as in ``stats:v{N}:{arm}`` (gateway: served; feedback: the rest;
    ``shown_chars`` / ``accepted_chars``: characters of the shown text of shown / accepted suggestions)."""

    shown: int = 0
    accepted: int = 0
    rejected: int = 0
    empty: int = 0
    served: int = 0
    shown_chars: int = 0
    accepted_chars: int = 0

    @classmethod
    def from_mapping(cls, raw: Mapping[Any, Any] | None) -> ArmStats:
        """From a Redis HGETALL (bytes or str keys); missing counters are 0, unknown fields ignored."""
        values = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in (raw or {}).items()}
        return cls(**{f: int(float(values.get(f) or 0)) for f in COUNTER_FIELDS})

    def minus(self, baseline: ArmStats) -> ArmStats:
        """Counts since ``baseline`` was taken (the stable arm's counters when the candidate started)."""
        return ArmStats(*(max(0, getattr(self, f) - getattr(baseline, f)) for f in COUNTER_FIELDS))

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.shown if self.shown else 0.0

    @property
    def accepted_per_100(self) -> float:
        """Accepted suggestions per 100 served requests; falls back to shown when the gateway counted nothing."""
        requests = max(self.served, self.shown)
        return 100.0 * self.accepted / requests if requests else 0.0

    @property
    def requests(self) -> int:
        return max(self.served, self.shown)

    @property
    def suggestion_rate(self) -> float:
        """Shown / served: how often the policy offers something at all."""
        return self.shown / self.requests if self.requests else 0.0

    @property
    def accepted_chars_per_100(self) -> float:
        """Accepted characters per 100 served requests: what the user actually got, the figure a policy that only
        gets shorter or quieter cannot raise."""
        return 100.0 * self.accepted_chars / self.requests if self.requests else 0.0

    @property
    def mean_shown_length(self) -> float:
        return self.shown_chars / self.shown if self.shown else 0.0

    @property
    def empty_rate(self) -> float:
        """Empty / (shown + empty): rated outcomes where the policy produced only whitespace."""
        rated = self.shown + self.empty
        return self.empty / rated if rated else 0.0

    def summary(self) -> dict[str, Any]:
        """The counters and every derived figure, for decision records and status."""
        return {
            **asdict(self),
            "accept_rate": round(self.accept_rate, 6),
            "accepted_per_100": round(self.accepted_per_100, 4),
            "suggestion_rate": round(self.suggestion_rate, 6),
            "accepted_chars_per_100": round(self.accepted_chars_per_100, 2),
            "mean_shown_length": round(self.mean_shown_length, 2),
            "empty_rate": round(self.empty_rate, 6),
        }
