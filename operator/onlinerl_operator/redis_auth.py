"""The in-cluster Redis users' passwords: a Secret created once per job, one key per ACL user.

Rendering is pure (no randomness), so generated passwords cannot come from :mod:`onlinerl_operator.render`: the
reconciler calls :func:`ensure_redis_secret` before applying the children, and :func:`redis_secret_problem` on every
pass. The Secret is only ever *created*; an existing one (a previous pass, or the user's ``redis.passwordSecret``) is
read, never written, so running pods keep their passwords and the operator needs no patch right on Secrets. The
aclfile needs no Secret: Redis fills the password hashes into the rendered template itself at start
(``onlinerl.dataplane.acl.startup_script``).
"""

from __future__ import annotations

import base64

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl_operator.kube import Kube
from onlinerl_operator.render import RenderContext, redis_password_secret, redis_url_for


def secret_values(secret: dict | None) -> dict[str, str]:
    """A Secret's values, decoded (``data``; ``stringData`` too: what an API emulator without conversion stores)."""
    secret = secret or {}
    out = dict(secret.get("stringData") or {})
    out.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
    return out


def missing_users(secret: dict | None) -> list[str]:
    values = secret_values(secret)
    return [u.value for u in acl.USERS if not values.get(u.value)]


async def ensure_redis_secret(kube: Kube, ctx: RenderContext) -> None:
    """Create the generated password Secret if missing (apply passes only: the one write here)."""
    if not ctx.in_cluster_redis or ctx.cfg.redis.password_secret:
        return
    if await kube.get("Secret", ctx.namespace, ctx.redis_password_secret) is None:
        await kube.create(redis_password_secret(ctx, acl.new_passwords()))  # None on 409: it exists, keeps its values


async def redis_secret_problem(kube: Kube, ctx: RenderContext) -> str | None:
    """What is wrong with the users' password Secret, for the status; None when every user has a password. Read
    only, so every pass reports it (not only the apply that found it) and the pass after a fix clears it."""
    if not ctx.in_cluster_redis:
        return None
    name = ctx.redis_password_secret
    found = await kube.get("Secret", ctx.namespace, name)
    missing = missing_users(found)
    if not missing:
        return None
    literals = " ".join(f"--from-literal={u}=<url-safe password>" for u in missing)
    if ctx.cfg.redis.password_secret:
        return (
            f"redis.passwordSecret {name!r} not found or without key(s) {', '.join(missing)} (one password per Redis "
            f"user): create it (kubectl create secret generic {name} {literals})"
        )
    if found is None:  # the generated one, deleted since: only an apply pass creates it
        return (
            f"Secret {name} (the generated Redis passwords) is gone: the operator creates it again at the next change "
            "of the spec; then restart the job's pods"
        )
    return (  # a generated Secret from an older contract: the operator never rewrites a Secret
        f"Secret {name} has no password for Redis user(s) {', '.join(missing)}: delete it to have every password "
        f"generated again (then restart the job's pods), or add the key(s) ({literals})"
    )


async def in_cluster_redis_url(kube: Kube, ctx: RenderContext, user: Component = Component.OPERATOR) -> str:
    """The URL (user ``operator`` by default, with its password) the operator itself uses for the job's Redis."""
    values = secret_values(await kube.get("Secret", ctx.namespace, ctx.redis_password_secret))
    if not values.get(user.value):
        raise LookupError(f"Secret {ctx.redis_password_secret} with key {user.value!r} (Redis password) not found")
    return redis_url_for(ctx, user, values[user.value])
