"""One Redis ACL user per component, generated from the data-plane contract (``contract.FAMILIES``).

Why: with one shared password any pod that can reach Redis can XADD a forged training sample or rewrite the policy
table. Here each component gets a user that may touch only the key families the contract lets it write (read+write
key selector ``~``) or read (``%R~``), with the commands those families' Redis types need; nothing dangerous or
administrative except for ``admin`` (the CLI and a human operator). Lua scripts run with the caller's rights, so a
script cannot widen them. The ``default`` user is switched off: an unauthenticated client can do nothing.

Append-only families (``Family.appenders``: feedback on ``samples``, every audit writer) use a Redis ACL *selector*:
the user's root rights only read such a key (``%R~``), and one selector ``(~<its write and append keys> +xadd +eval
+evalsha)`` adds the right to XADD to it, alone or from a script that declares it. Redis allows a command when the
root rights or one selector allow it whole, so DEL, UNLINK, XTRIM, XDEL, EXPIRE or SET on the stream is refused (the
root has no write right on it, the selector no such command), inside a script too. What no ACL rule can refuse:
XADD's own ``MAXLEN``/``MINID`` option trims (Redis rules name commands and keys, not options), so an appender that
runs arbitrary commands could still trim with an XADD; our code never passes one on ``samples``.

Keys are ``orl:{job}:<pattern>``: the braces are literal characters of the key, and ACL patterns are globs, so the job
is escaped (``orl:\\{demo\\}:``); a job named ``a*`` cannot reach job ``ab``'s keys.

Everything here is pure except :func:`apply` (ACL SETUSER on a live server) and :func:`new_passwords`.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from onlinerl.dataplane.contract import FAMILIES, LINE_SUFFIX, Component, Family

USERS: tuple[Component, ...] = tuple(Component)
DEFAULT_OFF = ("default", "reset", "off")

# Every user: connection housekeeping redis-py sends, and TIME (components date records by the server clock).
CONNECTION = ("ping", "echo", "time", "client|setinfo", "client|setname", "client|getname", "multi", "exec", "discard")
# Scripts (EVALSHA, and EVAL after a NOSCRIPT): each command inside is checked against the same user.
SCRIPTING = ("eval", "evalsha", "script|load", "script|exists")

_READ = {
    "hash": ("hget", "hmget", "hgetall", "hexists", "hkeys", "hvals", "hlen", "hstrlen", "hscan", "httl", "hpttl"),
    "stream": ("xrange", "xrevrange", "xlen", "xread", "xinfo|stream", "xinfo|groups", "xinfo|consumers", "xpending"),
    "string": ("get", "mget", "strlen"),
    "zset": ("zrange", "zrangebyscore", "zscore", "zcard", "zcount", "zrank"),
    "set": ("smembers", "sismember", "scard", "sscan"),
}
_XGROUP = ("xgroup|create", "xgroup|setid", "xgroup|createconsumer", "xgroup|delconsumer")
_WRITE = {
    "hash": ("hset", "hsetnx", "hmset", "hdel", "hincrby", "hincrbyfloat", "hexpire", "hpexpire", "hpersist"),
    "stream": ("xadd", "xtrim", "xdel", "xack", "xreadgroup", "xautoclaim", "xclaim", *_XGROUP),
    "string": ("set", "setnx", "getdel", "getex", "incr", "incrby", "decr", "decrby"),
    "zset": ("zadd", "zrem", "zremrangebyscore", "zincrby", "zpopmin"),
    "set": ("sadd", "srem"),
}
_READ_ANY = ("exists", "type", "ttl", "pttl")
_WRITE_ANY = ("del", "unlink", "expire", "pexpire", "persist")

# (component, family name) pairs the component only reads, but passes as a declared key of a Lua script that also
# writes: Redis checks EVAL's declared keys as read+write ("we cannot tell how the keys will be used"), so these get
# the read+write selector. Each is a real widening; keep the list short and say where it comes from.
SCRIPT_READS: frozenset[tuple[Component, str]] = frozenset(
    {
        (Component.RELOADER, "rollout verdicts"),  # policy.RAISE_STABLE (strategy direct) reads the verdict
        (Component.ROLLOUT, "arm statistics"),  # decisions.APPLY snapshots the stable arm's stats into a baseline
        (Component.OPERATOR, "arm statistics"),  # the same script, for spec.rollout.rollbackTo
    }
)
# ... on every project's policy line too (issue 39: the same scripts, handed a line's keys)
SCRIPT_READS |= {(c, name + LINE_SUFFIX) for c, name in SCRIPT_READS}


def key_prefix(job: str | None) -> str:
    """The escaped ACL pattern of a job's prefix; ``None``: every job (a Redis shared by several jobs)."""
    if job is None:
        return "orl:\\{*\\}:"
    return "orl:\\{" + escape_glob(job) + "\\}:"


