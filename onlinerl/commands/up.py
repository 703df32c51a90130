"""``onlinerl up``: start the whole loop locally (what `make run` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from onlinerl import ports
from onlinerl.loop.local import DEFAULT_STATE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start valkey, vLLM, gateway, reloader, feedback and trainer locally")
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help="state directory (default: .onlinerl)")
    p.add_argument(
        "--host",
        default=ports.LOOPBACK,
        help="address the gateway, feedback, trainer metrics, reloader and rollout ports listen on (default: "
        "%(default)s, this machine only; 0.0.0.0 opens them to the network, with a warning). valkey and vLLM always "
        "stay on 127.0.0.1",
    )
    # ports of the processes whose port is not in the job config: a second stack on the same machine needs its own
    p.add_argument("--redis-port", type=int, default=16379, help="embedded valkey (default: 16379)")
    p.add_argument(
        "--reloader-port", type=int, default=ports.RELOADER, help="reloader health and metrics (default: %(default)s)"
    )
    p.add_argument(
        "--rollout-port", type=int, default=ports.ROLLOUT, help="rollout controller health (default: %(default)s)"
    )
    p.add_argument(
        "--serving-replicas",
        type=int,
        default=None,
        help="serving replicas (vLLM + gateway + reloader each) behind the one gateway port (default: serving.replicas"
        " of the config, 1)",
    )
    p.add_argument(
        "--replica-base-port",
        type=int,
        default=ports.REPLICA_BASE,
        help="with 2+ replicas, replica i listens on BASE+10i (gateway), +1 (vLLM), +2 (reloader); "
        "default: %(default)s",
    )
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    import os

    from onlinerl.config import load_config
    from onlinerl.loop.stack import (
        LocalPorts,
        banner,
        check_ports,
        exposure_warning,
        run_forever,
        say,
        start_stack,
        with_serving_replicas,
    )
    from onlinerl.portcheck import STATE_ENV
    from onlinerl.profiles import with_local_profile

    loaded = load_config(args.config)
    local = LocalPorts(
        redis=args.redis_port,
        reloader=args.reloader_port,
        rollout=args.rollout_port,
        replica_base=args.replica_base_port,
    )
    n = args.serving_replicas
    # every port first, before anything starts or writes (a busy one: one line, exit 2, the other stack untouched)
    check_ports(loaded if n is None else with_serving_replicas(loaded, n), local, args.host)
    cfg = with_local_profile(loaded)
    if n is not None:
        cfg = with_serving_replicas(cfg, n)
    warning = exposure_warning(cfg, local, args.host)
    if warning:
        say(f"WARNING: {warning}")
    os.environ[STATE_ENV] = str(args.state.resolve())  # valkey inherits it: a second `up` can name this stack
    try:
        stack = start_stack(cfg, args.state, ports=local, host=args.host)
    except KeyboardInterrupt:
        return 130
    print(banner(stack), flush=True)
    return run_forever(stack)
