"""The policy table (``policy`` hash): which version is stable, which is the candidate and its share, pinned, paused,
and ``hold`` (a manual decision). Read by every gateway (routing), the reloader (what to load) and the trainer (what
not to prune).

Writers, each of its own fields: the rollout controller and `onlinerl policy` (``decisions.apply``: the whole rollout
step in one script; the controller also ``preview``/``preview_until``, ``start_preview``), the operator
(``pinned``/``paused`` from the spec, ``set_field``), and under ``rollout.strategy: direct`` the reloader
(``raise_stable``).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from onlinerl.dataplane.codec import text
from onlinerl.dataplane.scripts import Script
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable

# strategy direct: raise policy.stable (KEYS[1]) to ARGV[1] only if it is newer (replicas race; stable never goes
# back), no manual decision holds the table, promotion is not paused, the rollout (KEYS[2]) never rolled ARGV[1]
# back, and ARGV[1] follows the last manual rollback's lineage (ARGV[3]: its announcement's rollback_at; '' = not
# known, not checked). One script: a concurrent `onlinerl policy rollback` is either before (seen) or after (wins).
RAISE_STABLE = Script("""
local t = redis.call('HMGET', KEYS[1], 'stable', 'hold', 'paused', 'rollback_to', 'rollback_at')
if t[2] and t[2] ~= '' then return -1 end
if t[3] == '1' then return -2 end
local verdict = redis.call('HGET', KEYS[2], ARGV[1])
if verdict then
  local ok, d = pcall(cjson.decode, verdict)
  if ok and (d['state'] == 'rolled_back' or d['state'] == 'gate_failed') then return -3 end
end
if ARGV[3] ~= '' and t[4] and t[4] ~= '' and tonumber(t[5] or '0') ~= tonumber(ARGV[3]) then return -4 end
local cur = tonumber(t[1] or '0') or 0
if tonumber(ARGV[1]) > cur then
  redis.call('HSET', KEYS[1], 'stable', ARGV[1], 'updated_at', ARGV[2])
  return 1
end
return 0
""")
RAISED = 1
NOT_RAISED = {
    0: "not newer",
    -1: "a manual decision holds stable",
    -2: "promotion paused",
    -3: "rolled back before",
    -4: "trained on weights a manual rollback dropped",
}


def read(client: redis.Redis, keys: Keys) -> PolicyTable:
    return PolicyTable.from_redis(client.hgetall(keys.policy))


async def read_async(client: Any, keys: Keys) -> PolicyTable:
    return PolicyTable.from_redis(await client.hgetall(keys.policy))


async def raise_stable(client: Any, keys: Keys, version: int, rollback_at: float | None = None) -> int:
    """``RAISE_STABLE``: ``RAISED`` (1), or a key of ``NOT_RAISED`` saying why not. ``rollback_at``: the lineage
    marker of the version's announcement (None: not known, not checked)."""
    marker = "" if rollback_at is None else repr(rollback_at)
    return int(
        await RAISE_STABLE.run_async(client, [keys.policy, keys.rollout], [str(version), repr(time.time()), marker])
    )


async def set_field(client: Any, keys: Keys, name: str, value: str) -> bool:
    """Set one field (the operator's ``pinned``/``paused``) when it differs; True if it changed."""
    current = await client.hget(keys.policy, name)
    if text(current or b"") == value:
        return False
    await client.hset(keys.policy, mapping={name: value, "updated_at": repr(time.time())})
    return True


# --- the eval gate's preview (full-weight mode) ----------------------------------------------------------------------
def start_preview(client: redis.Redis, keys: Keys, version: int, until: float) -> None:
    """The rollout controller asks every reloader to hold ``version`` for eval requests only, until ``until``
    (wall clock): past it a reloader restores stable by itself, so a dead controller cannot hold users."""
    client.hset(keys.policy, mapping={"preview": str(version), "preview_until": repr(until)})


def end_preview(client: redis.Redis, keys: Keys) -> None:
    """The preview is over (its verdict clears it inside ``decisions.apply``; this is for errors and timeouts)."""
    client.hset(keys.policy, mapping={"preview": "", "preview_until": "0.0"})
