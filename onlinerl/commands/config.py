"""``onlinerl config check|show``: validate a config the way every component does at start-up."""

from __future__ import annotations

import argparse

import yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate or print the effective configuration")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    csub.add_parser("check", help="validate (file + ONLINERL__* variables)").set_defaults(func=_check)
    csub.add_parser("show", help="print the effective configuration as YAML").set_defaults(func=_show)


def _check(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config

    load_config(args.config)
    print("configuration is valid")
    return 0


def _show(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config

    print(yaml.safe_dump(load_config(args.config).dump(), sort_keys=False), end="")
    return 0
