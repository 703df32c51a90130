"""What the rollout writes to Redis: one decision record per decision, one state per version it has judged.

``rollout`` (hash ``version -> RolloutState JSON``) is the controller's own index of verdicts. It is kept apart from
``versions`` (written by the reloader) so each hash has one writer and neither can overwrite the other's state.
"""

from __future__ import annotations

import time
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
