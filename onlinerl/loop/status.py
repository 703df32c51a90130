"""Live figures of a running job, read from Redis (the same keys the operator reads for its status): the shared
policy line in full, and one line per project policy line (issue 39: its stable, candidate, hold and last verdict)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.dataplane import lines as dataplane_lines
from onlinerl.dataplane import samples, stats, trainer, versions
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats, DecisionRecord
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable

MAX_PROJECT_LINES = 50  # rendered one per row; beyond it a count (a thousand projects must not flood the screen)


def collect(r: redis.Redis, job: str, listed: Iterable[str] = ()) -> dict:
    """Everything `onlinerl status` prints. ``listed``: projects the config gives a line of their own
    (``projects.listed``); with the registered lines (``Keys.lines``) they are each shown on one row."""
    keys = Keys(job)
    store = RolloutStore(r, keys)
    table = store.policy()
    by_replica = versions.read(r, keys)
    live = by_replica.replicas
    return {
        "policy": table,
        "versions": sorted(by_replica.states.values(), key=lambda s: s.version),
        "replicas": {rid: sorted(v for v, st in vs.items() if st.state == "loaded") for rid, vs in live.items()},
        "stats": stats.read_all(r, keys),
        "backlog": samples.length(r, keys),
        "trainer": trainer.read_status(r, keys),
        "reloader": versions.read_reloader_status(r, keys),
        "decisions": store.decisions(5),
        "canary": _canary(store, table),
        "gate": _last(store, ("gate_pass", "gate_fail")),
        "verdict": _last(store, ("promote", "rollback", "gate_fail")),
        "activity": store.activity(),
        "projects": project_lines(r, job, listed),
    }


def project_lines(r: redis.Redis, job: str, listed: Iterable[str] = ()) -> list[dataplane_lines.LineView]:
    """Every project line (listed or registered) as one pipelined read (``dataplane.lines.views``)."""
    names = sorted(set(listed) | set(dataplane_lines.read(r, Keys(job))))
    views = dataplane_lines.views(r, job, names) if names else {}
    return [views[n] for n in names]


def project_line_text(view: dataplane_lines.LineView, now: float | None = None) -> str:
    """One project's line on one row: what it serves (stable, candidate and share, pin, hold), its loaded versions
    and the rollout's last verdict with its reason (pure)."""
    p = view.table
    parts = [f"stable v{p.stable}"]
    if p.candidate is not None:
        parts.append(f"candidate v{p.candidate} ({p.canary_share:.2f})")
    if p.pinned is not None:
        parts.append(f"pinned v{p.pinned}")
    if p.hold is not None:
        parts.append(f"held at v{p.hold} by {p.hold_by or 'unknown'}")
    if p.paused:
        parts.append("paused")
    loaded = [v for v, st in sorted(view.versions.items()) if st.state in ("loaded", "ready")]
    parts.append("loaded " + (",".join(f"v{v}" for v in loaded) if loaded else "-"))
    decided = [st for st in view.verdicts.values() if st.decided_at]
    if decided:
        last = max(decided, key=lambda st: st.decided_at or 0.0)
        parts.append(f"last verdict v{last.version} {last.state} {_ago(str(last.decided_at))}: {last.reason[:80]}")
    elif view.verdicts:
        last = max(view.verdicts.values(), key=lambda st: st.version)
        parts.append(f"v{last.version} {last.state}")
    return f"  {view.line:<16} " + "  ".join(parts)


def _canary(store: RolloutStore, policy: PolicyTable) -> dict | None:
    """The running canary's live figures: candidate arm vs stable arm since the canary started (what it decides on).
    A candidate with the whole traffic (blue/green's watch) is compared with stable's snapshot at the switch."""
    if policy.candidate is None:
        return None
    state = store.state(policy.candidate)
    baseline = ArmStats.from_mapping(state.baseline if state else None)
    watch = policy.canary_share >= 1.0
    return {
        "version": policy.candidate,
        "stable_version": policy.stable,
        "state": state,
        "watch": watch,
        "candidate": store.arm_stats(policy.candidate, CANDIDATE).summary(),
        "stable": (baseline if watch else store.arm_stats(policy.stable, STABLE).minus(baseline)).summary(),
    }


