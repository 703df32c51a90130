"""`python -m onlinerl_operator`: run the OnlineRLJob operator (standalone: one replica, Recreate strategy).

Namespaces: `ONLINERL_OPERATOR_NAMESPACES` (comma-separated; empty = cluster-wide). Observe interval:
`ONLINERL_OPERATOR_INTERVAL` seconds (default 10).
"""

from __future__ import annotations

import logging
import os

import kopf

from onlinerl_operator import constants as c
from onlinerl_operator.handlers import build_registry


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("ONLINERL_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    namespaces = [n.strip() for n in os.environ.get("ONLINERL_OPERATOR_NAMESPACES", "").split(",") if n.strip()]
    interval = float(os.environ.get("ONLINERL_OPERATOR_INTERVAL", "10"))
    kopf.run(
        registry=build_registry(interval=interval, health_port=c.OPERATOR_PORT),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )


if __name__ == "__main__":
    main()
