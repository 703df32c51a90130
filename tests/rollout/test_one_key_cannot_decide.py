"""One API key cannot decide a canary look (issue 35), written as the attack.

Real valkey, the real feedback service (own process, over HTTP), rollout records stored by the gateway's own record
script (``rollouts.record_command``) for keys routed by the gateway's own ``route``, and the real rollout controller
(``RolloutController.tick``: its per-user cap, its one-user check and its decision code). Honest users rate both arms
alike (3 of 10 accepted each); one more key, on one arm, rejects or accepts everything it is shown. On the arm
counters alone the controller's own decision function would let that key decide the first look (rollback or
promote); through the per-user ledgers it holds. The quarantine is off here (``anomalyK: 0``) so the controller's
own defence is what is measured; tests/feedback/test_hostile_ratings.py shows the quarantine.

``rollout.fewUsers: decide`` (the local stack's default, issue 36) judges a canary of fewer than 1 / maxUserShare users
on pooled counts; the last two tests run attacks under it: a crowd with one attacker in it keeps every per-user rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.dataplane.rollouts import record_command
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats
from onlinerl.schemas import PolicyTable
from onlinerl_rollout.controller import RolloutController
from onlinerl_rollout.decision import decide_canary
from onlinerl_serving.routing import route, user_hash
from tests.feedback.conftest import JOB, FeedbackServer, event, start_feedback
from tests.feedback.rollouts import make_rollout
from tests.rollout.sim import publish_loaded
from tests.rollout.test_controller import FakeClock, good_eval, rollout_cfg

TEXT = "return sorted(items)"
MIN_SAMPLES = 40  # the first look: 40 shown in the smaller arm; one user counts for at most 10 of them (0.25)
HONEST = 6  # users per arm


def keys_on(arm: str, table: PolicyTable, n: int, prefix: str) -> list[str]:
    """``n`` API keys the gateway routes to ``arm`` (routing is by the key's hash: no client can choose)."""
    out, i = [], 0
    while len(out) < n:
        key = f"{prefix}-{i}"
        if route(table, user_hash(key), {0, 1}).arm == arm:
            out.append(key)
        i += 1
    return out


@dataclass
class Canary:
    r: redis.Redis
    keys: Keys
    ctl: RolloutController
    clock: FakeClock
    table: PolicyTable
    honest: dict[str, list[str]]
    attacker: dict[str, str]
    feedback: FeedbackServer
    tokenizer: object
    http: httpx.Client  # one keep-alive client: a fresh one per rating costs more than the rating (TLS context)
    served: int = 0

    def serve_and_rate(self, key: str, accepted: bool) -> None:
        """One completion routed for ``key`` and stored as the gateway stores it, then the key's rating of it."""
        r = route(self.table, user_hash(key), {0, 1})
        self.served += 1
        prompt = get_template("qwen").render(f"def sort_{self.served}(items):\n    ", "\n")
        rec = make_rollout(self.tokenizer, tenant="acme", prompt=prompt, completion=TEXT, version=r.version, arm=r.arm)
        rec = rec.model_copy(update={"user_hash": user_hash(key), "canary": self.table.candidate})
        self.r.execute_command(*record_command(self.keys, rec, 1800, 100_000, False))
        resp = self.http.post(
            f"{self.feedback.url}/api/training/submit",
            json=event(prompt, TEXT, accepted=accepted),
            headers={"Authorization": f"Bearer {key}", "X-Project-ID": "acme"},
            timeout=10,
        )
        assert resp.status_code == 200 and resp.json()["status"] == "accepted_for_training", resp.text

    def honest_traffic(self, accepts: dict[str, int] | None = None, users: int = HONEST) -> None:
        """Each honest user of each arm rates 10 suggestions, accepting ``accepts[arm]`` (3) of them."""
        for arm, ks in self.honest.items():
            for key in ks[:users]:
                for j in range(10):
                    self.serve_and_rate(key, j < (accepts or {}).get(arm, 3))

    def raw(self) -> tuple[ArmStats, ArmStats]:
        return (
            ArmStats.from_mapping(self.r.hgetall(self.keys.stats(1, CANDIDATE))),
            ArmStats.from_mapping(self.r.hgetall(self.keys.stats(0, STABLE))),
        )


@pytest.fixture
def few_users() -> str:
    """rollout.fewUsers (the product default; the last tests parametrize it)."""
    return "wait"


@pytest.fixture
def canary(empty_valkey, redis_client, tmp_path, tokenizer, few_users: str) -> Iterator[Canary]:
    clock = FakeClock()
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())  # JOB: the feedback service's
    publish_loaded(redis_client, JOB, 1)
    cfg = rollout_cfg(min_samples=MIN_SAMPLES, min_dwell_seconds=0, few_users=few_users)
    ctl = RolloutController(redis_client, JOB, cfg, good_eval, clock=clock)
    assert [d.decision for d in ctl.tick()] == ["gate_pass"]
    table = PolicyTable.from_redis(redis_client.hgetall(Keys(JOB).policy))
    assert (table.candidate, table.canary_share) == (1, 0.5)
    honest = {arm: keys_on(arm, table, HONEST, f"key-honest-{arm}") for arm in (STABLE, CANDIDATE)}
    attacker = {arm: keys_on(arm, table, 1, f"key-attacker-{arm}")[0] for arm in (STABLE, CANDIDATE)}
    everyone = [k for ks in honest.values() for k in ks] + list(attacker.values())
    fb = start_feedback(tmp_path, empty_valkey.url, tenants={"acme": everyone}, limits={"anomalyK": 0})
    try:
        with httpx.Client(timeout=10) as http:
            yield Canary(redis_client, Keys(JOB), ctl, clock, table, honest, attacker, fb, tokenizer, http)
    finally:
        fb.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.mark.parametrize(
    ("arm", "accepts", "decided_on_raw_counters"),
    [
        (CANDIDATE, False, "rollback"),  # rejects everything on the candidate: the candidate looks worse
        (CANDIDATE, True, "promote"),  # accepts everything on the candidate: it looks better
        (STABLE, True, "rollback"),  # accepts everything on stable: the candidate looks worse
        (STABLE, False, "promote"),  # rejects everything on stable: the candidate looks better
    ],
)
def test_one_key_rejecting_or_accepting_everything_cannot_decide_a_look(
    canary: Canary, arm: str, accepts: bool, decided_on_raw_counters: str
) -> None:
    canary.honest_traffic()  # both arms alike: 18 of 60 accepted
    for _ in range(60):  # as many ratings as all honest users of its arm together (well within 1,000 an hour)
        canary.serve_and_rate(canary.attacker[arm], accepts)
    cand, stable = canary.raw()
    assert min(cand.shown, stable.shown) == 60 and max(cand.shown, stable.shown) == 120
    # The attack is real: on the arm counters the controller's own decision function lets the one key decide.
    assert decide_canary(cand, stable, 600.0, -1, canary.ctl.rules).action == decided_on_raw_counters

    canary.clock.now += 60
    (decision,) = canary.ctl.tick()
    assert (decision.decision, decision.figures["look"]) == ("hold", 0), decision.reason
    capped = decision.figures["candidate" if arm == CANDIDATE else "stable"]
    assert (capped["shown"], capped["accepted"]) == (70, 18 + (10 if accepts else 0))  # the key counts for 10
    assert canary.table.stable == 0 and canary.ctl.store.policy().candidate == 1  # nothing decided


