"""``onlinerl config check|show``: validate a config the way every component does at start-up, and the way the CRD
and the operator do (the limits between fields of onlinerl.config_rules), or print it."""

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
    from onlinerl.config import ConfigError, load_config
    from onlinerl.config_rules import refusals

    cfg = load_config(args.config)
    problems = refusals(cfg.dump(), cluster=_is_job_manifest(args.config))
    if problems:
        raise ConfigError("invalid onlinerl configuration:\n  " + "\n  ".join(problems))
    print("configuration is valid")
    return 0


def _is_job_manifest(path: str | None) -> bool:
    """An OnlineRLJob manifest runs on Kubernetes: the check then applies the cluster's rules too (auth.apiKeysSecret),
    as the CRD does. A plain config file is also what `make run` takes, where those do not apply."""
    import os
    from pathlib import Path

    from onlinerl.config import CONFIG_ENV

    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return False
    documents = yaml.safe_load_all(Path(path).read_text())  # load_config read it already: it exists and parses
    return any(isinstance(d, dict) and d.get("kind") == "OnlineRLJob" for d in documents)


def _show(args: argparse.Namespace) -> int:
    from onlinerl.config import load_config

    cfg = load_config(args.config)
    if args.local:
        from onlinerl.profiles import with_local_profile

        cfg = with_local_profile(cfg)
    print(yaml.safe_dump(cfg.dump(), sort_keys=False), end="")
    return 0
