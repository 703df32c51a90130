"""``python -m onlinerl_feedback``: serve the feedback API on ``feedback.host:feedback.port``.

Configuration comes from ``onlinerl.config.load_config`` (``--config``/``$ONLINERL_CONFIG`` + ``ONLINERL__*``).
Redis is ``redis.url`` (``--redis-url`` overrides it); keys come from ``auth.apiKeysFile``.
"""

from __future__ import annotations

import argparse
import sys

from onlinerl.auth import AuthConfigError, KeyRing
from onlinerl.config import ConfigError, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onlinerl_feedback", description="Feedback ingest: Continue uploads -> samples.")
    p.add_argument("--config", "-c", default=None, help="YAML config (default: $ONLINERL_CONFIG)")
    p.add_argument("--redis-url", default=None, help="overrides redis.url")
    p.add_argument("--host", default=None, help="overrides feedback.host")
    p.add_argument("--port", type=int, default=None, help="overrides feedback.port")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
        redis_url = args.redis_url or cfg.redis.url
        if not redis_url:
            raise ConfigError("redis.url is empty: set it (or pass --redis-url); `onlinerl up` fills it in locally")
        if cfg.auth.api_keys_file:
            keyring = KeyRing.from_file(cfg.auth.api_keys_file, cfg.auth.allow_anonymous)
        elif cfg.auth.allow_anonymous:
            keyring = KeyRing(allow_anonymous=True)
        else:
            raise ConfigError("auth.apiKeysFile is empty and auth.allowAnonymous is false: nobody could submit")
    except (ConfigError, AuthConfigError) as exc:
        print(f"onlinerl_feedback: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from .app import create_app

    app = create_app(cfg, keyring, redis_url)
    uvicorn.run(
        app,
        host=args.host or cfg.feedback.host,
        port=args.port or cfg.feedback.port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
