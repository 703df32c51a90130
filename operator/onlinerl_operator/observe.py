"""What the operator reads from (and the one thing it writes to) the job's Redis: docs/architecture.md keys.

Reads: the policy table, per-version stats counters and the trainer's status hash, for the CR status; the project
policy lines' tables and decisions (project_lines.py).
Writes: only the ``pinned`` and ``paused`` fields of the shared line's policy table (spec.rollout.pinnedVersion /
paused: a project line is pinned and paused with `onlinerl policy --project P`, never from the spec), once per
change of the spec field, and ``spec.rollout.rollbackTo`` through the CLI's own rollback, ``paused: false`` through
the CLI's own resume (it releases a manual hold too); the reloader and the rollout controller own the other fields,
so the operator never rewrites them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from onlinerl.arms import LIVE_ARMS
from onlinerl.config import ProjectsConfig
from onlinerl.dataplane import decisions, policy, stats
from onlinerl.dataplane import trainer as trainer_status
from onlinerl.keys import Keys
from onlinerl.rollout.records import DecisionRecord
from onlinerl.schemas import PolicyTable
from onlinerl_operator import project_lines
from onlinerl_operator.kube import Kube
from onlinerl_operator.render import RenderContext

MAX_DECISIONS_PER_PASS = 20

ARMS = LIVE_ARMS


@dataclass
class RedisView:
    policy: PolicyTable | None = None
    accept_rate: float | None = None
    shown: int | None = None
    samples_trained: int | None = None
    trainer_step: int | None = None
    last_checkpoint_at: float | None = None
    decisions: list[tuple[str, DecisionRecord]] = field(default_factory=list)
    lines: project_lines.ProjectLinesView = field(default_factory=project_lines.ProjectLinesView)


async def redis_url(kube: Kube, ctx: RenderContext) -> str:
    """The URL the pods use: spec.redis.url, the external URL Secret, or the in-cluster Service (with its password)."""
    if ctx.in_cluster_redis:
        from onlinerl_operator.redis_auth import in_cluster_redis_url

        return await in_cluster_redis_url(kube, ctx)
    if ctx.redis_url:
        return ctx.redis_url
    secret = await kube.get("Secret", ctx.namespace, ctx.cfg.redis.url_secret)
    key = "operator" if ctx.cfg.redis.url_secret_per_user else ctx.cfg.redis.url_secret_key
    if secret is None or key not in (secret.get("data") or {}):
        raise LookupError(f"Secret {ctx.cfg.redis.url_secret} with key {key!r} (redis.urlSecret) not found")
    return base64.b64decode(secret["data"][key]).decode()


def _int(raw: dict[str, str], field: str) -> int:
    value = raw.get(field)
    return int(float(value)) if value else 0


def _client(url: str, timeout: float) -> aioredis.Redis:
    return aioredis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)


async def write_policy_field(url: str, job: str, name: str, value: str, timeout: float = 2.0) -> bool:
    """Set one operator-owned field of the policy table (``pinned`` from spec.rollout.pinnedVersion, ``paused`` from
    spec.rollout.paused) when it differs. Called once per change of that spec field (a kopf field handler), so a
    later manual decision (``onlinerl policy unpin``) sticks until the spec field changes again. ``paused`` set to
    false is the spec's ``onlinerl policy resume``: it also releases a manual hold (rollback, pin), see
    :func:`resume`."""
    if name == "paused" and value == "0":
        return await resume(url, job, timeout)
    keys = Keys(job)
    r = _client(url, timeout)
    try:
        return await policy.set_field(r, keys, name, value)
    finally:
        await r.aclose()


async def read_view(
    url: str,
    job: str,
    timeout: float = 2.0,
    decisions_after: str | None = None,
    projects: ProjectsConfig | None = None,
    project_decisions_after: str | None = None,
) -> RedisView:
    """What status shows: the policy table, the stable version's figures, the trainer, decisions not yet reported;
    with ``projects`` (adapters on) the project lines' tables and their decisions after ``project_decisions_after``."""
    keys = Keys(job)
    r = _client(url, timeout)
    try:
        view = RedisView()
        view.policy = await policy.read_async(r, keys)
        # Rollout decisions not yet reported (each becomes a Kubernetes Event); on first sight only the newest few.
        if decisions_after:
            view.decisions = await decisions.after_async(r, keys, decisions_after, MAX_DECISIONS_PER_PASS)
        else:
            view.decisions = await decisions.latest_async(r, keys, MAX_DECISIONS_PER_PASS)
        stable = view.policy.stable
        shown = accepted = 0
        for arm in ARMS:
            counters = await stats.read_async(r, keys, stable, arm)
            shown += counters.shown
            accepted += counters.accepted
        view.shown = shown
        view.accept_rate = round(accepted / shown, 4) if shown else None
        trainer = await trainer_status.read_status_async(r, keys)
        if trainer:
            view.samples_trained = _int(trainer, "samples_trained")
            view.trainer_step = _int(trainer, "step")
            last = trainer.get("last_checkpoint_at")
            view.last_checkpoint_at = float(last) if last else None
        if projects is not None:
            view.lines = await project_lines.read(r, job, projects, project_decisions_after)
        return view
    finally:
        await r.aclose()


async def resume(url: str, job: str, timeout: float = 2.0) -> bool:
    """spec.rollout.paused changed to false: the same resume as `onlinerl policy resume` (one code path, one decision
    record, actor ``operator``): promotions resume and a human's hold (rollback, pin) is released, so the rollout
    gates the newest version again. Nothing is written when the table is neither paused nor held. True if it acted."""
    import asyncio

    import redis

    from onlinerl.rollout.manual import set_paused
    from onlinerl.rollout.store import RolloutStore

    def run() -> bool:
        r = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            store = RolloutStore(r, Keys(job))
            table = store.policy()
            if not table.paused and table.hold is None:
                return False
            set_paused(store, False, actor="operator")
            return True
        finally:
            r.close()

    return await asyncio.to_thread(run)


async def manual_rollback(url: str, job: str, version: int, timeout: float = 2.0) -> str:
    """spec.rollout.rollbackTo: the same rollback as `onlinerl policy rollback N` (one code path, one decision record).
    Returns a problem message, or "" when done (also when there is nothing left to roll back)."""
    import asyncio

    import redis

    from onlinerl.errors import CommandError
    from onlinerl.rollout.manual import rollback
    from onlinerl.rollout.store import RolloutStore

    def run() -> str:
        r = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            rollback(RolloutStore(r, Keys(job)), version, actor="operator")
            return ""
        except CommandError as exc:
            if "nothing to roll back" in str(exc):
                return ""
            return f"spec.rollout.rollbackTo={version} not applied: {exc}"
        finally:
            r.close()

    return await asyncio.to_thread(run)
