"""A few-user canary: a lone developer's traffic can decide, where the operator trusts so few users.

The canary splits users by API key and caps each user at ``maxUserShare`` of a look, with a leave-one-out check
(per_user.py, issue 35), so that one key cannot steer a verdict. Both assume a crowd. One developer running
``onlinerl up`` is 100 % of the traffic: the key stays on one arm (the other arm is never served, nothing can be
compared), and even with both arms served one user never reaches a look under the cap. The canary then holds for
ever and the developer is served the base model however well the trainer does (measured: 64 outcomes from one key,
v1 passed its gate, 10 minutes later the key was still on v0; issue 36).

What a canary does about it is the operator's choice (``rollout.fewUsers``):

* ``wait`` (the default): nothing changes; the canary holds and `onlinerl status` says why and what to set.
* ``decide`` (the local stack's default: ``onlinerl up`` is one developer by design): once ``minSamples`` requests
  have been served in the canary from fewer than ``ceil(1 / maxUserShare)`` users (its per-user ledgers, both arms),

  1. the controller switches the policy table to ``split: request`` (one decision record, in the same atomic apply
     as every rollout change): the gateway then draws each request's arm against ``canary_share``, and the rollout
     record carries the arm and version served, so each outcome counts in the arm that served it;
  2. while the ledgers hold fewer users than that, a look is judged on the pooled arm counters: the eval gate has
     passed the candidate, and the doubling looks with alpha spending, the guardrails (counted on the served span)
     and the drift guard on kept promotions all still apply. The per-user cap and the leave-one-out check do not:
     with one user there is nobody to leave out, and any of a few users can steer the verdict. The decision's
     reason says so.

  A canary whose ledgers reach ``ceil(1 / maxUserShare)`` users is judged by every per-user rule again, in either
  split, so a job with a crowd keeps issue 35's guarantees whatever this setting is; the split goes back to ``key``
  with the next canary. An attacker cannot make a crowd look few: every key that sends traffic adds a user.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from onlinerl.rollout.records import ArmStats


@dataclass(frozen=True)
class FewUsers:
    """What the canary knows about its users at one tick."""

    users: int  # distinct users in the canary's per-user ledgers (both arms), counted up to ``needed`` between looks
    needed: int  # ceil(1 / maxUserShare): users a look needs under the per-user cap
    policy: Literal["wait", "decide"]  # rollout.fewUsers
    split: Literal["key", "request"]  # the policy table's split
    served: int  # requests served in the canary's arms since it started
    min_samples: int

    @property
    def few(self) -> bool:
        return self.users < self.needed

    @property
    def pooled(self) -> bool:
        """A look is judged on the pooled counters (``decide`` and fewer users than a look needs)."""
        return self.policy == "decide" and self.few and self.users > 0

    @property
    def switch_to_request(self) -> bool:
        """Time to split by request: ``decide``, still split by key, and ``minSamples`` requests from few users."""
        return self.policy == "decide" and self.split == "key" and self.few and self.served >= self.min_samples

    def switch_reason(self) -> str:
        return (
            f"few-user canary: {self.served} requests came from {self.users} user(s), fewer than the {self.needed} a "
            "look needs under the per-user cap; the canary splits by request from now on and is judged on its pooled "
            "counters (rollout.fewUsers: decide)"
        )

    def verdict_note(self) -> str:
        return (
            f"few-user canary ({self.users} user(s), fewer than {self.needed}): judged on pooled counters, no "
            "per-user cap or leave-one-out (rollout.fewUsers: decide)"
        )

    def waits_for(self) -> str:
        """The few-user part of `onlinerl status`'s line for a holding canary ("" when there is nothing to add)."""
        if not self.few:
            return "split by request" if self.split == "request" else ""
        who = f"{self.users} user(s) in this canary, fewer than the {self.needed} a look needs under the per-user cap"
        if self.policy == "wait":
            return (
                f"{who}: it cannot decide on so few users (rollout.fewUsers: wait); set rollout.fewUsers: decide to "
                "let a lone developer's or a few trusted users' traffic decide (`onlinerl up` does)"
            )
        if self.split == "key":
            return f"{who}: it splits by request once {self.min_samples} requests are served ({self.served} so far)"
        return f"{who}: split by request, judged on pooled counters (rollout.fewUsers: decide)"


def users_in(*ledgers: Mapping[str, ArmStats] | None) -> int:
    """Distinct users across per-user ledgers (a user served in both arms counts once)."""
    return len({user for ledger in ledgers if ledger for user in ledger})
