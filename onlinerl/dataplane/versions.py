"""The versions family: what each serving replica has done with each announced version, and the job-wide view of it.

Per replica (writer: that replica's reloader): hash ``versions:{replica}`` (``version -> PolicyVersionState JSON``:
loading, loaded, ready, failed, retired) and a heartbeat, its member in the sorted set ``replicas`` scored by a
deadline (server clock + TTL). A replica whose deadline passed (dead, or its vLLM down) is out of the live set; its
hash expires an hour later (a replica back within the hour rejoins with its states). Why a hash per replica plus a
deadline zset: a replica writes only its own key (no last writer wins), the deadline is the replica's own promise so
readers need no TTL setting, the server clock (``TIME``) means no skew between pods, and one ``ZRANGEBYSCORE`` lists
the live set without a SCAN.

Job-wide (readers: the trainer, the rollout controller, the operator, `onlinerl status`/`eval`): :func:`read` returns
the AGGREGATE over the live replicas (:func:`aggregate`, pure): a version is ``loaded`` only when every live replica
has loaded it, so a switch completes for the live set only. :meth:`VersionTable.in_use` is the union instead (any live
replica has it loaded, loading or switchable): what pruning must keep. ``reloader`` (status hash) stays per job.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from onlinerl.dataplane.codec import pairs, str_map, text
from onlinerl.dataplane.scripts import Script
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyVersionState

HEARTBEAT_TTL_SECONDS = 10.0  # a replica silent this long is out of the live set
HEARTBEAT_EVERY_SECONDS = 2.0  # the reloader beats this often (a fifth of the TTL: four beats may be lost)
FORGET_AFTER_SECONDS = 3600.0  # a lapsed replica's zset member is removed by the next beat of anyone after this

# A replica id is a Kubernetes pod name or ``host-pid``: letters, digits, ``.``, ``_``, ``-``. No glob, brace or colon
# character, so ``versions:{replica}`` can never name another family's or another job's key.
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")

IN_USE = ("loaded", "loading", "ready", "previewing")  # in vLLM now, being loaded, or switchable at once


def default_replica_id() -> str:
    """``$ONLINERL_REPLICA`` (the pod name on Kubernetes, ``local-N`` locally), else ``<hostname>-<pid>``: unique on
    one machine too, and a restarted process is a new replica (the old id lapses with its heartbeat)."""
    return os.environ.get("ONLINERL_REPLICA") or f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def valid_replica(replica: str) -> bool:
    return isinstance(replica, str) and _REPLICA_ID.fullmatch(replica) is not None


def check_replica(replica: str) -> str:
    """``replica`` if valid, else ValueError saying what to fix (the reloader refuses to start with it)."""
    if not valid_replica(replica):
        raise ValueError(
            f"replica id {replica!r} is not valid: ONLINERL_REPLICA must be 1-253 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return replica


@dataclass
class VersionTable:
    """The job-wide view. ``states``: the aggregate per version; ``malformed``: versions whose entry does not parse on
    some live replica (a reloader bug: the trainer keeps them, the rollout ignores them); ``replicas``: each live
    replica's own states."""

    states: dict[int, PolicyVersionState] = field(default_factory=dict)
    malformed: set[int] = field(default_factory=set)
    replicas: dict[str, dict[int, PolicyVersionState]] = field(default_factory=dict)

    def loaded(self) -> set[int]:
        """Versions every live replica has loaded."""
        return {v for v, s in self.states.items() if s.state == "loaded"}

    def in_use(self) -> set[int]:
        """Versions any live replica has loaded, is loading or may switch to (and unreadable ones): keep them."""
        used = {v for states in self.replicas.values() for v, s in states.items() if s.state in IN_USE}
        return used | self.malformed


def aggregate_state(states: list[str], live: int) -> str:
    """One version's job-wide state from its state on the live replicas that know it (``live``: how many are live;
    a replica that does not know it yet counts as not having it). Pure."""
    everywhere = len(states) == live
    if everywhere and all(s in ("loaded", "ready") for s in states):
        return "loaded" if all(s == "loaded" for s in states) else "ready"  # ready: full weights, switchable
    if everywhere and len(set(states)) == 1:
        return states[0]  # the same everywhere (previewing, retired, ...)
    if "failed" in states:
        return "failed"  # it cannot complete on the live set
    if "loading" in states:
        return "loading"
    if "retired" in states:
        return "retired"  # going away: some have dropped it, the others will
    return "loading"  # some have it, the others are still to load it: the switch is under way


