"""Policy lines (issue 39): the job-wide registry of project lines (``lines`` set) and one pipelined read of many lines.

A project with an adapter of its own has a policy line of its own (``Keys.for_project``): its policy table, version
states, verdicts and decisions. Under ``projects.adapters: all`` no config lists them, so each line is registered in
``Keys.lines`` when it gets its first version (the trainer, before it announces it; ``register``), and readers (the
rollout controller, `onlinerl status`, the operator) find every line there without a SCAN of the keyspace.

``views`` reads what the rollout controller needs to know whether a line has anything to do (its policy table, its
verdicts, its version states on every live replica) for every line in one pipelined round trip, plus the two reads of
the live replicas every line shares: with a thousand lines one controller tick costs three round trips for the lines
that wait for nothing, and the full per-line reads only for lines with a candidate or a version to gate.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from onlinerl.dataplane import versions
from onlinerl.dataplane.codec import pairs, text
from onlinerl.keys import Keys, tenant_problem
from onlinerl.rollout.records import RolloutState
from onlinerl.schemas import PolicyTable, PolicyVersionState


def register(client: redis.Redis, keys: Keys, line: str) -> bool:
    """Add project ``line`` to the job's registry (idempotent); True when it was new. The shared line ('') is not
    registered: it always exists."""
    if not line:
        return False
    problem = tenant_problem(line)
    if problem:
        raise ValueError(problem)
    return bool(client.sadd(keys.lines, line))


async def register_async(client: Any, keys: Keys, line: str) -> bool:
    """:func:`register` on an asyncio client."""
    if not line:
        return False
    problem = tenant_problem(line)
    if problem:
        raise ValueError(problem)
    return bool(await client.sadd(keys.lines, line))


def registered(raw: Iterable[Any]) -> list[str]:
    """The valid line names of a ``SMEMBERS`` reply, sorted (a member that is not a tenant name is ignored: it
    could name another line's keys)."""
    out = set()
    for member in raw:
        try:
            name = text(member)
        except UnicodeDecodeError:
            continue
        if tenant_problem(name) is None:
            out.add(name)
    return sorted(out)


def read(client: redis.Redis, keys: Keys) -> list[str]:
    """Every registered project line, sorted."""
    return registered(client.smembers(keys.lines))


async def read_async(client: Any, keys: Keys) -> list[str]:
    """:func:`read` on an asyncio client (serving)."""
    return registered(await client.smembers(keys.lines))


def exists(client: redis.Redis, keys: Keys, line: str) -> bool:
    """Whether project ``line`` is a line of the job: registered, or it has a policy table (a listed project's line
    before its first version). `onlinerl policy --project` acts only on one (a typo must not create a table)."""
    pipe = client.pipeline(transaction=False)
    pipe.sismember(keys.lines, line)
    pipe.exists(keys.for_project(line).policy)
    registered_, table = pipe.execute()
    return bool(registered_) or bool(table)


@dataclass(frozen=True)
class LineView:
    """One line as the rollout controller first sees it in a tick: its policy table, its verdicts and the job-wide
    state of its versions over the live replicas (``versions.VersionTable.states``)."""

    line: str
    table: PolicyTable
    verdicts: dict[int, RolloutState] = field(default_factory=dict)
    versions: dict[int, PolicyVersionState] = field(default_factory=dict)
    activity: str | None = None  # the controller's activity line as stored (None: not read)


def parse_verdicts(raw: Any) -> dict[int, RolloutState]:
    """The ``rollout`` hash as ``version -> RolloutState`` (a malformed field is skipped, never fatal)."""
    out: dict[int, RolloutState] = {}
    for name, value in pairs(raw):
        try:
            out[int(text(name))] = RolloutState.from_json(value)
        except ValueError:
            continue
    return out


def views(
    client: redis.Redis, job: str, lines: Sequence[str], activity_of: Collection[str] = ()
) -> dict[str, LineView]:
    """Every line's :class:`LineView` ('' = the shared line): the live replicas once (two commands), then one
    pipeline of ``2 + replicas`` HGETALLs per line, and the stored activity of the lines in ``activity_of`` (a
    controller that has not seen a line yet: it writes its activity only when it differs from what is stored)."""
    shared = Keys(job)
    live = versions.live_replicas(client, shared)
    pipe = client.pipeline(transaction=False)
    for line in lines:
        k = shared.for_line(line)
        pipe.hgetall(k.policy)
        pipe.hgetall(k.rollout)
        for rid in live:
            pipe.hgetall(k.replica_versions(rid))
        if line in activity_of:
            pipe.hget(k.controller_status, "activity")
    replies = iter(pipe.execute())
    out: dict[str, LineView] = {}
    for line in lines:
        policy, verdicts = next(replies), next(replies)
        table = versions.table_of({rid: next(replies) for rid in live})
        activity = text(next(replies) or b"") if line in activity_of else None
        out[line] = LineView(line, PolicyTable.from_redis(policy), parse_verdicts(verdicts), table.states, activity)
    return out


async def tables_async(client: Any, job: str, projects: Sequence[str]) -> tuple[PolicyTable, dict[str, PolicyTable]]:
    """The shared policy table and each of ``projects``' line tables, in one pipelined round trip (the gateway's
    background refresh: it routes a key on its project's line)."""
    keys = Keys(job)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.policy)
    for project in projects:
        pipe.hgetall(keys.for_project(project).policy)
    shared, *tables = await pipe.execute()
    by_line = {p: PolicyTable.from_redis(t) for p, t in zip(projects, tables, strict=True)}
    return PolicyTable.from_redis(shared), by_line


async def tables_and_holds_async(client: Any, line_keys: Sequence[Keys]) -> list[tuple[PolicyTable, Any]]:
    """Each line's policy table and raw holds hash (``holds.active_holds`` reads it), in one pipelined round trip
    (the reloader's tick over the project lines it follows)."""
    pipe = client.pipeline(transaction=False)
    for keys in line_keys:
        pipe.hgetall(keys.policy)
        pipe.hgetall(keys.holds)
    replies = await pipe.execute()
    return [(PolicyTable.from_redis(replies[2 * i]), replies[2 * i + 1]) for i in range(len(line_keys))]


async def tables_and_decisions_async(
    client: Any, job: str, shown: Sequence[str], names: Sequence[str], after: str | None, per_line: int
) -> tuple[int, dict[str, PolicyTable], dict[str, list[Any]]]:
    """One atomic snapshot for the operator: the server time (ms), the policy tables of ``shown`` and, for every
    line of ``names``, its decisions after stream id ``after`` (oldest first, at most ``per_line``), or with no
    ``after`` its newest ``per_line`` (oldest first). Raw entries: ``decisions.records`` parses them."""
    keys = Keys(job)
    pipe = client.pipeline(transaction=True)  # one snapshot: a cursor over many streams needs one server time
    pipe.time()
    for name in shown:
        pipe.hgetall(keys.for_project(name).policy)
    for name in names:
        stream = keys.for_project(name).decisions
        if after:
            pipe.xrange(stream, min=f"({after}", count=per_line)
        else:
            pipe.xrevrange(stream, count=per_line)
    replies = await pipe.execute()
    seconds, micros = replies[0]
    tables = {name: PolicyTable.from_redis(raw) for name, raw in zip(shown, replies[1 : 1 + len(shown)], strict=True)}
    raw_decisions = {
        name: list(raw if after else reversed(raw)) for name, raw in zip(names, replies[1 + len(shown) :], strict=True)
    }
    return int(seconds) * 1000 + int(micros) // 1000, tables, raw_decisions
