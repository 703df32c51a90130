"""Simulated users behind the real policy table: what the gateway and feedback would write to the stats counters.

Each request comes from one of ``users`` users; the user is routed like the gateway does it (deterministic per user:
candidate when hash(user) < canary_share, pinned overrides), the served version's *true* show and accept rates
decide the outcome, and the counters ``stats:v{N}:{arm}`` get ``served`` (gateway) and ``shown/accepted/rejected/
empty/shown_chars/accepted_chars`` (feedback) under the shared arm names (``onlinerl.arms``). Outcomes come from a
seeded RNG: runs are reproducible. tests/rollout/test_e2e_real.py takes the same decisions with no simulator at all.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field

import redis

from onlinerl.arms import CANDIDATE, PINNED, STABLE
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable, PolicyVersionState


def user_fraction(user: str) -> float:
    return int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big") / 2**64


@dataclass
class Truth:
    accept_rate: float
    show_rate: float = 1.0
    length: int = 40  # characters of every shown suggestion


@dataclass
class ArmSimulator:
    r: redis.Redis
    job: str
    truth: dict[int, Truth]
    seed: int = 0
    users: int = 5000
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.keys = Keys(self.job)

    def route(self, table: PolicyTable, user: str) -> tuple[int, str]:
        if table.pinned is not None:
            return table.pinned, PINNED
        if table.candidate is not None and user_fraction(user) < table.canary_share:
            return table.candidate, CANDIDATE
        return table.stable, STABLE

    def serve(self, requests: int) -> Counter:
        """Serve ``requests`` simulated completions against the live table; returns requests per (version, arm)."""
        table = PolicyTable.from_redis(self.r.hgetall(self.keys.policy))
        counts: dict[tuple[int, str], Counter] = {}
        for _ in range(requests):
            version, arm = self.route(table, f"user-{self.rng.randrange(self.users)}")
            truth = self.truth[version]
            c = counts.setdefault((version, arm), Counter())
            c["served"] += 1
            if self.rng.random() >= truth.show_rate:
                c["empty"] += 1
                continue
            c["shown"] += 1
            c["shown_chars"] += truth.length
            if self.rng.random() < truth.accept_rate:
                c["accepted"] += 1
                c["accepted_chars"] += truth.length
            else:
                c["rejected"] += 1
        pipe = self.r.pipeline(transaction=False)
        for (version, arm), c in counts.items():
            for name, n in c.items():
                pipe.hincrby(self.keys.stats(version, arm), name, n)
        pipe.execute()
        return Counter({k: c["served"] for k, c in counts.items()})


def publish_loaded(r: redis.Redis, job: str, version: int) -> None:
    """What the reloader of the one serving replica (``sim-0``) writes once it has loaded ``version``."""
    from onlinerl.dataplane import versions

    state = PolicyVersionState(version=version, state="loaded", served_model=f"{job}-v{version}")
    versions.report(r, Keys(job), "sim-0", [state], ttl=3600)
