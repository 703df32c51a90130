"""``onlinerl config check|show``: validate a config the way every component does at start-up."""

from __future__ import annotations

import argparse

import yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate or print the effective configuration")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    csub.add_parser("check", help="validate (file + ONLINERL__* variables)").set_defaults(func=_check)
    show = csub.add_parser("show", help="print the effective configuration as YAML")
    show.add_argument("--local", action="store_true", help="as `onlinerl up` runs it, hardware profile applied")
    show.set_defaults(func=_show)


def _check(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config

    load_config(args.config)
    print("configuration is valid")
    return 0


def _show(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config

    cfg = load_config(args.config)
    if args.local:
        from onlinerl.profiles import with_local_profile

        cfg = with_local_profile(cfg)
    print(yaml.safe_dump(cfg.dump(), sort_keys=False), end="")
    return 0
