"""The rollout's view of the data plane: the policy table, version states, counters and verdicts it reads, and the one
atomic apply it writes through (``onlinerl.dataplane.decisions.apply``: check, update the table, write the verdicts,
append the decision, all or nothing). A thin facade over the data-plane modules, so the controller, `onlinerl policy`
and `onlinerl status` share one client-bound object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from onlinerl.arms import Arm
from onlinerl.dataplane import decisions, policy, stats, versions
from onlinerl.dataplane.decisions import ANY, DECISIONS_MAXLEN
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats, DecisionRecord, RolloutState
from onlinerl.schemas import PolicyTable, PolicyVersionState

__all__ = ["ANY", "DECISIONS_MAXLEN", "RolloutStore"]


@dataclass
class RolloutStore:
    r: redis.Redis
    keys: Keys

    # --- reads ---------------------------------------------------------------------------------------------------
    def policy(self) -> PolicyTable:
        return policy.read(self.r, self.keys)

    def versions(self) -> dict[int, PolicyVersionState]:
        """Every version's state; a malformed entry is the reloader's bug and must not stop the rollout (skipped)."""
        return versions.read(self.r, self.keys).states

    def states(self) -> dict[int, RolloutState]:
        return decisions.verdicts(self.r, self.keys)

    def state(self, version: int) -> RolloutState | None:
        return decisions.verdict(self.r, self.keys, version)

    def arm_stats(self, version: int, arm: Arm) -> ArmStats:
        """Counters of one (version, arm), incl. ``shown_chars`` / ``accepted_chars`` (0 where not counted)."""
        return stats.read(self.r, self.keys, version, arm)

    def arm_users(self, version: int, arm: Arm, canary: int) -> dict[str, ArmStats]:
        """Canary ``canary``'s per-user counters of (version, arm) (``stats.read_users``)."""
        return stats.read_users(self.r, self.keys, version, arm, canary)

    def users_at_most(self, ledgers: Iterable[tuple[int, Arm]], canary: int, at_most: int) -> int:
        """Distinct users in canary ``canary``'s per-user ledgers, counted up to ``at_most`` (``stats.count_users``)."""
        return stats.count_users(self.r, self.keys, list(ledgers), canary, at_most)

    def decisions(self, count: int = 20) -> list[tuple[str, DecisionRecord]]:
        """The latest ``count`` decisions, oldest first."""
        return decisions.latest(self.r, self.keys, count)

    def decisions_after(self, last_id: str = "0-0", count: int = 100) -> list[tuple[str, DecisionRecord]]:
        """Decisions newer than ``last_id`` (for the operator to turn into Events and conditions)."""
        return decisions.after(self.r, self.keys, last_id, count)

    def activity(self) -> tuple[str, float | None]:
        """What the controller is doing between decisions, and since when (``decisions.read_activity``)."""
        return decisions.read_activity(self.r, self.keys)

    def say(self, activity: str, since: float | None = None) -> None:
        """The controller's status line for `onlinerl status` (not a decision: no record, no table change)."""
        decisions.write_activity(self.r, self.keys, activity, since)

    # --- the one write path ----------------------------------------------------------------------------------------
    def apply(
        self,
        decision: DecisionRecord,
        *,
        expect_stable: int | str = ANY,
        expect_candidate: int | str | None = ANY,
        policy: dict[str, Any] | None = None,
        states: Iterable[RolloutState] = (),
        snapshot_stable: int | None = None,
    ) -> str | None:
        """``decisions.apply``: the decision's stream id, or None when the policy table changed meanwhile."""
        return decisions.apply(
            self.r,
            self.keys,
            decision,
            expect_stable=expect_stable,
            expect_candidate=expect_candidate,
            policy=policy,
            states=states,
            snapshot_stable=snapshot_stable,
        )
