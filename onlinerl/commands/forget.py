"""``onlinerl forget --tenant T [--user KEY | --user-hash H]``: delete a tenant's or a user's data from the data plane
and report what was deleted and which published versions learned from it (onlinerl/forget.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "forget",
        help="delete a tenant's or one user's rollout records, pending samples, audit entries and per-user counters; "
        "report the counts and the published versions trained on their samples (run it as the admin Redis user)",
    )
    p.add_argument("--tenant", required=True, help="the tenant (as in the keys file)")
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--user",
        default=None,
        metavar="API_KEY",
        help="one user: the API key the user was given (never printed or stored; its hashes find the data)",
    )
    who.add_argument(
        "--user-hash",
        default=None,
        help="one user by its user hash (a rollout record's user_hash) when the key is not known: contribution "
        "counters and the quarantine mark, kept by key id, are then left",
    )
    p.add_argument("--redis-url", default=None, help="default: redis.url of the config (it must be the admin user's)")
    p.add_argument("--job", default=None, help="default: job of the config")
    p.add_argument(
        "--state",
        type=Path,
        default=None,
        help="state directory of a local stack (`onlinerl up`): act on its Redis and job (default: .onlinerl when "
        "it holds a running stack's config and neither --config nor $ONLINERL_CONFIG is given)",
    )
    p.set_defaults(func=_forget)


def _forget(args: argparse.Namespace) -> int:
    from onlinerl.commands.policy import _config
    from onlinerl.errors import CommandError
    from onlinerl.forget import Who, forget
    from onlinerl.keys import Keys, tenant_problem
    from onlinerl.redisconn import connect

    if tenant_problem(args.tenant) is not None:
        raise CommandError(f"--tenant {args.tenant!r}: {tenant_problem(args.tenant)}")
    cfg = _config(args)
    url = args.redis_url if args.redis_url is not None else cfg.redis.url
    if not url:
        raise CommandError("no Redis to act on: pass --redis-url (the admin user's), or --state DIR of a local stack")
    who = Who.of_key(args.tenant, args.user) if args.user is not None else Who(args.tenant, args.user_hash or None)
    client = connect(cfg.redis, url)
    try:
        report = forget(client, Keys(args.job or cfg.job), who)
    finally:
        client.close()
    print(json.dumps(report.as_dict(), indent=2))
    versions = report.trained_versions + report.descendant_versions
    if versions:
        print(
            f"versions trained on this data: {', '.join(f'v{v}' for v in versions)} "
            "(roll back past them with `onlinerl policy rollback N` if they must not be served)"
        )
    own = report.own_line_trained_versions + report.own_line_descendant_versions
    if own:
        print(
            f"versions of project {args.tenant}'s own adapter line trained on this data: "
            f"{', '.join(f'v{v}' for v in own)} (`onlinerl policy --project {args.tenant} rollback N`)"
        )
    if report.samples_already_read_by_trainer:
        print(
            f"{report.samples_already_read_by_trainer} deleted sample(s) had already been read by the trainer: its "
            "next version may still be trained on them; run forget again after it to see it in the lineage"
        )
    return 0
