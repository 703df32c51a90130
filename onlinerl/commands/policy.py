"""``onlinerl policy [--project P] show|pin|unpin|rollback|pause|resume``: act on the live policy table in Redis (the
shared policy's, or project P's own line's only: issue 39)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="show or steer the live rollout (pin, rollback, pause)")
    p.add_argument("--redis-url", default=None, help="default: redis.url of the config")
    p.add_argument("--job", default=None, help="default: job of the config")
    p.add_argument(
        "--project",
        default="",
        metavar="P",
        help="act on project P's own policy line only (its own adapter: projects.adapters listed or all); "
        "default: the shared policy. Every other line is left as it is",
    )
    p.add_argument(
        "--state",
        type=Path,
        default=None,
        help="state directory of a local stack (`make run`, `onlinerl up`): act on its Redis and job (default: "
        ".onlinerl when it holds a running stack's config and neither --config nor $ONLINERL_CONFIG is given)",
    )
    psub = p.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    psub.add_parser("show", help="policy table, versions, verdicts and the latest decisions (JSON)").set_defaults(
        func=_show
    )
    pin = psub.add_parser(
        "pin",
        help="serve every user version N (0 = base model); holds stable where it is until resume (no gate, canary, "
        "promotion or direct raise meanwhile)",
    )
    pin.add_argument("version", type=int)
    pin.add_argument("--force", action="store_true", help="pin even if serving has not loaded N")
    pin.set_defaults(func=_pin)
    psub.add_parser("unpin", help="back to stable/candidate routing (a hold stays until resume)").set_defaults(
        func=_unpin
    )
    rb = psub.add_parser(
        "rollback",
        help="end the canary, or make N (default: the previous stable) stable. It sticks until resume under every "
        "strategy: no version is gated, canaried, promoted or raised (direct), across reloads and restarts; "
        "the trainer rebases onto N's weights before it trains again (the next version's manifest: parent_version "
        "N, rebased_from the version it dropped)",
    )
    rb.add_argument("version", type=int, nargs="?", default=None)
    rb.add_argument("--force", action="store_true", help="roll back even if serving has not loaded N")
    rb.set_defaults(func=_rollback)
    psub.add_parser("pause", help="stop promotions and new candidates (rollbacks still happen)").set_defaults(
        func=_pause
    )
    psub.add_parser(
        "resume",
        help="allow promotions again, and release the hold of the last rollback/pin: the newest version is gated "
        "next (the trainer's rebase stays)",
    ).set_defaults(func=_resume)


def _config(args: argparse.Namespace):
    """``--config``, else the state directory's config (``--state``, or ``.onlinerl`` left by `make run`), else
    ``$ONLINERL_CONFIG`` and the defaults: after `make run`, `onlinerl policy show` acts on that stack."""
    import os

    from onlinerl.config import CONFIG_ENV, load_config
    from onlinerl.loop.local import DEFAULT_STATE, local_config
    from onlinerl.loop.stack import StackPaths

    state = args.state
    if (
        state is None
        and not args.config
        and not os.environ.get(CONFIG_ENV)
        and StackPaths(DEFAULT_STATE).config.is_file()
    ):
        state = DEFAULT_STATE
    return load_config(args.config) if state is None else local_config(state, args.config)


def _store(args: argparse.Namespace):
    from onlinerl.rollout.manual import connect

    cfg = _config(args)
    url = args.redis_url if args.redis_url is not None else cfg.redis.url
    project = args.project or ""
    return connect(url, args.job or cfg.job, project, listed=bool(project) and cfg.projects.has_own_line(project))


def _actor() -> str:
    """Who acts, as recorded in the decision and the hold (`onlinerl status` shows it): ``cli:<login name>``."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return "cli"


def _print_decision(rec) -> int:
    print(f"{rec.decision}: {rec.reason}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import show

    print(json.dumps(show(_store(args)), indent=2, default=str))
    return 0


def _pin(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import pin

    return _print_decision(pin(_store(args), args.version, force=args.force, actor=_actor()))


def _unpin(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import pin

    return _print_decision(pin(_store(args), None, actor=_actor()))


def _rollback(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import rollback

    return _print_decision(rollback(_store(args), args.version, force=args.force, actor=_actor()))


def _pause(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import set_paused

    return _print_decision(set_paused(_store(args), True, actor=_actor()))


def _resume(args: argparse.Namespace) -> int:
    from onlinerl.rollout.manual import set_paused

    return _print_decision(set_paused(_store(args), False, actor=_actor()))
