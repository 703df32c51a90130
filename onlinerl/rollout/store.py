"""Redis access for the rollout: read the policy table, counters and verdicts; apply a decision atomically.

Every change goes through one Lua script that (1) checks the policy table still has the stable and candidate the
decision was computed for, (2) updates the table, (3) writes the version's verdict, (4) appends the decision record.
All four happen or none: a concurrent manual rollback can never be overwritten by a stale promote, and no change is
ever left unrecorded. All keys carry the job's hash tag, so this is valid on Redis Cluster too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from onlinerl.arms import STABLE, Arm
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats, DecisionRecord, RolloutState
from onlinerl.schemas import PolicyTable, PolicyVersionState

DECISIONS_MAXLEN = 10_000
ANY = "*"

# KEYS: policy, rollout states, decisions, stats key to snapshot into a state's baseline
# ARGV: expected stable ('*' = any), expected candidate ('' = none, '*' = any), policy updates JSON object,
#       states JSON object {version: state JSON string}, version whose state gets the baseline ('' = none),
#       decision JSON, stream maxlen
_APPLY = """
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
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class RolloutStore:
    r: redis.Redis
    keys: Keys

    def __post_init__(self) -> None:
        self._apply = self.r.register_script(_APPLY)

    # --- reads ---------------------------------------------------------------------------------------------------
    def policy(self) -> PolicyTable:
        return PolicyTable.from_redis(self.r.hgetall(self.keys.policy))

    def versions(self) -> dict[int, PolicyVersionState]:
        out: dict[int, PolicyVersionState] = {}
        for field, raw in self.r.hgetall(self.keys.versions).items():
            try:
                out[int(_s(field))] = PolicyVersionState.from_json(raw)
            except ValueError:  # a malformed entry is the reloader's bug; it must not stop the rollout
                continue
        return out

    def states(self) -> dict[int, RolloutState]:
        raw_states = self.r.hgetall(self.keys.rollout)
        return {int(_s(f)): RolloutState.from_json(raw) for f, raw in raw_states.items()}

    def state(self, version: int) -> RolloutState | None:
        raw = self.r.hget(self.keys.rollout, str(version))
        return RolloutState.from_json(raw) if raw else None

    def arm_stats(self, version: int, arm: Arm) -> ArmStats:
        """Counters of one (version, arm), incl. ``shown_chars`` / ``accepted_chars`` (0 where not counted)."""
        return ArmStats.from_mapping(self.r.hgetall(self.keys.stats(version, arm)))

    def decisions(self, count: int = 20) -> list[tuple[str, DecisionRecord]]:
        """The latest ``count`` decisions, oldest first."""
        entries = self.r.xrevrange(self.keys.decisions, count=count)
        return [(_s(i), DecisionRecord.from_json(f[b"data"])) for i, f in reversed(entries)]

    def decisions_after(self, last_id: str = "0-0", count: int = 100) -> list[tuple[str, DecisionRecord]]:
        """Decisions newer than ``last_id`` (for the operator to turn into Events and conditions)."""
        entries = self.r.xrange(self.keys.decisions, min=f"({last_id}", count=count)
        return [(_s(i), DecisionRecord.from_json(f[b"data"])) for i, f in entries]

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
        snap_key = self.keys.stats(snapshot_stable, STABLE) if snapshot_stable is not None else self.keys.policy
        result = self._apply(
            keys=[self.keys.policy, self.keys.rollout, self.keys.decisions, snap_key],
            args=[
                str(expect_stable),
                "" if expect_candidate is None else str(expect_candidate),
                orjson.dumps(updates),
                orjson.dumps(by_version),
                snap_field,
                decision.to_json(),
                DECISIONS_MAXLEN,
            ],
        )
        return _s(result) if result else None
