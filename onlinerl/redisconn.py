"""Redis clients with deadlines: one place that every component builds its client from.

Without a socket timeout a half-open connection (a Redis pod gone without a FIN, a dropped NAT entry) hangs a
blocking call for ever, and a component that cannot do its job keeps answering its health check. Every client gets
``redis.connectTimeoutSeconds`` to connect and ``redis.socketTimeoutSeconds`` per reply; a caller that blocks on
purpose (XREAD/XREADGROUP ``BLOCK``) passes its longest block so the deadline stays above it.
"""

from __future__ import annotations

from typing import Any

from onlinerl.config import RedisConfig

BLOCK_MARGIN_SECONDS = 2.0  # a blocking read's reply may arrive this long after its block time ends


def timeouts(cfg: RedisConfig, longest_block_seconds: float = 0.0) -> dict[str, float]:
    """``socket_connect_timeout`` / ``socket_timeout`` kwargs; the latter always exceeds any block time used."""
    return {
        "socket_connect_timeout": cfg.connect_timeout_seconds,
        "socket_timeout": max(cfg.socket_timeout_seconds, longest_block_seconds + BLOCK_MARGIN_SECONDS),
    }


def connect(cfg: RedisConfig, url: str | None = None, longest_block_seconds: float = 0.0, **kw: Any) -> Any:
    """A synchronous client for ``url`` (default ``cfg.url``) with deadlines."""
    import redis

    if not (url or cfg.url):
        from onlinerl.config import ConfigError

        raise ConfigError(
            "no Redis URL: set redis.url (or ONLINERL__REDIS__URL). A local stack's is in the config `onlinerl up` "
            "wrote into its state directory (<state>/config.yaml): drop --config to use it"
        )
    return redis.Redis.from_url(url or cfg.url, **{**timeouts(cfg, longest_block_seconds), **kw})


def connect_async(cfg: RedisConfig, url: str | None = None, longest_block_seconds: float = 0.0, **kw: Any) -> Any:
    """An asyncio client for ``url`` (default ``cfg.url``) with deadlines."""
    import redis.asyncio as aioredis

    return aioredis.from_url(url or cfg.url, **{**timeouts(cfg, longest_block_seconds), **kw})


def with_user(url: str, user: str, password: str) -> str:
    """``url`` authenticating as ACL ``user`` with ``password`` (URL-safe, or a ``$(VAR)`` that Kubernetes expands;
    not escaped): each component connects as its own user (onlinerl.dataplane.acl)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{user}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``: for logs, banners and status lines."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