def _last(store: RolloutStore, kinds: tuple[str, ...]) -> DecisionRecord | None:
    return next((d for _, d in reversed(store.decisions(200)) if d.decision in kinds), None)


_FIGURES = (  # (label, key, format) of the canary and gate figures, guardrails included
    ("accept rate", "accept_rate", "{:.3f}"),
    ("accepted/100 req", "accepted_per_100", "{:.1f}"),
    ("suggestion rate", "suggestion_rate", "{:.3f}"),
    ("accepted chars/100 req", "accepted_chars_per_100", "{:.0f}"),
    ("mean shown length", "mean_shown_length", "{:.1f}"),
    ("empty rate", "empty_rate", "{:.3f}"),
)
_GATE_FIGURES = (
    ("accept rate", "accept_rate", "{:.3f}"),
    ("accepted/100 req", "accepted_per_100", "{:.1f}"),
    ("suggestion rate", "suggestion_rate", "{:.3f}"),
    ("accepted chars/100 req", "accepted_chars_per_100", "{:.0f}"),
    ("mean shown length", "mean_length", "{:.1f}"),
    ("empty rate", "empty_rate", "{:.3f}"),
    ("repetition rate", "repetition_rate", "{:.3f}"),
)


def _table(cand: dict, stable: dict, rows: tuple[tuple[str, str, str], ...]) -> list[str]:
    def cell(d: dict, key: str, fmt: str) -> str:
        return fmt.format(d[key]) if isinstance(d.get(key), int | float) else "-"

    return [f"    {label:<23} {cell(cand, k, f):>10} {cell(stable, k, f):>10}" for label, k, f in rows]


def render_rollout(s: dict) -> list[str]:
    """The gate's and the canary's figures (guardrails included) and the last verdict with its reason."""
    lines: list[str] = []
    activity, since = s.get("activity") or ("", None)
    if activity:
        started = f" (since {time.strftime('%H:%M:%S', time.localtime(since))})" if since else ""
        lines.append(f"rollout controller: {activity}{started}")
    c = s.get("canary")
    if c:
        st = c["state"]
        look = f"look {st.last_look}" if st and st.last_look >= 0 else "no look yet"
        breaches = (
            f", guardrail breached at {st.guardrail_breach_looks} look(s)" if st and st.guardrail_breach_looks else ""
        )
        if c.get("watch"):
            lines.append(
                f"blue/green watch: v{c['version']} serves everyone, vs stable v{c['stable_version']}'s snapshot at "
                f"the switch ({look}{breaches}):"
            )
        else:
            lines.append(
                f"canary: v{c['version']} vs stable v{c['stable_version']} ({look}{breaches}), since it started:"
            )
        lines.append(f"    {'':<23} {'candidate':>10} {'stable':>10}")
        lines.append(
            f"    {'shown / served':<23} {c['candidate']['shown']:>4}/{c['candidate']['served']:<5} "
            f"{c['stable']['shown']:>4}/{c['stable']['served']:<5}"
        )
        lines += _table(c["candidate"], c["stable"], _FIGURES)
    g = s.get("gate")
    if g is not None and g.figures.get("candidate") and g.figures["candidate"].get("requests"):
        verdict = "passed" if g.decision == "gate_pass" else "failed"
        lines.append(f"last eval gate: v{g.version} vs v{g.stable} {verdict}")
        lines.append(f"    {'':<23} {'candidate':>10} {'stable':>10}")
        lines += _table(g.figures["candidate"], g.figures.get("stable") or {}, _GATE_FIGURES)
    v = s.get("verdict")
    if v is not None:
        when = time.strftime("%H:%M:%S", time.localtime(v.at))
        lines.append(f"last verdict: {v.decision} v{v.version} at {when} by {v.actor}: {v.reason}")
    return lines


