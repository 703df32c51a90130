"""Traffic arms: the one definition of the names the gateway labels a request with, the feedback service counts
under (``stats:v{N}:{arm}``), and the rollout controller, status and dashboards read back.

A mismatch between writer and reader silently stalls the canary (the controller waits for counts that go to another
key), so every component imports these names instead of spelling them. Version 0 (the base model) as stable is arm
``stable`` like any other stable version: the controller does not special-case the base model.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

Arm = Literal["stable", "candidate", "pinned", "eval"]
STABLE, CANDIDATE, PINNED, EVAL = get_args(Arm)  # the only place the names are spelled

ARMS: Final[tuple[Arm, ...]] = get_args(Arm)
LIVE_ARMS: Final[tuple[Arm, ...]] = (STABLE, CANDIDATE, PINNED)
"""Arms user traffic is routed to (``eval`` is an evaluation asking for a version explicitly)."""
