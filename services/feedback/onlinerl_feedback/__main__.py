"""``python -m onlinerl_feedback``: serve the feedback API on ``feedback.host:feedback.port``.

Configuration comes from ``onlinerl.config.load_config`` (``--config``/``$ONLINERL_CONFIG`` + ``ONLINERL__*``).
Redis is ``redis.url`` (``--redis-url`` overrides it); keys come from ``auth.apiKeysFile``; the tokenizer (for the
join's byte table) from ``model.path`` or the bootstrapped SmolLM2, and start-up fails without it.

With ``feedback.workers`` > 1 (or ``--workers``) uvicorn's supervisor runs that many processes on one shared socket.
Each worker rebuilds the app from the same command line (passed in ``$ONLINERL_FEEDBACK_ARGV``), and metrics switch
to Prometheus multiprocess mode in a directory made for this run (or ``$PROMETHEUS_MULTIPROC_DIR``, emptied first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from onlinerl.asgi import KEEP_ALIVE_SECONDS
from onlinerl.auth import AuthConfigError, KeyRing
from onlinerl.config import ConfigError, OnlineRLConfig, load_config
from onlinerl.model import ModelError, resolve_model_path
from onlinerl.tokens import TokenTable, TokenTableError, load_token_table

from .metrics import MULTIPROC_ENV  # read by prometheus_client at import: set before any worker starts

ARGV_ENV = "ONLINERL_FEEDBACK_ARGV"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onlinerl_feedback", description="Feedback ingest: Continue uploads -> samples.")
    p.add_argument("--config", "-c", default=None, help="YAML config (default: $ONLINERL_CONFIG)")
    p.add_argument("--redis-url", default=None, help="overrides redis.url")
    p.add_argument("--host", default=None, help="overrides feedback.host")
    p.add_argument("--port", type=int, default=None, help="overrides feedback.port")
    p.add_argument("--workers", type=int, default=None, help="overrides feedback.workers (server processes)")
    p.add_argument("--log-level", default="warning")
    return p


@dataclass(frozen=True)
class Settings:
    cfg: OnlineRLConfig
    keyring: KeyRing
    redis_url: str
    args: argparse.Namespace
    table: TokenTable

    @property
    def workers(self) -> int:
        return self.args.workers or self.cfg.feedback.workers


def load_settings(argv: list[str]) -> Settings:
    """Config, keys and Redis URL from the command line; ConfigError/AuthConfigError say what to fix."""
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config)
    redis_url = args.redis_url or cfg.redis.url
    if not redis_url:
        raise ConfigError("redis.url is empty: set it (or pass --redis-url); `onlinerl up` fills it in locally")
    if args.workers is not None and not 1 <= args.workers <= 64:
        raise ConfigError(f"--workers must be between 1 and 64, got {args.workers}")
    if cfg.auth.api_keys_file:
        keyring = KeyRing.from_file(cfg.auth.api_keys_file, cfg.auth.allow_anonymous)
    elif cfg.auth.allow_anonymous:
        keyring = KeyRing(allow_anonymous=True)
    else:
        raise ConfigError("auth.apiKeysFile is empty and auth.allowAnonymous is false: nobody could submit")
    return Settings(cfg, keyring, redis_url, args, token_table(cfg))


def token_table(cfg: OnlineRLConfig) -> TokenTable:
    """The served model's token byte table, which the join cuts samples with: without it no start, since a guessed
    cut would train on tokens the user never saw."""
    try:
        return load_token_table(resolve_model_path(cfg.model.path))
    except (ModelError, TokenTableError) as exc:
        raise ConfigError(f"model.path: cannot load the tokenizer the feedback join needs: {exc}") from None


def worker_app():
    """uvicorn's factory in each worker process: the same settings the supervisor was started with."""
    from .app import create_app

    s = load_settings(json.loads(os.environ[ARGV_ENV]))
    return create_app(s.cfg, s.keyring, s.redis_url, s.table)


@contextmanager
def multiprocess_metrics_dir():
    """A fresh directory for the workers' metric files; an inherited one is emptied (stale files double-count)."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink()
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="onlinerl-feedback-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = load_settings(argv)
    except (ConfigError, AuthConfigError) as exc:
        print(f"onlinerl_feedback: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    common = dict(
        host=settings.args.host or settings.cfg.feedback.host,
        port=settings.args.port or settings.cfg.feedback.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.args.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,  # the client closes idle connections first (onlinerl.asgi)
    )
    if settings.workers == 1:
        from .app import create_app

        uvicorn.run(create_app(settings.cfg, settings.keyring, settings.redis_url, settings.table), **common)
        return 0
    os.environ[ARGV_ENV] = json.dumps(argv)
    with multiprocess_metrics_dir():
        uvicorn.run("onlinerl_feedback.__main__:worker_app", factory=True, workers=settings.workers, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
