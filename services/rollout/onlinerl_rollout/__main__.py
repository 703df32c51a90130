"""``python -m onlinerl_rollout``: the rollout controller as a process, with ``/metrics`` and ``/healthz``.

The eval gate needs an evaluator: ``--evaluator module:function`` (or ``$ONLINERL_ROLLOUT_EVALUATOR``), a callable
``EvalRequest -> GateInput``. Without one, start-up fails unless ``rollout.gate.enabled`` is false.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time

from prometheus_client import generate_latest

from onlinerl import ports
from onlinerl.config import ConfigError, load_config
from onlinerl.httpserve import MetricsHTTPServer
from onlinerl.redisconn import connect as redis_connect
from onlinerl_rollout.controller import Evaluator
from onlinerl_rollout.lines import LinesController

DEFAULT_PORT = ports.ROLLOUT


def load_evaluator(spec: str) -> Evaluator:
    module, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"--evaluator must be module:function, got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def serve_http(controller: LinesController, port: int, interval: float) -> MetricsHTTPServer:
    """``/metrics`` (Prometheus) and ``/healthz`` (200 while ticks reach Redis or an eval runs, else 503)."""

    def health() -> tuple[bool, str]:
        last = controller.last_tick_ok
        healthy = controller.evaluating is not None or (last is not None and time.monotonic() - last < 3 * interval + 5)
        return healthy, "ok" if healthy else "no successful tick recently"

    return MetricsHTTPServer(
        lambda: generate_latest(controller.metrics.registry), ports.listen_host(), port, health, name="rollout-http"
    ).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onlinerl_rollout", description=__doc__)
    ap.add_argument("--config", "-c", default=None)
    ap.add_argument("--evaluator", default=os.environ.get("ONLINERL_ROLLOUT_EVALUATOR", ""))
    ap.add_argument("--port", type=int, default=int(os.environ.get("ONLINERL_ROLLOUT_PORT", DEFAULT_PORT)))
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between ticks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
        if not cfg.redis.url:
            raise ConfigError("redis.url: the rollout controller needs the job's Redis (set redis.url)")
        evaluator = load_evaluator(args.evaluator) if args.evaluator else None
        r = redis_connect(cfg.redis)
        controller = LinesController(r, cfg.job, cfg.rollout, cfg.projects, evaluator)
    except (ConfigError, ValueError, ImportError, AttributeError) as exc:
        print(f"onlinerl_rollout: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = serve_http(controller, args.port, args.interval)
    logging.getLogger("onlinerl_rollout").info(
        "rollout controller for job %s (strategy %s, project lines: %s) on :%d",
        cfg.job,
        cfg.rollout.strategy,
        cfg.projects.adapters,
        args.port,
    )
    try:
        controller.run(stop, args.interval)
    finally:
        server.stop()
        r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
