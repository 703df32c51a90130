"""Simulated users served through the product's own seams: what the gateway and feedback write to the arm counters.

Only the users and the model are simulated (the model writes each suggestion as one token). Each request comes from
one of ``users`` API keys; the rest is the product's code, called in process:

- routing: the gateway's ``route`` on the gateway's hash of the key, over the versions this replica has loaded (every
  version the simulator knows the truth of), so a user keeps its arm and the canary share is the product's split
  (a few-user canary split by request draws each request's point, as the gateway does, from its own seeded RNG);
- serving: the gateway's rollout writer (``RolloutStore.command``: the data plane's record script) stores each
  completion, counts it ``served`` under its arm and in its canary's per-user ledger;
- feedback: the user's outcome (the served version's *true* show and accept rates, from a seeded RNG: runs are
  reproducible) goes through the feedback service's ``decide`` and ``FeedbackStore.append`` (the data plane's
  append script: stats counters, per-user limits and quarantine), as ``POST /api/training/submit`` does; only its
  join read is left out (the record it would read is the one just written).

No counter is written here, so the controller tests check the controller against the contract the gateway and
feedback keep, not against a copy of it. tests/rollout/test_e2e_real.py takes the same decisions over real HTTP.
That costs about 0.2 ms of CPU per simulated request (this process and valkey together).
"""

from __future__ import annotations

import asyncio
import random
import weakref
from collections import Counter
from dataclasses import dataclass, field

import redis
from redis.asyncio import Redis as AsyncRedis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.config import FeedbackConfig, RedisConfig
from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome, PolicyTable, PolicyVersionState, RolloutRecord, SamplingParams
from onlinerl_feedback.decide import decide
from onlinerl_feedback.limits import user_of
from onlinerl_feedback.pipeliner import Pipeliner
from onlinerl_feedback.store import FeedbackStore
from onlinerl_serving.capture import RolloutStore
from onlinerl_serving.routing import route, served_model_name, user_hash

TENANT = "sim"
BASE = "sim-base"  # the served name of version 0 (the simulated replica's base model)
EMPTY = "\n"  # what a version that says nothing generates: whitespace, counted ``empty`` by feedback


@dataclass
class Truth:
    accept_rate: float
    show_rate: float = 1.0  # share of completions that are not empty (whitespace only)
    length: int = 40  # characters of every non-empty suggestion


@dataclass(frozen=True)
class _Request:
    user: int
    record: RolloutRecord
    accepted: bool


class _Wire:
    """The simulated gateway's and feedback service's connections, on one event loop that lives as long as the
    simulator (a test serves hundreds of batches: no reconnect per batch).

    ``LANES`` pipelined connections, as a gateway and a feedback service have several: a durable valkey reads about
    16 KB per connection and fsyncs once per pass, so a batch spread over several connections takes a few fsyncs,
    not one per 16 KB. A request's record and its outcome travel on the same lane, in that order."""

    LANES = 8

    def __init__(self, r: redis.Redis, keys: Keys, cfg: FeedbackConfig, line: str = "") -> None:
        kw = r.connection_pool.connection_kwargs
        self.runner = asyncio.Runner()
        self.client = AsyncRedis(**{k: kw[k] for k in ("host", "port", "db", "username", "password") if k in kw})
        ttl = RedisConfig().rollout_ttl_seconds
        # its record command and accounting, on the line that serves the tenant (issue 39)
        self.gateway = RolloutStore(self.client, keys.for_line(line), ttl, cfg.silence)
        self.lanes = [Pipeliner(self.client) for _ in range(self.LANES)]
        self.feedback = [FeedbackStore(p, p, keys, cfg.dedupe_ttl_seconds, ttl, cfg.limits) for p in self.lanes]

    async def _close(self) -> None:
        for lane in self.lanes:
            await lane.close()
        await self.gateway.close()
        await self.client.aclose()

    def close(self) -> None:
        self.runner.run(self._close())
        self.runner.close()


