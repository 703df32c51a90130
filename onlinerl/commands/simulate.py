"""``onlinerl simulate``: simulated Continue users against a running stack."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from onlinerl.loop.local import DEFAULT_STATE

if TYPE_CHECKING:
    from onlinerl.loop.user_model import AcceptRule


def add_client_args(p: argparse.ArgumentParser, split: str = "train") -> None:
    p.add_argument("--state", type=Path, default=DEFAULT_STATE)
    p.add_argument("--api-base", default=None, help="default: the local gateway, http://127.0.0.1:<port>/v1")
    p.add_argument("--api-key", default=None, help="default: the local demo key")
    p.add_argument(
        "--tenant",
        default=None,
        help="use the local keys of this project (one of projects.listed; default: the demo project)",
    )
    p.add_argument("--template", default=None, help="FIM template (default: the model's, auto-detected)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"JSONL split, or a directory from `onlinerl data build --out` (uses its {split}.jsonl; "
        f"default: <state>/data/{split}.jsonl)",
    )
    p.add_argument("--limit", type=int, default=None, help="use N samples of the split (a fixed random subset)")
    p.add_argument(
        "--max-prefix-chars",
        type=int,
        default=1200,
        help="keep this many characters before the cursor (Continue's maxPromptTokens, in chars)",
    )
    # The simulated user's Tab rule (onlinerl/loop/user_model.py): simulate decides by it, eval judges by it, so a
    # project whose users Tab differently is evaluated by the users it trained on.
    p.add_argument(
        "--min-prefix-chars",
        type=int,
        default=4,
        help="a correct prefix of the middle is accepted from this many characters (or when it is the whole middle)",
    )
    p.add_argument("--min-similarity", type=float, default=0.8, help="or when this similar to the middle's first line")
    habit = p.add_mutually_exclusive_group()
    habit.add_argument(
        "--single-line", action="store_true", help="the users dismiss every multi-line suggestion (they Tab a line)"
    )
    habit.add_argument(
        "--whole-blocks",
        action="store_true",
        help="the users dismiss every single-line suggestion and Tab a block whose first line is right",
    )


def accept_rule(args: argparse.Namespace) -> AcceptRule:
    """The simulated users' Tab rule from the client arguments (``add_client_args``)."""
    from onlinerl.loop.user_model import AcceptRule

    return AcceptRule(args.min_prefix_chars, args.min_similarity, args.single_line, args.whole_blocks)


DEFAULT_REQUESTS = 100


def requests_cap(requests: int | None, duration: float | None) -> int:
    """How many requests a run makes at most: ``--requests`` if given, else 100, or no limit when ``--duration`` is
    given. Before, ``--duration 600`` alone stopped after the default 100 requests, a minute or so into the run."""
    if requests is not None:
        return requests
    return sys.maxsize if duration else DEFAULT_REQUESTS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="drive the stack with simulated Continue users")
    add_client_args(p)
    p.add_argument("--tracking-url", default=None, help="default: the local feedback service")
    p.add_argument("--project", default=None, help="X-Project-ID (default: the local demo project)")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"stop after N requests (default {DEFAULT_REQUESTS}; with --duration, no limit: the time ends it)",
    )
    p.add_argument(
        "--users",
        type=int,
        default=None,
        help="distinct simulated users, each with its own key, taking turns over the --concurrency connections "
        "(default: one per demo user key, 33; routing is by key, so a canary needs many users to get its share)",
    )
    p.add_argument(
        "--duration", type=float, default=None, help="stop after this many seconds (Ctrl-C also ends it, with totals)"
    )
    p.add_argument(
        "--reject-window", type=float, default=10.0, help="seconds before a reject is reported (Continue: 10)"
    )
    p.add_argument("--accept-delay", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", type=Path, default=None, help="JSONL timeline (default: <state>/timeline.jsonl)")
    p.set_defaults(func=_simulate)


def make_client_factory(args: argparse.Namespace, split: str):
    from onlinerl.data.builder import read_jsonl, resolve_split
    from onlinerl.loop.continue_client import ContinueClient
    from onlinerl.loop.local import local_api_key, local_config, local_user_keys, template_for

    cfg = local_config(args.state, args.config)
    tenant = getattr(args, "tenant", None)
    key, project = local_api_key(args.state, args.api_key, "eval" if split == "test" else "user", tenant)  # eval pins
    # simulated users each have their own key (routing is by key); the evaluation pins with its one eval key
    keys = local_user_keys(args.state, args.api_key, tenant) if split == "train" else [key]
    project = getattr(args, "project", None) or project
    template = template_for(cfg, args.template)
    api_base = args.api_base or f"http://127.0.0.1:{cfg.serving.port}/v1"
    tracking = getattr(args, "tracking_url", None) or f"http://127.0.0.1:{cfg.feedback.port}/api/training/submit"
    data = resolve_split(args.data or args.state / "data", split)
    if not data.is_file():
        from onlinerl.errors import CommandError

        raise CommandError(f"{data} not found: run `onlinerl data build --out {data.parent}`")
    samples = read_jsonl(data)
    if args.limit:  # a seeded random subset: the splits are ordered by file
        import random

        random.Random(0).shuffle(samples)
        samples = samples[: args.limit]

    def factory(uid: int) -> ContinueClient:
        return ContinueClient(
            api_base,
            tracking,
            keys[uid % len(keys)],
            project,
            cfg.model.served_name,
            template,
            max_tokens=args.max_tokens,
            unique_id=f"sim-user-{uid:04d}",
        )

    return cfg, samples, factory


def _simulate(args: argparse.Namespace) -> int:
    from onlinerl.loop.local import local_user_keys
    from onlinerl.loop.simulate import SimulateOptions, simulate

    _, samples, factory = make_client_factory(args, "train")
    users = args.users or len(local_user_keys(args.state, args.api_key))
    opts = SimulateOptions(
        requests=requests_cap(args.requests, args.duration),
        concurrency=args.concurrency,
        users=max(users, args.concurrency),
        accept_delay_s=args.accept_delay,
        reject_window_s=args.reject_window,
        seed=args.seed,
        duration_s=args.duration,
        max_prefix_chars=args.max_prefix_chars,
        rule=accept_rule(args),
    )
    timeline = args.timeline or args.state / "timeline.jsonl"
    totals = asyncio.run(_until_signalled(simulate, samples, factory, opts, timeline))
    print(totals.line())
    print(f"feedback: {totals.feedback_ok} acknowledged, {totals.feedback_other} not; timeline: {timeline}")
    return 0 if totals.failed == 0 else 1


async def _until_signalled(simulate, *args):
    """Run the simulation; SIGINT or SIGTERM ends it cleanly (no new request, those in flight and their uploads
    finish, the summary is printed), so a run stopped early still reports exact totals."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await simulate(*args, stop=stop)
