"""``onlinerl up``: start the whole loop locally (what `make run` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from onlinerl.loop.local import DEFAULT_STATE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start valkey, vLLM, gateway, reloader, feedback and trainer locally")
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help="state directory (default: .onlinerl)")
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config
    from onlinerl.loop.stack import banner, run_forever, start_stack

    cfg = load_config(args.config)
    try:
        stack = start_stack(cfg, args.state)
    except KeyboardInterrupt:
        return 130
    print(banner(stack), flush=True)
    return run_forever(stack)
