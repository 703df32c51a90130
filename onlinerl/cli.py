"""The ``onlinerl`` command: a thin dispatcher. Each command group lives in its own module with ``register()``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Command modules, each exposing ``register(subparsers)``; they import their heavy dependencies lazily.
COMMAND_MODULES = [
    "onlinerl.commands.model",
    "onlinerl.commands.data",
    "onlinerl.commands.config",
    "onlinerl.commands.up",
    "onlinerl.commands.status",
    "onlinerl.commands.simulate",
    "onlinerl.commands.policy",
    "onlinerl.commands.eval",
    "onlinerl.commands.forget",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onlinerl", description="Online RL for code completion.")
    parser.add_argument("--config", "-c", default=None, help="YAML config file (default: $ONLINERL_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # user-facing errors: one clear line, not a traceback
        from onlinerl.errors import UserError

        if isinstance(exc, UserError):
            print(f"onlinerl: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
