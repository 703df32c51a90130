"""`onlinerl simulate`'s users take turns over the connections, each with its own client (its own key): every arm gets
the share of users the routing gives it, and no user is ever in two requests at once. Stub clients stand in for the
HTTP (the whole path runs through the real stack in test_kill9.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from onlinerl.data.builder import FimSample
from onlinerl.fim import get_template
from onlinerl.loop.continue_client import CompletionResult, UploadResult
from onlinerl.loop.simulate import SimulateOptions, simulate

SAMPLE = FimSample("s1", "line", "f.py", 1, 1, "def add(a, b):\n    return ", "a + b", "\n")


@dataclass
class StubClient:
    uid: int
    busy: set[int]
    log: list[int]
    overlaps: list[int]
    template: object = field(default_factory=lambda: get_template("plain"))

    async def complete(self, http, prompt: str) -> CompletionResult:
        if self.uid in self.busy:
            self.overlaps.append(self.uid)
        self.busy.add(self.uid)
        self.log.append(self.uid)
        await asyncio.sleep(0.001 * (self.uid % 3))
        self.busy.discard(self.uid)
        return CompletionResult(text="a + b", status=200, version=0, arm="stable", latency_ms=1.0)

    def outcome(self, **kw) -> dict:
        return {"user": self.uid, **kw}

    async def upload(self, http, body: dict) -> UploadResult:
        return UploadResult(200, {"status": "accepted"})


def test_users_take_turns_over_the_connections_each_with_its_own_client() -> None:
    busy: set[int] = set()
    log: list[int] = []
    overlaps: list[int] = []
    made: list[int] = []

    def factory(uid: int) -> StubClient:
        made.append(uid)
        return StubClient(uid, busy, log, overlaps)

    opts = SimulateOptions(requests=99, concurrency=3, users=33, accept_delay_s=0, reject_window_s=0)
    totals = asyncio.run(simulate([SAMPLE], factory, opts, None, progress=False))
    assert made == list(range(33)) and totals.requests == 99 and totals.failed == 0
    turns = [log.count(uid) for uid in range(33)]
    assert min(turns) >= 2 and max(turns) <= 4, turns  # every user takes turns (the next idle one goes next)
    assert overlaps == []  # never two requests of one user at once
    assert totals.feedback_ok == totals.shown == 99


def test_fewer_users_than_connections_means_one_user_per_connection() -> None:
    made: list[int] = []
    log: list[int] = []

    def factory(uid: int) -> StubClient:
        made.append(uid)
        return StubClient(uid, set(), log, [])

    totals = asyncio.run(simulate([SAMPLE], factory, SimulateOptions(requests=8, concurrency=4, users=1), None, False))
    assert made == [0, 1, 2, 3] and totals.requests == 8