def hold_line(p: PolicyTable) -> str:
    """Who holds the table, since when, and what the hold stops (a rollback or pin, until `onlinerl policy resume`)."""
    by = p.hold_by or "unknown (set before holds were attributed)"
    when = (
        f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(p.hold_at))} ({_ago(str(p.hold_at))})"
        if p.hold_at
        else ""
    )
    return (
        f"held: stable v{p.hold} held by {by}{when}: no version is gated, canaried or made stable until "
        "`onlinerl policy resume`"
    )


def _ago(ts: str | None) -> str:
    try:
        return f"{time.time() - float(ts):.0f}s ago"
    except (TypeError, ValueError):
        return "never"


def render(s: dict) -> str:
    p: PolicyTable = s["policy"]
    by_request = " of requests" if p.split == "request" and p.candidate is not None else ""  # a few-user canary
    lines = [
        f"policy: stable v{p.stable}  candidate {('v' + str(p.candidate)) if p.candidate is not None else '-'}"
        f"  canary share {p.canary_share:.2f}{by_request}"
        f"  pinned {p.pinned if p.pinned is not None else '-'}  paused {'yes' if p.paused else 'no'}"
    ]
    if p.hold is not None:
        lines.append(hold_line(p))
    if (previewed := p.previewing(time.time())) is not None:
        lines.append(
            f"previewing v{previewed}: vLLM holds it for the eval gate only, user requests wait "
            f"(at most {p.preview_until - time.time():.0f}s more)"
        )
    lines.append("versions: " + ("  ".join(f"v{v.version}:{v.state}" for v in s["versions"]) or "none yet"))
    live = "  ".join(f"{rid} {vs}" for rid, vs in s.get("replicas", {}).items())
    lines.append(f"live serving replicas (loaded): {live or 'none'}")
    lines.append("accept rate per version/arm (accepted / shown, served):")
    for (version, arm), c in sorted(s["stats"].items()):
        shown, acc = c.get("shown", 0), c.get("accepted", 0)
        rate = f"{acc / shown:.3f}" if shown else "  -  "
        lines.append(f"  v{version:<4} {arm:<9} {rate}  ({acc}/{shown}, served {c.get('served', 0)})")
    t = s["trainer"]
    lines.append(f"backlog: {s['backlog']} unconsumed samples")
    lines.append(
        f"trainer: state {t.get('state', '?')}  step {t.get('step', '-')}  version v{t.get('version', '-')}"
        f"  samples trained {t.get('samples_trained', '-')}  last checkpoint {_ago(t.get('last_checkpoint_at'))}"
    )
    if t.get("rebase"):
        lines.append(f"trainer rebase: {t['rebase']}")
    rl = s["reloader"]
    lines.append(
        f"last reload: v{rl.get('last_version', '-')} {_ago(rl.get('last_reload_at'))}"
        + (f"  error: {rl['last_error']}" if rl.get("last_error") else "")
    )
    lines += render_rollout(s)
    projects = s.get("projects") or []
    if projects:
        lines.append(f"project policy lines ({len(projects)}; `onlinerl policy --project P show` for one in full):")
        lines += [project_line_text(v) for v in projects[:MAX_PROJECT_LINES]]
        if len(projects) > MAX_PROJECT_LINES:
            lines.append(f"  ... and {len(projects) - MAX_PROJECT_LINES} more")
    if s["decisions"]:
        lines.append("recent rollout decisions:")
        for _, d in s["decisions"]:
            when = time.strftime("%H:%M:%S", time.localtime(d.at))
            lines.append(f"  {when}  {d.decision:<9} v{d.version}  by {d.actor}: {d.reason[:110]}")
    return "\n".join(lines)
