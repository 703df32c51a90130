"""``onlinerl status``: live figures of the running loop (policy versions, accept rates, the canary's and the eval
gate's figures with their guardrails, the last rollout verdict and its reason, backlog, trainer)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from onlinerl.loop.local import DEFAULT_STATE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="live figures: versions, accept rates, canary and gate figures, last verdict, backlog, trainer"
    )
    p.add_argument("--state", type=Path, default=DEFAULT_STATE)
    p.add_argument("--watch", type=float, default=None, help="refresh every N seconds")
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    import redis

    from onlinerl.errors import CommandError
    from onlinerl.loop.local import local_config
    from onlinerl.loop.status import collect, render
    from onlinerl.redisconn import connect as redis_connect
    from onlinerl.redisconn import redacted

    cfg = local_config(args.state, args.config)
    r = redis_connect(cfg.redis)
    try:
        while True:
            try:
                text = render(collect(r, cfg.job, cfg.projects.listed))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise CommandError(
                    f"cannot reach Redis at {redacted(cfg.redis.url)}: {exc} (is the stack running?)"
                ) from None
            if args.watch:
                print("\033[2J\033[H" + text, flush=True)
                time.sleep(args.watch)
            else:
                print(text)
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()
