"""Live figures of a running job, read from Redis (the same keys the operator reads for its status)."""

from __future__ import annotations

import time

import redis

from onlinerl.keys import Keys
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable, PolicyVersionState


def _decode(d: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in d.items()
    }


def collect(r: redis.Redis, job: str) -> dict:
    keys = Keys(job)
    policy = PolicyTable.from_redis(r.hgetall(keys.policy))
    versions = sorted((PolicyVersionState.from_json(v) for v in r.hvals(keys.versions)), key=lambda s: s.version)
    stats = {}
    for key in r.scan_iter(match=f"{keys.prefix}stats:v*", count=500):
        k = key.decode()
        version, arm = k.rsplit(":", 2)[-2:]
        stats[(int(version[1:]), arm)] = {f: int(float(x)) for f, x in _decode(r.hgetall(key)).items()}
    return {
        "policy": policy,
        "versions": versions,
        "stats": stats,
        "backlog": r.xlen(keys.samples),
        "trainer": _decode(r.hgetall(keys.trainer_status)),
        "reloader": _decode(r.hgetall(keys.reloader_status)),
        "decisions": RolloutStore(r, keys).decisions(5),
    }


def _ago(ts: str | None) -> str:
    try:
        return f"{time.time() - float(ts):.0f}s ago"
    except (TypeError, ValueError):
        return "never"


def render(s: dict) -> str:
    p: PolicyTable = s["policy"]
    lines = [
        f"policy: stable v{p.stable}  candidate {('v' + str(p.candidate)) if p.candidate is not None else '-'}"
        f"  canary share {p.canary_share:.2f}  pinned {p.pinned if p.pinned is not None else '-'}"
        f"  paused {'yes' if p.paused else 'no'}"
    ]
    lines.append("versions: " + ("  ".join(f"v{v.version}:{v.state}" for v in s["versions"]) or "none yet"))
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
    rl = s["reloader"]
    lines.append(
        f"last reload: v{rl.get('last_version', '-')} {_ago(rl.get('last_reload_at'))}"
        + (f"  error: {rl['last_error']}" if rl.get("last_error") else "")
    )
    if s["decisions"]:
        lines.append("recent rollout decisions:")
        for _, d in s["decisions"]:
            when = time.strftime("%H:%M:%S", time.localtime(d.at))
            lines.append(f"  {when}  {d.decision:<9} v{d.version}  by {d.actor}: {d.reason[:110]}")
    return "\n".join(lines)