def test_a_verdict_that_rests_on_one_key_is_held(canary: Canary) -> None:
    """Four honest candidate users accept 4 of 10, four stable users 2 of 10: better, not yet credibly (P 0.96 <
    0.975). One more key on the candidate accepts everything, within its cap (10 of 40): the capped counts say
    promote, but without that one key they would not, so the look holds and names it."""
    canary.honest_traffic({CANDIDATE: 4, STABLE: 2}, users=4)
    attacker = canary.attacker[CANDIDATE]
    for _ in range(10):
        canary.serve_and_rate(attacker, True)
    cand, stable = canary.raw()
    assert decide_canary(cand, stable, 600.0, -1, canary.ctl.rules).action == "promote"

    canary.clock.now += 60
    (decision,) = canary.ctl.tick()
    assert decision.decision == "hold" and decision.figures["look"] == 0
    assert f"promote rests on one user: without user {user_hash(attacker)[:12]} (candidate arm)" in decision.reason
    assert canary.ctl.store.policy().candidate == 1


def test_one_key_alone_never_reaches_a_look(canary: Canary) -> None:
    """Only the stable arm has honest users; one key sends the candidate arm 200 rejects. On the arm counters that
    is a look (200 >= 40) and a rollback; capped, the candidate arm holds 10 shown: no look, no verdict."""
    for key in canary.honest[STABLE]:
        for j in range(10):
            canary.serve_and_rate(key, j < 3)
    for _ in range(200):
        canary.serve_and_rate(canary.attacker[CANDIDATE], False)
    cand, stable = canary.raw()
    assert (cand.shown, stable.shown) == (200, 60)
    assert decide_canary(cand, stable, 600.0, -1, canary.ctl.rules).action == "rollback"

    canary.clock.now += 60
    assert canary.ctl.tick() == []
    state = canary.ctl.store.state(1)
    assert state is not None and (state.state, state.last_look) == ("canary", -1)


@pytest.mark.parametrize("few_users", ["decide"])
def test_under_few_users_decide_a_crowd_with_one_key_accepting_everything_still_holds(canary: Canary) -> None:
    """fewUsers: decide, 13 users: the canary is no few-user one, stays split by key, and the look holds."""
    test_one_key_rejecting_or_accepting_everything_cannot_decide_a_look(canary, CANDIDATE, True, "promote")
    assert canary.ctl.store.policy().split == "key"
    assert all("few-user" not in d.reason for _, d in canary.ctl.store.decisions(20))


@pytest.mark.parametrize("few_users", ["decide"])
def test_under_few_users_decide_one_key_alone_on_an_arm_still_never_reaches_a_look(canary: Canary) -> None:
    """fewUsers: decide, the candidate arm's only user is the attacker, 7 users in all: no few-user canary, the cap
    still keeps the attacker's 200 rejects from reaching a look."""
    test_one_key_alone_never_reaches_a_look(canary)
    assert canary.ctl.store.policy().split == "key"