def escape_glob(text: str) -> str:
    """``text`` as a literal inside a Redis glob: every glob-special character (and the braces) backslash-escaped."""
    return "".join("\\" + ch if ch in "*?[]\\{}" else ch for ch in text)


# What an appender may do to an append-only family besides reading it: add entries, alone or from a script.
APPEND = ("xadd", "evalsha", "eval")


def _families(component: Component) -> tuple[list[Family], list[Family], list[Family]]:
    """(families it writes, families it only appends to, families it only reads) for ``component``."""
    writes = [f for f in FAMILIES if f.may_write(component) or (component, f.name) in SCRIPT_READS]
    appends = [f for f in FAMILIES if f.may_append(component) and f not in writes]
    reads = [f for f in FAMILIES if f.may_read(component) and f not in writes and f not in appends]
    return writes, appends, reads


def key_selectors(component: Component, job: str | None) -> list[str]:
    """The root key rights: ``~pattern`` (read+write) per family it writes, ``%R~pattern`` per family it only reads
    or only appends to (the append right is in :func:`append_selector`)."""
    if component is Component.ADMIN:
        return ["~*"]
    writes, appends, reads = _families(component)
    prefix = key_prefix(job)
    return [f"~{prefix}{f.pattern}" for f in writes] + [f"%R~{prefix}{f.pattern}" for f in appends + reads]


def append_selector(component: Component, job: str | None) -> str | None:
    """The selector that lets ``component`` XADD to its append-only families and run a script declaring them (with
    its other write keys, as the scripts do), and nothing else; None when it appends to none."""
    writes, appends, _ = _families(component)
    if component is Component.ADMIN or not appends:
        return None
    prefix = key_prefix(job)
    keys = [f"~{prefix}{f.pattern}" for f in writes + appends]
    return "(" + " ".join([*keys, "resetchannels", "-@all", *(f"+{c}" for c in APPEND)]) + ")"


def commands(component: Component) -> list[str]:
    """The commands ``component``'s root rights allow: those of its families' types (read ones for what it only
    reads or appends to), sorted."""
    if component is Component.ADMIN:
        return ["@all"]
    writes, appends, reads = _families(component)
    out = set(CONNECTION) | set(SCRIPTING)
    for f in writes:
        out |= set(_READ[f.redis_type]) | set(_WRITE[f.redis_type]) | set(_READ_ANY) | set(_WRITE_ANY)
    for f in appends + reads:
        out |= set(_READ[f.redis_type]) | set(_READ_ANY)
    return sorted(out)


def password_hash(password: str) -> str:
    """What Redis stores for a password (``#<sha256>`` in a rule): the aclfile never holds the password itself."""
    return hashlib.sha256(password.encode()).hexdigest()


def user_rule(component: Component, job: str | None, password: str, hashed: str | None = None) -> list[str]:
    """The ACL SETUSER arguments after the user name: reset, on, the password's hash (``hashed``, if given, is used
    as the hash: a placeholder for a template), keys, channels, commands, and the append selector (one argument)."""
    if component is Component.ADMIN:
        rights = ["&*", "+@all"]
    else:
        rights = ["resetchannels", "-@all", *(f"+{c}" for c in commands(component))]
    secret = f"#{hashed if hashed is not None else password_hash(password)}"
    selector = append_selector(component, job)
    return ["reset", "on", secret, *key_selectors(component, job), *rights, *([selector] if selector else [])]


