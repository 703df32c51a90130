"""The in-cluster Redis password: created once per job in a Secret, read back by the operator for its own client.

Rendering is pure (no randomness), so the generated password cannot come from :mod:`onlinerl_operator.render`: the
reconciler calls :func:`ensure_redis_secret` before applying the children. It only ever *creates* the Secret; an
existing one (a previous pass, or the user's ``redis.passwordSecret``) is left alone, so running pods keep working.
"""

from __future__ import annotations

import base64
import secrets

from onlinerl_operator.kube import Kube
from onlinerl_operator.render import REDIS_PASSWORD_KEY, RenderContext, redis_password_secret, redis_url_with_password


def new_password() -> str:
    """URL-safe (hex): it travels inside the pods' Redis URL unescaped."""
    return secrets.token_hex(24)


async def ensure_redis_secret(kube: Kube, ctx: RenderContext) -> str | None:
    """Create the generated password Secret if missing; returns a problem for the status, or None."""
    if not ctx.in_cluster_redis:
        return None
    if ctx.cfg.redis.password_secret:
        found = await kube.get("Secret", ctx.namespace, ctx.cfg.redis.password_secret)
        if found is None or REDIS_PASSWORD_KEY not in (found.get("data") or {}):
            return (
                f"redis.passwordSecret {ctx.cfg.redis.password_secret!r} not found or without key "
                f"{REDIS_PASSWORD_KEY!r}: create it (kubectl create secret generic "
                f"{ctx.cfg.redis.password_secret} --from-literal={REDIS_PASSWORD_KEY}=<url-safe password>)"
            )
        return None
    manifest = redis_password_secret(ctx, new_password())
    if manifest is not None:
        await kube.create(manifest)  # None on 409: it exists, and keeps its password
    return None


async def in_cluster_redis_url(kube: Kube, ctx: RenderContext) -> str:
    """The URL (with password) the operator itself uses for the job's in-cluster Redis."""
    secret = await kube.get("Secret", ctx.namespace, ctx.redis_password_secret)
    data = (secret or {}).get("data") or {}
    if REDIS_PASSWORD_KEY in data:
        return redis_url_with_password(ctx, base64.b64decode(data[REDIS_PASSWORD_KEY]).decode())
    plain = (secret or {}).get("stringData") or {}  # what an API emulator without conversion stores
    if REDIS_PASSWORD_KEY in plain:
        return redis_url_with_password(ctx, plain[REDIS_PASSWORD_KEY])
    raise LookupError(f"Secret {ctx.redis_password_secret} with key {REDIS_PASSWORD_KEY!r} (Redis password) not found")