def aggregate(replicas: Mapping[str, Mapping[int, PolicyVersionState]]) -> dict[int, PolicyVersionState]:
    """The job-wide state of every version the live ``replicas`` know (pure): see :func:`aggregate_state`. Path and
    model come from any replica (the same for all); failures is the most of any; error names its replica."""
    out: dict[int, PolicyVersionState] = {}
    every = sorted({v for states in replicas.values() for v in states})
    for v in every:
        known = [(r, replicas[r][v]) for r in sorted(replicas) if v in replicas[r]]
        first = known[0][1]
        errors = [f"{r}: {s.error}" for r, s in known if s.error]
        out[v] = PolicyVersionState(
            version=v,
            state=aggregate_state([s.state for _, s in known], len(replicas)),  # type: ignore[arg-type]
            path=first.path,
            served_model=first.served_model,
            failures=max(s.failures for _, s in known),
            error="; ".join(errors)[:2000],
            updated_at=max(s.updated_at for _, s in known),
            rollback_at=first.rollback_at,
        )
    return out


def live_ids(raw: Iterable[Any], now: float) -> list[str]:
    """Valid replica ids whose deadline is after ``now`` from ``ZRANGE ... WITHSCORES`` pairs (pure: malformed or
    hostile members, e.g. glob characters or another job's key, are ignored)."""
    out = []
    for member, deadline in raw:
        try:
            rid = text(member)
        except UnicodeDecodeError:
            continue
        if valid_replica(rid) and float(deadline) > now:
            out.append(rid)
    return sorted(out)


def parse_replica(raw: Any) -> tuple[dict[int, PolicyVersionState], set[int]]:
    """One replica hash's states and its malformed versions (fields that are not version numbers are ignored)."""
    states: dict[int, PolicyVersionState] = {}
    malformed: set[int] = set()
    for name, value in pairs(raw):
        try:
            version = int(text(name))
        except ValueError:
            continue
        try:
            states[version] = PolicyVersionState.from_json(value)
        except ValueError:
            malformed.add(version)
    return states, malformed


def table_of(raw_replicas: Mapping[str, Any]) -> VersionTable:
    """The job-wide table from each live replica's raw hash (pure)."""
    table = VersionTable()
    for rid, raw in raw_replicas.items():
        states, malformed = parse_replica(raw)
        table.replicas[rid] = states
        table.malformed |= malformed
    table.states = aggregate(table.replicas)
    return table


def _now(reply: Any) -> float:
    seconds, micros = reply
    return int(seconds) + int(micros) / 1e6


# --- readers ---------------------------------------------------------------------------------------------------------
def live_replicas(client: redis.Redis, keys: Keys) -> list[str]:
    """Ids of the live serving replicas (deadline ahead of the server's clock)."""
    now = _now(client.time())
    return live_ids(client.zrangebyscore(keys.replicas, f"({now}", "+inf", withscores=True), now)


def read(client: redis.Redis, keys: Keys) -> VersionTable:
    """The job-wide table over the live replicas (no live replica: empty)."""
    ids = live_replicas(client, keys)
    return table_of({rid: client.hgetall(keys.replica_versions(rid)) for rid in ids})


async def read_async(client: Any, keys: Keys) -> VersionTable:
    """:func:`read` on an asyncio client (the reloader: strategy direct raises stable only once every replica has)."""
    now = _now(await client.time())
    ids = live_ids(await client.zrangebyscore(keys.replicas, f"({now}", "+inf", withscores=True), now)
    return table_of({rid: await client.hgetall(keys.replica_versions(rid)) for rid in ids})


def read_replica(client: redis.Redis, keys: Keys, replica: str) -> dict[int, PolicyVersionState]:
    """One replica's own states, live or not (tests, debugging)."""
    return parse_replica(client.hgetall(keys.replica_versions(check_replica(replica))))[0]


