"""Human control of the rollout: pin, roll back, pause. Used by ``onlinerl policy`` and by the operator (CR spec).

Each action is one atomic ``RolloutStore.apply`` checked against the table it read (retried on a concurrent change),
and is recorded in the ``decisions`` stream with its ``actor``, like every controller decision.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from onlinerl.config import RolloutConfig
from onlinerl.errors import CommandError
from onlinerl.keys import Keys
from onlinerl.rollout.records import DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable

ATTEMPTS = 5


def _servable(store: RolloutStore, version: int) -> None:
    """Refuse a version serving cannot route to: the message lists the ones it can."""
    if version == 0:
        return
    loaded = sorted(v for v, s in store.versions().items() if s.state == "loaded")
    if version not in loaded:
        raise CommandError(
            f"version {version} is not loaded in serving (loaded: {[0, *loaded]}); "
            "wait for the reloader or pass --force"
        )


def _retry(store: RolloutStore, act) -> DecisionRecord:
    for _ in range(ATTEMPTS):
        table = store.policy()
        rec, kwargs = act(table)
        if store.apply(rec, expect_stable=table.stable, expect_candidate=table.candidate, **kwargs):
            return rec
    raise CommandError(f"the policy table kept changing during {ATTEMPTS} attempts; try again")


def pin(store: RolloutStore, version: int | None, *, actor: str = "cli", force: bool = False) -> DecisionRecord:
    """Serve every user ``version`` (None unpins). The canary is frozen while pinned."""
    if version is not None and not force:
        _servable(store, version)

    def act(table: PolicyTable) -> tuple[DecisionRecord, dict[str, Any]]:
        kind = "pin" if version is not None else "unpin"
        reason = f"pinned to v{version}" if version is not None else f"unpinned (was v{table.pinned})"
        return (
            DecisionRecord(decision=kind, version=version, stable=table.stable, reason=reason, actor=actor),
            {"policy": {"pinned": version}},
        )

    return _retry(store, act)


def set_paused(store: RolloutStore, paused: bool, *, actor: str = "cli") -> DecisionRecord:
    """Pause (or resume) promotion and new candidates; rollbacks of a worse candidate still happen."""

    def act(table: PolicyTable) -> tuple[DecisionRecord, dict[str, Any]]:
        kind = "pause" if paused else "resume"
        return (
            DecisionRecord(
                decision=kind,
                version=table.candidate,
                stable=table.stable,
                actor=actor,
                reason="promotion paused" if paused else "promotion resumed",
            ),
            {"policy": {"paused": paused}},
        )

    return _retry(store, act)


def previous_stable(store: RolloutStore, table: PolicyTable) -> int:
    """The version the current stable replaced; else the newest loaded, never rolled-back version below it; else 0."""
    states = store.states()
    current = states.get(table.stable)
    if current is not None and current.previous_stable is not None:
        return current.previous_stable
    bad = {v for v, s in states.items() if s.state in ("rolled_back", "gate_failed")}
    below = [v for v, s in store.versions().items() if s.state == "loaded" and v < table.stable and v not in bad]
    return max(below, default=0)


def rollback(
    store: RolloutStore, to_version: int | None = None, *, actor: str = "cli", force: bool = False
) -> DecisionRecord:
    """Roll back: with a candidate and no target, end the canary; otherwise make ``to_version`` (default: the
    previous stable) stable. Versions rolled back from are marked ``rolled_back`` so they are never proposed again.
    """
    if to_version is not None and not force:
        _servable(store, to_version)

    def act(table: PolicyTable) -> tuple[DecisionRecord, dict[str, Any]]:
        now = time.time()
        if to_version is not None:
            target = to_version
        else:
            target = table.stable if table.candidate is not None else previous_stable(store, table)
        victims = [v for v in dict.fromkeys((table.candidate, table.stable)) if v is not None and v != target]
        if not victims:
            raise CommandError(f"v{target} is already stable and no candidate is running: nothing to roll back")
        states = [
            (store.state(v) or RolloutState(version=v, state="rolled_back")).model_copy(
                update={"state": "rolled_back", "decided_at": now, "reason": f"manual rollback by {actor}"}
            )
            for v in victims
        ]
        rec = DecisionRecord(
            decision="rollback",
            version=target,
            stable=table.stable,
            actor=actor,
            at=now,
            reason=f"manual rollback: {', '.join(f'v{v}' for v in victims)} rolled back, v{target} serves",
            figures={"rolled_back": victims, "candidate": table.candidate},
        )
        return rec, {"policy": {"stable": target, "candidate": None, "canary_share": 0.0}, "states": states}

    return _retry(store, act)


def apply_spec(store: RolloutStore, cfg: RolloutConfig, *, actor: str = "operator") -> list[DecisionRecord]:
    """Make the table's ``pinned`` and ``paused`` match an OnlineRLJob spec (called by the operator on spec change)."""
    table = store.policy()
    out = []
    if table.pinned != cfg.pinned_version:
        out.append(pin(store, cfg.pinned_version, actor=actor, force=True))
    if table.paused != cfg.paused:
        out.append(set_paused(store, cfg.paused, actor=actor))
    return out


def show(store: RolloutStore, decisions: int = 10) -> dict[str, Any]:
    """Everything a human needs to see: the table, the versions, the rollout's verdicts, the latest decisions."""
    return {
        "policy": store.policy().model_dump(),
        "versions": {v: s.state for v, s in sorted(store.versions().items())},
        "rollout": {v: s.state for v, s in sorted(store.states().items())},
        "decisions": [{"id": i, **d.model_dump(exclude={"figures"})} for i, d in store.decisions(decisions)],
    }


def connect(url: str, job: str) -> RolloutStore:
    if not url:
        raise CommandError("no Redis to act on: pass --redis-url or set redis.url in the config")
    return RolloutStore(redis.Redis.from_url(url, socket_connect_timeout=2.0), Keys(job))
