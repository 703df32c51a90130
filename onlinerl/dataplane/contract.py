"""Who may touch which key: the data plane's contract as a table (the ACL users are generated from it).

Every Redis key of a job lives under ``orl:{job}:`` (``onlinerl.keys.Keys``). A key family is one kind of key (a
hash, a stream, a set...) with one typed module in ``onlinerl/dataplane/`` that holds its reader and its writer. This
table says, per family, which component writes it and which reads it. ``onlinerl.dataplane.acl`` turns it into one
Redis ACL user per component, so a component that tries to touch a key outside its rights is refused by Redis itself,
and a test holds the table, the modules and the ACLs to each other.

``pattern`` is the key glob *after* the job prefix (e.g. ``rollouts:*`` is ``orl:{job}:rollouts:*``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Component(StrEnum):
    """A process class with its own Redis user. A serving pod runs two: the internet-facing ``gateway`` (routes and
    records what it served) and the ``reloader`` (loads versions, reports them, applies ``rollout.strategy: direct``),
    each with its own password, so a compromised gateway holds none of the reloader's rights."""

    GATEWAY = "gateway"
    RELOADER = "reloader"
    FEEDBACK = "feedback"
    TRAINER = "trainer"
    ROLLOUT = "rollout"
    OPERATOR = "operator"
    ADMIN = "admin"  # the `onlinerl` CLI (status, policy, eval) and an operator of the product: everything


@dataclass(frozen=True)
class Family:
    """One key family: its glob under the job prefix, its Redis type, and who writes, who only appends to and who
    only reads it.

    A stream's consumer (XREADGROUP, XACK, XAUTOCLAIM) is a writer in Redis' ACL terms: reading through a group moves
    the group's state. An *appender* (streams only) may XADD and read, never delete, trim, expire or overwrite the
    key: what it added stays for the component that knows when it is consumed (the trainer for ``samples``)."""

    name: str
    pattern: str
    redis_type: str
    writers: frozenset[Component]
    readers: frozenset[Component]
    module: str  # the onlinerl.dataplane module that holds its reader and writer
    appenders: frozenset[Component] = frozenset()

    def may_write(self, component: Component) -> bool:
        return component is Component.ADMIN or component in self.writers

    def may_append(self, component: Component) -> bool:
        """May add entries (XADD): every writer, and the appenders."""
        return self.may_write(component) or component in self.appenders

    def may_read(self, component: Component) -> bool:
        return self.may_append(component) or component in self.readers


def _f(
    name: str, pattern: str, redis_type: str, writers: str, readers: str, module: str, appenders: str = ""
) -> Family:
    def parse(names: str) -> frozenset[Component]:
        return frozenset(Component(c) for c in names.split())

    if appenders and redis_type != "stream":
        raise ValueError(f"{name}: only a stream has append-only writers")
    return Family(name, pattern, redis_type, parse(writers), parse(readers), module, parse(appenders))


# name, pattern, type, writers, readers (besides the writers; admin may always do both), module, appenders.
# Checked against the code (wave 3, issue 35): the policy table has three writers, each of its own fields (rollout and
# the operator's rollbackTo through decisions.apply, the operator's pinned/paused through policy.set_field, the
# reloader under strategy direct through policy.raise_stable); the gateway only reads it, under every strategy (it
# routes; a compromised gateway cannot skip the gate and the canary). decisions.apply also writes the verdicts, so the
# operator writes those too. Holds are written by `onlinerl eval` (admin) and the rollout gate's evaluation (wave 4:
# the versions it compares were retired under it while the trainer kept publishing).
# The reloader reads the checkpoints stream with XREAD (no group), so it only reads it.
# Each serving replica's reloader writes only its own ``versions:{replica}`` hash and its heartbeat in ``replicas``
# (wave 4); the trainer reads holds to never prune a version an evaluation uses.
# Appenders (issue 35): feedback adds samples but never deletes or trims them (the trainer acknowledges and deletes
# what a durable checkpoint holds); every audit writer only appends (capped by XADD's own MAXLEN ~).
FAMILIES: tuple[Family, ...] = (
    _f("rollout records", "rollouts:*", "hash", "gateway feedback", "", "rollouts"),
    _f("silence due", "silence:*", "zset", "gateway feedback", "", "rollouts"),
    _f("rollout record index", "rollouts-index:*", "zset", "gateway", "", "rollouts"),
    _f("samples", "samples", "stream", "trainer", "", "samples", appenders="feedback"),
    _f("audit", "audit", "stream", "", "", "audit", appenders="feedback trainer reloader"),
    _f("idempotency", "seen:*", "string", "feedback", "", "samples"),
    _f("contribution counters", "contrib:*", "string", "feedback", "", "limits"),
    _f("user statistics", "ustats:*", "hash", "feedback", "", "limits"),
    _f("quarantine", "quarantine:*", "string", "feedback", "", "limits"),
    _f("checkpoints", "checkpoints", "stream", "trainer", "reloader", "checkpoints"),
    _f("policy table", "policy", "hash", "rollout operator reloader", "gateway trainer", "policy"),
    _f("replica versions", "versions:*", "hash", "reloader", "trainer rollout operator", "versions"),
    _f("replicas", "replicas", "zset", "reloader", "trainer rollout operator", "versions"),
    _f("holds", "holds", "hash", "rollout", "reloader trainer", "holds"),
    _f("arm statistics", "stats:*", "hash", "gateway feedback", "rollout operator", "stats"),
    _f("decisions", "decisions", "stream", "rollout operator", "", "decisions"),
    _f("rollout verdicts", "rollout", "hash", "rollout operator", "reloader", "decisions"),
    _f("rollout controller status", "controller", "hash", "rollout", "", "decisions"),
    _f("trainer status", "trainer", "hash", "trainer", "operator", "trainer"),
    _f("trainer lease", "trainer:*", "string", "trainer", "", "trainer"),
    _f("reloader status", "reloader", "hash", "reloader", "", "versions"),
)

# Issue 39: a project with an adapter of its own has a policy line of its own (``Keys.for_project``): these families
# exist once per line, under ``p:{project}:``, with the same writers and readers as the shared line's. ``p:*:`` cannot
# reach another family: a project name holds no ``:`` (``keys.TENANT_PATTERN``).
LINE_PREFIX = "p:*:"
PER_LINE = (
    "checkpoints",
    "policy table",
    "replica versions",
    "holds",
    "arm statistics",
    "decisions",
    "rollout verdicts",
    "rollout controller status",
)
LINE_SUFFIX = " of project lines"


def _of_lines(f: Family) -> Family:
    return replace(f, name=f.name + LINE_SUFFIX, pattern=LINE_PREFIX + f.pattern)


FAMILIES = (
    *FAMILIES,
    *(_of_lines(f) for f in FAMILIES if f.name in PER_LINE),
    # the registry of project lines: the trainer adds a line before it announces the line's first version
    _f("policy lines", "lines", "set", "trainer", "gateway reloader rollout operator", "lines"),
)