def rules(job: str | None, passwords: Mapping[Component, str]) -> dict[str, list[str]]:
    """Every user's rule (``default`` off) for ``job``: ``{user: [rule, ...]}``. Raises on a missing password."""
    missing = [c.value for c in USERS if not passwords.get(c)]
    if missing:
        raise ValueError(f"Redis ACL: no password for user(s) {', '.join(missing)}")
    return _lines({c.value: user_rule(c, job, passwords[c]) for c in USERS})


def _lines(users: dict[str, list[str]]) -> dict[str, list[str]]:
    return {**users, DEFAULT_OFF[0]: list(DEFAULT_OFF[1:])}


def _text(all_rules: dict[str, list[str]]) -> str:
    return "".join(f"user {name} {' '.join(rule)}\n" for name, rule in all_rules.items())


def aclfile_text(job: str | None, passwords: Mapping[Component, str]) -> str:
    """The ``aclfile`` a server starts with (``--aclfile``): one ``user`` line per user, hashes only."""
    return _text(rules(job, passwords))


def aclfile_template(job: str | None = None) -> str:
    """The aclfile with ``@<user>@`` where each password's SHA-256 goes: the helm chart's shared Redis fills it in
    at start from its Secret (``job`` None: a Redis shared by every job). Generated into the chart (CHART_FILES)."""
    return _text(_lines({c.value: user_rule(c, job, "", hashed=f"@{c.value}@") for c in USERS}))


# The chart's shared Redis serves several jobs, each with its own users ``<job>.<component>`` confined to its keys
# (``orl:{<job>}:``), as a job's own Redis is: a user of one job reaches no other job's keys. Helm fills the per-job
# template once per job of ``redis.jobs`` (``CHART_JOB``: the name, ``CHART_JOB_VAR``: the name as a shell variable
# part, ``-`` -> ``_``), then appends the global one (``admin``, ``default`` off). Job names there are DNS labels
# (``[a-z0-9-]``), so neither holds a glob or shell character.
CHART_JOB = "@job@"
CHART_JOB_VAR = "@jobvar@"
CHART_JOB_USERS: tuple[Component, ...] = tuple(c for c in USERS if c is not Component.ADMIN)


def chart_user(job: str, component: Component) -> str:
    """The Redis user of ``component`` of ``job`` on the chart's shared Redis (its Secret key too)."""
    return f"{job}.{component.value}"


def _env_part(job: str, component: Component) -> str:
    """What follows ``ORL_REDIS_PW_`` for that user: a shell variable name part."""
    return f"{job.replace('-', '_')}__{component.value}"


def chart_job_template() -> str:
    """One job's users on the chart's shared Redis, with ``CHART_JOB``/``CHART_JOB_VAR`` for helm to fill in."""
    users = {
        chart_user(CHART_JOB, c): user_rule(c, CHART_JOB, "", hashed=f"@{CHART_JOB_VAR}__{c.value}@")
        for c in CHART_JOB_USERS
    }
    return _text(users)


def chart_global_template() -> str:
    """The chart's shared Redis users of no job: ``admin`` (everything; the CLI, the probes) and ``default`` off."""
    return _text(_lines({Component.ADMIN.value: user_rule(Component.ADMIN, None, "", hashed="@admin@")}))


def chart_aclfile_template(jobs: Iterable[str]) -> str:
    """What the chart renders for ``redis.jobs`` (the per-job template filled in per job, then the global one): the
    tests hold helm's output to it."""
    per_job = chart_job_template()
    return "".join(per_job.replace(CHART_JOB_VAR, j.replace("-", "_")).replace(CHART_JOB, j) for j in jobs) + (
        chart_global_template()
    )


def chart_password_env(job: str, component: Component) -> str:
    """The env variable the chart's Redis reads ``chart_user(job, component)``'s password from."""
    return PASSWORD_ENV_PREFIX + _env_part(job, component)


