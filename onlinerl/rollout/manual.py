"""Human control of the rollout: pin, roll back, pause. Used by ``onlinerl policy`` and by the operator (CR spec).

Each action is one atomic ``RolloutStore.apply`` checked against the table it read (retried on a concurrent change),
and is recorded in the ``decisions`` stream with its ``actor``, like every controller decision.

A manual decision sticks until the next one: rollback and pin write ``hold`` (the stable a human fixed), with who
(``hold_by``) and when (``hold_at``), in the same transaction. While it is set nothing automatic moves stable under any
strategy: under ``direct`` the reloader never raises it (not on the next checkpoint, not after a reloader or vLLM
restart), and under ``canary``/``bluegreen`` the rollout controller gates no new version, starts no canary and promotes
nothing. ``resume`` clears it. Versions rolled back are marked ``rolled_back`` and are never made stable automatically
again, hold or not. A rollback also records its target and time (``rollback_to``, ``rollback_at``): the trainer rebases
onto the target's weights before it trains again, so the next version does not descend from the rolled-back ones.
"""

from __future__ import annotations

import time
from typing import Any

from onlinerl.config import RedisConfig, RolloutConfig
from onlinerl.dataplane import lines
from onlinerl.errors import CommandError
from onlinerl.keys import Keys, tenant_problem
from onlinerl.redisconn import connect as redis_connect
from onlinerl.rollout.records import DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable

ATTEMPTS = 5
# A version serving can be sent to: loaded now, or loaded before (LoRA: unloaded; full weights: replaced) -- the
# reloader loads what the table references again.
SERVABLE = ("loaded", "retired")


def _servable(store: RolloutStore, version: int) -> None:
    """Refuse a version serving cannot route to: the message lists the ones it can."""
    if version == 0:
        return
    servable = sorted(v for v, s in store.versions().items() if s.state in SERVABLE)
    if version not in servable:
        raise CommandError(
            f"version {version} is not loaded in serving (servable: {[0, *servable]}); "
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
    """Serve every user ``version`` (None unpins). The canary is frozen while pinned; a pin also holds stable where
    it is (direct strategy), until ``resume``. Unpinning keeps that hold: back to the held stable, not the newest."""
    if version is not None and not force:
        _servable(store, version)

    def act(table: PolicyTable) -> tuple[DecisionRecord, dict[str, Any]]:
        if version is None:
            reason = f"unpinned (was v{table.pinned})" + _held_note(table.hold)
            return DecisionRecord(decision="unpin", stable=table.stable, reason=reason, actor=actor), {
                "policy": {"pinned": None}
            }
        held = {} if table.hold is not None else {"hold": table.stable, **_held_by(actor, time.time())}
        return (
            DecisionRecord(
                decision="pin", version=version, stable=table.stable, reason=f"pinned to v{version}", actor=actor
            ),
            {"policy": {"pinned": version, **held}},
        )

    return _retry(store, act)


def _held_note(hold: int | None) -> str:
    return "" if hold is None else f"; stable held at v{hold} (no gate, canary or raise) until `onlinerl policy resume`"


def _held_by(actor: str, at: float) -> dict[str, Any]:
    """The hold's provenance, written with the hold: `onlinerl status` says who set it and when."""
    return {"hold_by": actor, "hold_at": repr(at)}


def set_paused(store: RolloutStore, paused: bool, *, actor: str = "cli") -> DecisionRecord:
    """Pause (or resume) promotion and new candidates; rollbacks of a worse candidate still happen. Resume also
    releases a manual hold (rollback, pin): new versions may become stable again."""

    def act(table: PolicyTable) -> tuple[DecisionRecord, dict[str, Any]]:
        kind = "pause" if paused else "resume"
        if paused:
            reason = "promotion paused"
        else:
            reason = "promotion resumed" + ("" if table.hold is None else f" (stable no longer held at v{table.hold})")
        release = {"hold": None, "hold_by": "", "hold_at": "0.0"}
        updates: dict[str, Any] = {"paused": paused} if paused else {"paused": False, **release}
        return (
            DecisionRecord(decision=kind, version=table.candidate, stable=table.stable, actor=actor, reason=reason),
            {"policy": updates},
        )

    return _retry(store, act)


def previous_stable(store: RolloutStore, table: PolicyTable) -> int:
    """The version the current stable replaced; else the newest loaded, never rolled-back version below it; else 0."""
    states = store.states()
    current = states.get(table.stable)
    if current is not None and current.previous_stable is not None:
        return current.previous_stable
    bad = {v for v, s in states.items() if s.state in ("rolled_back", "gate_failed")}
    below = [v for v, s in store.versions().items() if s.state in SERVABLE and v < table.stable and v not in bad]
    return max(below, default=0)


def rollback(
    store: RolloutStore, to_version: int | None = None, *, actor: str = "cli", force: bool = False
) -> DecisionRecord:
    """Roll back: with a candidate and no target, end the canary; otherwise make ``to_version`` (default: the
    previous stable) stable. Versions rolled back from are marked ``rolled_back`` so they are never proposed again,
    and stable is held at the target (``hold``) until ``resume``: no automatic raise undoes a human's rollback.
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
            reason=f"manual rollback: {', '.join(f'v{v}' for v in victims)} rolled back, v{target} serves"
            + _held_note(target),
            figures={"rolled_back": victims, "candidate": table.candidate},
        )
        policy = {
            "stable": target,
            "candidate": None,
            "canary_share": 0.0,
            "hold": target,
            **_held_by(actor, now),
            "rollback_to": target,
            "rollback_at": repr(now),
        }
        return rec, {"policy": policy, "states": states}

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


def connect(url: str, job: str, project: str = "", listed: bool = False) -> RolloutStore:
    """The store of the shared line, or of ``project``'s own policy line (issue 39): every action then reads and
    writes that line's keys only (its policy table, verdicts, decisions), so it never touches another project's line.
    A project must be a line of the job (registered, with a policy table, or ``listed`` in the config): a typo must
    not create a policy table nobody serves."""
    if not url:
        raise CommandError(
            "no Redis to act on: pass --redis-url, or --state DIR of a local stack (`make run`), "
            "or set redis.url in the config"
        )
    problem = tenant_problem(project) if project else None
    if problem:
        raise CommandError(f"--project: {problem}")
    r = redis_connect(RedisConfig(), url)  # default deadlines
    keys = Keys(job)
    if project and not listed and not lines.exists(r, keys, project):
        known = lines.read(r, keys)
        r.close()
        raise CommandError(
            f"project {project!r} has no policy line of its own in job {job!r} (project lines: {known or 'none'}); "
            "a project gets one under projects.adapters listed or all, from its first version"
        )
    return RolloutStore(r, keys.for_line(project))