# --- writers (serving: each replica its own key) ---------------------------------------------------------------------
# KEYS[1] replicas zset, KEYS[2] the replica's hash; ARGV[1] replica id, ARGV[2] TTL (s), ARGV[3] forget after (s),
# ARGV[4] 1 = beat (move the deadline), 0 = only keep the hash alive, ARGV[5..] field, value pairs to set.
# The deadline is the server clock's, so pods' clocks never matter; the hash outlives it by the forget time (an hour):
# readers count live replicas only, and a replica whose vLLM was down for a minute rejoins with its states intact
# (its reloader writes a version's state only when it changes). Returns the deadline.
REPORT = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
if #ARGV > 4 then redis.call('HSET', KEYS[2], unpack(ARGV, 5)) end
local deadline = now + ttl
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[1], deadline, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
else
  local d = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if d then deadline = math.max(tonumber(d), now) end
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[2], math.floor((deadline - now + tonumber(ARGV[3])) * 1000))
end
return tostring(deadline)
""")


def _report_args(replica: str, ttl: float, beat: bool, states: Iterable[PolicyVersionState]) -> list[str]:
    args = [check_replica(replica), repr(float(ttl)), repr(FORGET_AFTER_SECONDS), "1" if beat else "0"]
    for s in states:
        args += [str(s.version), text(s.to_json())]
    return args


async def save_state(client: Any, keys: Keys, replica: str, state: PolicyVersionState) -> None:
    """The replica's reloader records one version's state in its own hash (no heartbeat: see :func:`beat_async`)."""
    args = _report_args(replica, HEARTBEAT_TTL_SECONDS, False, [state])
    await REPORT.run_async(client, [keys.replicas, keys.replica_versions(replica)], args)


async def beat_async(client: Any, keys: Keys, replica: str, ttl: float = HEARTBEAT_TTL_SECONDS) -> float:
    """Heartbeat: this replica is live for ``ttl`` more seconds (server clock); returns the new deadline."""
    args = _report_args(replica, ttl, True, [])
    return float(text(await REPORT.run_async(client, [keys.replicas, keys.replica_versions(replica)], args)))


async def keep_async(client: Any, keys: Keys, replica: str) -> None:
    """Keep the replica's hash of ``keys``' line alive with its heartbeat (no beat, no state written): a project
    line's states (issue 39) are written only when they change, while the beat itself touches the shared line's
    hash, so the reloader keeps each project line's hash as long as the replica lives."""
    args = _report_args(replica, HEARTBEAT_TTL_SECONDS, False, [])
    await REPORT.run_async(client, [keys.replicas, keys.replica_versions(replica)], args)


async def leave_async(client: Any, keys: Keys, replica: str) -> None:
    """A replica shutting down leaves the live set at once (its versions stop pinning now, not after the TTL)."""
    await client.zrem(keys.replicas, check_replica(replica))
    await client.delete(keys.replica_versions(replica))


def report(
    client: redis.Redis,
    keys: Keys,
    replica: str,
    states: Iterable[PolicyVersionState] = (),
    ttl: float = HEARTBEAT_TTL_SECONDS,
) -> float:
    """Synchronous beat plus states in one step (a replica stand-in: tests, `onlinerl` tools); returns the deadline."""
    args = _report_args(replica, ttl, True, list(states))
    return float(text(REPORT.run(client, [keys.replicas, keys.replica_versions(replica)], args)))


def leave(client: redis.Redis, keys: Keys, replica: str) -> None:
    """Synchronous :func:`leave_async`."""
    client.zrem(keys.replicas, check_replica(replica))
    client.delete(keys.replica_versions(replica))


# --- the reloader's status hash (per job, informative) ---------------------------------------------------------------
async def set_reloader_status(client: Any, keys: Keys, fields: dict[str, str]) -> None:
    """Fields of the reloader's last action: last_reload_at, last_version, last_error, weights_version."""
    await client.hset(keys.reloader_status, mapping=fields)


def read_reloader_status(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return str_map(client.hgetall(keys.reloader_status))