# The Kubernetes Redis (operator and chart) starts through this script: it fills each password's SHA-256 into the
# template, for every ``#@<name>@`` placeholder there, from ``$ORL_REDIS_PW_<name>``, and execs the server with the
# aclfile, so rendering stays pure and the aclfile never holds a password. A missing password stops the start (an
# empty one would open the user). Placeholder names are ``[A-Za-z0-9_]``: nothing else reaches the ``eval``.
PASSWORD_ENV_PREFIX = "ORL_REDIS_PW_"
TEMPLATE_PATH = "/etc/redis-acl/users.acl.tpl"
ACLFILE_PATH = "/run/redis-acl/users.acl"
_STARTUP = """#!/bin/sh
# Generated by onlinerl.dataplane.acl: fill each ACL user's password hash into the aclfile, then exec the server
# with it (and this script's arguments).
set -eu
umask 077
tpl="${{ORL_REDIS_ACL_TEMPLATE:-{template}}}"
out="${{ORL_REDIS_ACL_FILE:-{aclfile}}}"
cp "$tpl" "$out"
for u in $(grep -o '#@[A-Za-z0-9_]*@ ' "$out" | tr -d '#@ ' | sort -u); do
  eval "pw=\\${{{prefix}$u:-}}"
  if [ -z "$pw" ]; then echo "no password for Redis user $u (set {prefix}$u)" >&2; exit 1; fi
  h=$(printf %s "$pw" | sha256sum | cut -d' ' -f1)
  sed -i "s/#@$u@ /#$h /" "$out"
done
if grep -q "#@" "$out"; then echo "a user of $tpl got no password" >&2; exit 1; fi
exec "$(command -v valkey-server || command -v redis-server)" "$@" --aclfile "$out"
"""


def startup_script() -> str:
    """The shell script a Kubernetes Redis starts with (see ``_STARTUP``)."""
    return _STARTUP.format(template=TEMPLATE_PATH, aclfile=ACLFILE_PATH, prefix=PASSWORD_ENV_PREFIX)


def startup_digest(job: str | None) -> str:
    """Digest of the template and the script: a pod annotation, so a new contract restarts the server."""
    return hashlib.sha256((aclfile_template(job) + startup_script()).encode()).hexdigest()[:16]


CHART_FILES = {
    "charts/onlinerl/files/redis-users.acl.tpl": chart_job_template,
    "charts/onlinerl/files/redis-admin.acl.tpl": chart_global_template,
    "charts/onlinerl/files/redis-acl-start.sh": startup_script,
}


def rules_digest(job: str | None) -> str:
    """A digest of the rules without passwords: changes exactly when the contract or the job changes (a pod
    annotation, so a new contract restarts the server with the new aclfile)."""
    fixed = {c: "-" for c in USERS}
    return hashlib.sha256(aclfile_text(job, fixed).encode()).hexdigest()[:16]


def new_passwords(components: Iterable[Component] = USERS) -> dict[Component, str]:
    """A fresh URL-safe password per user (they travel inside Redis URLs unescaped)."""
    return {c: secrets.token_hex(24) for c in components}


def apply(client: Any, job: str | None, passwords: Mapping[Component, str]) -> None:
    """ACL SETUSER every user on a live server (the caller is allowed to: admin, or the still-open default user);
    ``default`` is switched off last, so a caller authenticated as ``default`` keeps its connection until then."""
    all_rules = rules(job, passwords)
    for name, rule in all_rules.items():
        if name != DEFAULT_OFF[0]:
            client.execute_command("ACL", "SETUSER", name, *rule)
    client.execute_command("ACL", "SETUSER", DEFAULT_OFF[0], *DEFAULT_OFF[1:])


def main() -> None:
    """``python -m onlinerl.dataplane.acl``: regenerate the chart's aclfile template (a test fails when stale)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for rel, render in CHART_FILES.items():
        (root / rel).write_text(render())
        print(f"wrote {rel}")


if __name__ == "__main__":
    main()
