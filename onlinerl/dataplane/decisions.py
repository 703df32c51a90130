"""Rollout decisions (``decisions`` stream) and verdicts (``rollout`` hash ``version -> RolloutState JSON``).

Every rollout change goes through one Lua script (``APPLY``) that (1) checks the policy table still has the stable and
candidate the decision was computed for, (2) updates the table, (3) writes the versions' verdicts, (4) appends the
decision record. All four happen or none: a concurrent manual rollback can never be overwritten by a stale promote,
and no change is ever left unrecorded. Writers: the rollout controller and `onlinerl policy` (also the operator's
``rollbackTo``, through the same call). Readers: the operator (each decision becomes an Event), `onlinerl status`,
and the reloader's direct raise (never re-raise a rolled-back version).

Also the controller's status hash (``controller``): what it is doing between decisions (a gate running for minutes,
a version waiting for stable's baseline), so `onlinerl status` can say why nothing moves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import orjson
import redis

from onlinerl.arms import STABLE
from onlinerl.dataplane.codec import DATA, entries, pairs, text
from onlinerl.dataplane.scripts import Script
from onlinerl.keys import Keys
from onlinerl.rollout.records import DecisionRecord, RolloutState

DECISIONS_MAXLEN = 10_000
ANY = "*"

# KEYS: policy, rollout states, decisions, stats key to snapshot into a state's baseline
# ARGV: expected stable ('*' = any), expected candidate ('' = none, '*' = any), policy updates JSON object,
#       states JSON object {version: state JSON string}, version whose state gets the baseline ('' = none),
#       decision JSON, stream maxlen
APPLY = Script("""
local cur = redis.call('HMGET', KEYS[1], 'stable', 'candidate')
local stable = cur[1] or '0'
if stable == '' then stable = '0' end
local candidate = cur[2] or ''
if ARGV[1] ~= '*' and ARGV[1] ~= stable then return false end
if ARGV[2] ~= '*' and ARGV[2] ~= candidate then return false end
for k, v in pairs(cjson.decode(ARGV[3])) do redis.call('HSET', KEYS[1], k, v) end
for version, state in pairs(cjson.decode(ARGV[4])) do
  if version == ARGV[5] then
    local decoded = cjson.decode(state)
    local flat = redis.call('HGETALL', KEYS[4])
    local baseline = {}
    for i = 1, #flat, 2 do baseline[flat[i]] = flat[i + 1] end
    decoded['baseline'] = baseline
    state = cjson.encode(decoded)
  end
  redis.call('HSET', KEYS[2], version, state)
end
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[6])
""")


def apply(
    client: redis.Redis,
    keys: Keys,
    decision: DecisionRecord,
    *,
    expect_stable: int | str = ANY,
    expect_candidate: int | str | None = ANY,
    policy: dict[str, Any] | None = None,
    states: Iterable[RolloutState] = (),
    snapshot_stable: int | None = None,
) -> str | None:
    """Apply atomically; returns the decision's stream id, or None when the policy table changed meanwhile.

    ``snapshot_stable``: copy the stable arm's ``stats:v{N}:stable`` into the first state's ``baseline`` inside the
    script, so the canary's stable counts start exactly when the candidate starts receiving traffic.
    """
    updates = {
        k: ("" if v is None else ("1" if v is True else "0" if v is False else str(v)))
        for k, v in (policy or {}).items()
    }
    if updates:
        updates["updated_at"] = repr(time.time())
    states = list(states)
    by_version = {str(st.version): st.to_json().decode() for st in states}
    snap_field = str(states[0].version) if snapshot_stable is not None and states else ""
    snap_key = keys.stats(snapshot_stable, STABLE) if snapshot_stable is not None else keys.policy
    result = APPLY.run(
        client,
        [keys.policy, keys.rollout, keys.decisions, snap_key],
        [
            str(expect_stable),
            "" if expect_candidate is None else str(expect_candidate),
            orjson.dumps(updates),
            orjson.dumps(by_version),
            snap_field,
            decision.to_json(),
            DECISIONS_MAXLEN,
        ],
    )
    return text(result) if result else None


def records(raw: Iterable[Any]) -> list[tuple[str, DecisionRecord]]:
    """``(stream id, record)`` of XRANGE-shaped entries, in their order (for a caller that pipelines the reads: the
    operator reads every project line's decisions in one round trip)."""
    return [(i, DecisionRecord.from_json(f[DATA])) for i, f in entries(raw) if DATA in f]


def latest(client: redis.Redis, keys: Keys, count: int = 20) -> list[tuple[str, DecisionRecord]]:
    """The latest ``count`` decisions, oldest first."""
    return records(reversed(client.xrevrange(keys.decisions, count=count)))


def after(client: redis.Redis, keys: Keys, last_id: str = "0-0", count: int = 100) -> list[tuple[str, DecisionRecord]]:
    """Decisions newer than ``last_id``."""
    return records(client.xrange(keys.decisions, min=f"({last_id}", count=count))


async def latest_async(client: Any, keys: Keys, count: int = 20) -> list[tuple[str, DecisionRecord]]:
    return records(reversed(await client.xrevrange(keys.decisions, count=count)))


async def after_async(client: Any, keys: Keys, last_id: str, count: int = 100) -> list[tuple[str, DecisionRecord]]:
    """Decisions newer than ``last_id`` (the operator turns each into an Event)."""
    return records(await client.xrange(keys.decisions, min=f"({last_id}", count=count))


# --- verdicts ----------------------------------------------------------------------------------------------------
def verdicts(client: redis.Redis, keys: Keys) -> dict[int, RolloutState]:
    return {int(text(f)): RolloutState.from_json(raw) for f, raw in pairs(client.hgetall(keys.rollout))}


def verdict(client: redis.Redis, keys: Keys, version: int) -> RolloutState | None:
    raw = client.hget(keys.rollout, str(version))
    return RolloutState.from_json(raw) if raw else None


def write_activity(client: redis.Redis, keys: Keys, activity: str, since: float | None = None) -> None:
    """The controller's current activity ("" when idle, or when the policy table and the canary's figures say it)."""
    client.hset(keys.controller_status, mapping={"activity": activity, "since": f"{since or time.time():.3f}"})


def read_activity(client: redis.Redis, keys: Keys) -> tuple[str, float | None]:
    """(activity, since); ("", None) when the controller never wrote one. A malformed ``since`` reads as None."""
    raw = {text(k): text(v) for k, v in (client.hgetall(keys.controller_status) or {}).items()}
    try:
        since: float | None = float(raw["since"])
    except (KeyError, ValueError):
        since = None
    return raw.get("activity", ""), since