@dataclass
class ArmSimulator:
    r: redis.Redis
    job: str
    truth: dict[int, Truth]
    seed: int = 0
    users: int = 5000
    tenant: str = TENANT
    line: str = ""  # the policy line serving the tenant (issue 39): '' the shared policy, else the tenant's own
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.draws = random.Random(self.seed + 1)  # only a canary split by request draws (other runs stay as they were)
        self.keys = Keys(self.job)
        self.line_keys = self.keys.for_line(self.line)
        self.feedback = FeedbackConfig()
        self.served = 0  # requests so far: each gets its own prompt, so each outcome joins its own rollout
        self._wire = _Wire(self.r, self.keys, self.feedback, self.line)
        weakref.finalize(self, self._wire.close)

    def key(self, user: int) -> str:
        """User ``user``'s API key (its id is the key itself: what the per-user limits count)."""
        return f"sk-sim-{self.seed}-{user}"

    def _request(self, table: PolicyTable) -> _Request:
        user = self.rng.randrange(self.users)
        uhash = user_hash(self.key(user))
        r = route(table, uhash, self.truth, self.draws.random() if table.split == "request" else 0.0)
        truth = self.truth[r.version]
        shown = self.rng.random() < truth.show_rate
        accepted = shown and self.rng.random() < truth.accept_rate
        text = f"{r.version}".ljust(truth.length, "x") if shown else EMPTY
        self.served += 1
        record = RolloutRecord(
            rollout_id=f"sim-{self.seed}-{self.served}",
            tenant=self.tenant,
            arm=r.arm,
            policy_version=r.version,
            line=self.line,
            served_model=served_model_name(self.job, BASE, r.version),
            user_hash=uhash,
            prompt=f"# request {self.served}\n",
            prompt_token_ids=[1],
            completion=text,
            completion_token_ids=[2],  # the simulated model writes each suggestion as one token
            behaviour_logprobs=[-1.0],
            sampling=SamplingParams(temperature=1.0),
            # as the gateway records it: the canary a stable- or candidate-arm rollout was routed under
            canary=table.candidate if r.arm in (STABLE, CANDIDATE) else None,
        )
        return _Request(user, record, accepted)

    def serve(self, requests: int) -> Counter:
        """Serve ``requests`` simulated completions against the live table and rate each one through feedback;
        returns requests per (version, arm)."""
        table = PolicyTable.from_redis(self.r.hgetall(self.line_keys.policy))
        batch = [self._request(table) for _ in range(requests)]
        for i in range(0, len(batch), 1000):  # within the feedback pipeliner's queue bound
            self._wire.runner.run(self._serve(batch[i : i + 1000]))
        return Counter((q.record.policy_version, q.record.arm) for q in batch)

    async def _serve(self, batch: list[_Request]) -> None:
        w = self._wire
        for lane in w.lanes:
            lane.start()
        # The gateway's record writes, then the outcomes' appends, queued in that order: Redis applies each record
        # before the outcome that rates it (as in the product, where a record is applied before the client has the
        # completion, and acknowledged after).
        records = [
            asyncio.ensure_future(w.lanes[n % w.LANES].call(*w.gateway.command(q.record))) for n, q in enumerate(batch)
        ]
        rated = [asyncio.ensure_future(self._rate(w.feedback[n % w.LANES], q)) for n, q in enumerate(batch)]
        for reply in await asyncio.gather(*records):
            w.gateway.acknowledged(self.tenant, reply)
        await asyncio.gather(*rated)

    async def _rate(self, feedback: FeedbackStore, q: _Request) -> None:
        """The user's outcome upload, as the feedback service handles ``POST /api/training/submit`` (its join read left
        out: the record it would read is the one just written)."""
        rec = q.record
        event = CompletionOutcome(
            completionId=f"{rec.rollout_id}-outcome", accepted=q.accepted, completion=rec.completion, prompt=rec.prompt
        )
        decision = decide(event, self.tenant, rec.prompt, [rec], self.feedback)
        result = await feedback.append(event, self.tenant, rec.prompt, decision, user_of(self.key(q.user)))
        assert result.new and not result.limited, result  # every simulated outcome counts once


def publish_loaded(r: redis.Redis, job: str, version: int, line: str = "") -> None:
    """What the reloader of the one serving replica (``sim-0``) writes once it has loaded ``version`` (of ``line``)."""
    from onlinerl.dataplane import versions
    from onlinerl.lines import adapter_name

    state = PolicyVersionState(version=version, state="loaded", served_model=adapter_name(job, version, line))
    versions.report(r, Keys(job).for_line(line), "sim-0", [state], ttl=3600)
