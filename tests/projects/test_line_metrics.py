"""Each policy line's figures in Prometheus (issue 39): the ``line`` label, its cap, and each component's series.

What each test proves:
- the label: ``shared`` for the shared line, the project's name for its own line, never ``""``; a project named like a
  reserved value cannot pass for the shared line or the overflow; past the cap later lines count under ``other``
  while the first keep their names;
- the gateway's real ``/metrics`` route (its ASGI app over HTTP, state as its refresh builds it): each routed line's
  stable/candidate/pinned versions and canary share, a line no longer routed loses its series, a line over the cap
  exports none (served completions per line: through real vLLM in test_project_serving.py);
- the feedback service's real app (ASGI, lifespan, session valkey, the real tokenizer table): an outcome counts its
  shown/accepted, its outcome and its reward on the line that served the rated record, a forged record of another
  project's line counts on no line;
- the rollout's LinesController with simulated users on the session valkey: each line's running canary exports its
  P(candidate better) and its arms' accept rates (the shared line's agreeing with its own series, a project's with its
  counters), an idle line takes no place under the cap, a canary over the cap is not exported, and a line's series go
  when its canary ends;
- the real Trainer on the tiny model: one update per line counts on that line (steps, loss, KL, clip), the published
  version is each line's own, and with the cap at one project line the next line's steps count under ``other`` and
  its statistics and version are not exported.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from onlinerl.auth import KeyRing
from onlinerl.config import ProjectsConfig, from_mapping
from onlinerl.keys import Keys
from onlinerl.metric_lines import OTHER_LABEL, SHARED_LABEL, LineLabels, project_label
from onlinerl.schemas import PolicyTable
from onlinerl.tokens import load_token_table
from onlinerl_feedback.app import create_app as feedback_app
from onlinerl_rollout.lines import LinesController
from onlinerl_serving.gateway import Gateway
from onlinerl_serving.gateway import create_app as gateway_app
from onlinerl_serving.state import parse_models, routable
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.trainer import Trainer
from tests.feedback.rollouts import make_rollout, record_rollout
from tests.projects import test_rollout_lines as rl
from tests.projects.test_trainer_adapters import project_config, sample, train
from tests.rollout.sim import ArmSimulator, Truth
from tests.rollout.test_controller import TICK_SECONDS, FakeClock, good_eval, rollout_cfg

JOB = "j"
BASE = "onlinerl-base"
KEYS = {"acme": ["sk-acme-0123456789"], "beta": ["sk-beta-0123456789"], "gamma": ["sk-gamma-0123456789"]}


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples on a /metrics page: sorted label pairs -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_line(text: str, name: str, **match: str) -> dict[str, float]:
    """``name`` summed per ``line`` over the samples whose labels include ``match``."""
    out: dict[str, float] = {}
    for labels, value in series(text, name).items():
        d = dict(labels)
        if match.items() <= d.items():
            out[d["line"]] = out.get(d["line"], 0.0) + value
    return out


# --- the label ---------------------------------------------------------------------------------------------------
def test_the_line_label_names_shared_and_each_project_never_empty() -> None:
    labels = LineLabels()
    assert labels("") == SHARED_LABEL == "shared"
    assert labels("acme") == "acme"
    # legal tenant names that would merge with the shared line's or the overflow's series
    assert labels("shared") == project_label("shared") == "@shared"
    assert labels("other") == "@other"
    assert "" not in {labels(x) for x in ("", "acme", "shared", "other")}
    with pytest.raises(ValueError, match="cannot be negative"):
        LineLabels(-1)


def test_past_the_cap_later_lines_count_under_other_and_the_first_keep_their_names() -> None:
    labels = LineLabels(cap=2)
    assert [labels(x) for x in ("acme", "beta", "gamma", "delta")] == ["acme", "beta", OTHER_LABEL, OTHER_LABEL]
    assert [labels(x) for x in ("beta", "acme", "", "gamma")] == ["beta", "acme", SHARED_LABEL, OTHER_LABEL]
    assert labels.named("acme") and labels.named("") and not labels.named("gamma")
    assert LineLabels(cap=0)("acme") == OTHER_LABEL  # the shared line is never capped
    assert LineLabels(cap=0)("") == SHARED_LABEL


# --- the gateway ---------------------------------------------------------------------------------------------------
def _gateway(app) -> Gateway:
    """The Gateway behind create_app's ASGI callable (its hot route's handler)."""
    return next(c.cell_contents for c in app.__closure__ if isinstance(c.cell_contents, Gateway))


def test_the_gateway_exports_each_routed_lines_versions_and_canary_share(empty_valkey) -> None:
    cfg = from_mapping(
        {"job": JOB, "redis": {"url": empty_valkey.url}, "projects": {"adapters": "listed", "listed": ["acme", "beta"]}}
    )
    app = gateway_app(cfg, KeyRing.from_mapping({"tenants": {t: {"keys": k} for t, k in KEYS.items()}}))
    gw = _gateway(app)
    gw.metrics.line = LineLabels(cap=1)  # one project line by name: the second routed line is over the cap
    st = gw.state  # as its refresh builds it from the model list and the tables
    st.policy = PolicyTable(stable=3, candidate=4, canary_share=0.1)
    st.loaded, st.line_loaded = parse_models(JOB, BASE, [BASE, "j-v3", "j-v4", "j@acme-v1", "j@acme-v2", "j@beta-v1"])
    st.line_tables = {"acme": PolicyTable(stable=1, candidate=2, canary_share=0.5), "beta": PolicyTable(stable=1)}
    st.lines = routable(cfg.projects, st.line_tables, st.line_loaded)

    async def scrape() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            resp = await c.get("/metrics")
            assert resp.status_code == 200
            return resp.text

    text = asyncio.run(scrape())
    versions = {
        (dict(k)["line"], dict(k)["role"]): v for k, v in series(text, "onlinerl_serving_policy_version").items()
    }
    assert versions == {
        ("shared", "stable"): 3,
        ("shared", "candidate"): 4,
        ("shared", "pinned"): -1,
        ("acme", "stable"): 1,
        ("acme", "candidate"): 2,
        ("acme", "pinned"): -1,
    }  # beta is routed too, but over the cap: a version "of some other line" is exported for no line
    assert by_line(text, "onlinerl_serving_canary_share") == {"shared": 0.1, "acme": 0.5}

    # acme rolled back to 0 and no longer routed: its series go; the shared line's stay
    st.line_tables["acme"] = PolicyTable(stable=0, hold=0)
    st.lines = routable(cfg.projects, st.line_tables, st.line_loaded)
    text = asyncio.run(scrape())
    assert {dict(k)["line"] for k in series(text, "onlinerl_serving_policy_version")} == {"shared"}
    assert by_line(text, "onlinerl_serving_canary_share") == {"shared": 0.1}


# --- feedback ------------------------------------------------------------------------------------------------------
TEXT = "    return a + b"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def test_an_outcome_counts_on_the_line_that_served_it_and_a_forged_line_on_none(
    redis_client, empty_valkey, smollm2_path, tokenizer
) -> None:
    r = redis_client
    keys = Keys("fb-lines")
    cfg = from_mapping(
        {
            "job": keys.job,
            "model": {"fimTemplate": "qwen"},
            "projects": {"adapters": "listed", "listed": ["acme"]},
            "feedback": {"reward": {"accepted": 1.0, "acceptedPerChar": 0.0, "rejected": -0.5}},
        }
    )
    keyring = KeyRing.from_mapping({"tenants": {t: {"keys": k} for t, k in KEYS.items()}})
    app = feedback_app(cfg, keyring, empty_valkey.url, load_token_table(smollm2_path))

    def served(tenant: str, prompt: str, line: str, version: int, arm: str) -> None:
        key = KEYS[tenant][0]
        rec = make_rollout(
            tokenizer, tenant=tenant, prompt=prompt, completion=TEXT, version=version, arm=arm, user_key=key
        )
        record_rollout(r, keys, rec.model_copy(update={"line": line}))

    def rate(c: TestClient, tenant: str, prompt: str, accepted: bool) -> str:
        body = {
            "completionId": f"{tenant}-{prompt}",
            "prompt": prompt,
            "completion": TEXT,
            "accepted": accepted,
            "filepath": "file:///w/a.py",
            "prefix": "",
            "suffix": "",
            "modelProvider": "openai",
            "modelName": "m",
            "timestamp": "2026-11-28T12:00:00Z",
            "time": 10,
            "uniqueId": "u",
            "numLines": 1,
            "cacheHit": False,
        }
        headers = {"Authorization": f"Bearer {KEYS[tenant][0]}", "X-Project-ID": tenant}
        resp = c.post("/api/training/submit", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.json()["status"]

    served("acme", "def a1(", "acme", 2, "candidate")
    served("acme", "def a2(", "acme", 1, "stable")
    served("gamma", "def g1(", "", 3, "stable")
    served("beta", "def b1(", "acme", 1, "stable")  # forged: beta's record naming acme's line
    with TestClient(app) as c:
        assert rate(c, "acme", "def a1(", True) == "accepted_for_training"
        assert rate(c, "acme", "def a2(", False) == "accepted_for_training"
        assert rate(c, "gamma", "def g1(", True) == "accepted_for_training"
        assert rate(c, "beta", "def b1(", True) == "rejected"  # foreign_line: audited, counted nowhere
        text = c.get("/metrics").text

    shown = series(text, "onlinerl_feedback_shown_total")
    assert {tuple(v for _, v in k): n for k, n in shown.items()} == {
        ("candidate", "acme", "2"): 1,
        ("stable", "acme", "1"): 1,
        ("stable", "shared", "3"): 1,
    }
    assert by_line(text, "onlinerl_feedback_accepted_total") == {"acme": 1, "shared": 1}
    assert by_line(text, "onlinerl_feedback_accepted_total", arm="candidate") == {"acme": 1}
    assert by_line(text, "onlinerl_feedback_line_events_total", outcome="accepted_for_training") == {
        "acme": 2,
        "shared": 1,
    }
    assert by_line(text, "onlinerl_feedback_line_events_total", outcome="rejected") == {}  # the forgery: no line
    assert by_line(text, "onlinerl_feedback_rewards_total", sign="positive") == {"acme": 1.0, "shared": 1.0}
    assert by_line(text, "onlinerl_feedback_rewards_total", sign="negative") == {"acme": 0.5}
    # the job-wide series did count the forgery, under its tenant
    assert series(text, "onlinerl_feedback_events_total")[(("outcome", "rejected"), ("tenant", "beta"))] == 1


# --- the rollout controller ------------------------------------------------------------------------------------------
def test_the_rollout_exports_each_lines_canary_and_drops_it_when_the_canary_ends(redis_client) -> None:
    r, clock = redis_client, FakeClock()
    for line in ("", "acme", "beta"):
        rl.start_line(r, line)
    # a0 is listed but has no version: idle at every tick, ticked before acme (lines go in name order)
    projects = ProjectsConfig(adapters="listed", listed=["a0", "acme", "beta"])
    ctl = LinesController(r, rl.JOB, rollout_cfg(), projects, good_eval, clock=clock)
    ctl.line_metrics.label = LineLabels(cap=1)  # one project line by name: acme's canary; beta's is over the cap
    assert sorted((line, rec.decision) for line, rec in ctl.tick()) == [
        ("", "gate_pass"),
        ("acme", "gate_pass"),
        ("beta", "gate_pass"),
    ]
    sims = [
        ArmSimulator(r, rl.JOB, {0: Truth(0.30), 1: Truth(0.30)}, seed=7, tenant=t, line=line)
        for t, line in (("gamma", ""), ("acme", "acme"), ("beta", "beta"))
    ]
    for _ in range(3):
        for sim in sims:
            sim.serve(rl.REQUESTS)
        clock.now += TICK_SECONDS
        assert ctl.tick() == []  # too few samples to decide: the canaries run on

    text = generate_latest(ctl.metrics.registry).decode()
    win = by_line(text, "onlinerl_rollout_line_win_probability")
    assert set(win) == {"shared", "acme"}
    assert win["shared"] == ctl.metrics.win_probability._value.get()  # the shared line's own series agree
    for line, label in (("", "shared"), ("acme", "acme")):
        keys = rl.K.for_line(line)
        for version, arm in ((1, "candidate"), (0, "stable")):
            c = r.hgetall(keys.stats(version, arm))
            rate = int(c.get(b"accepted", 0)) / int(c[b"shown"])
            assert by_line(text, "onlinerl_rollout_line_accept_rate", arm=arm)[label] == pytest.approx(rate, abs=1e-6)

    # acme's candidate withdrawn (its table without one): its series go at the next tick, the shared line's stay
    r.hdel(rl.K.for_project("acme").policy, "candidate")
    clock.now += TICK_SECONDS
    ctl.tick()
    text = generate_latest(ctl.metrics.registry).decode()
    assert set(by_line(text, "onlinerl_rollout_line_win_probability")) == {"shared"}
    assert set(by_line(text, "onlinerl_rollout_line_accept_rate")) == {"shared"}


# --- the trainer ---------------------------------------------------------------------------------------------------
def test_each_lines_updates_statistics_and_version_count_on_its_own_line(
    tmp_path, redis_client, empty_valkey, tiny_model_path
) -> None:
    r = redis_client
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, listed=["alpha", "beta"])
    metrics = TrainerMetrics(LineLabels(cap=1))  # alpha by name; beta, opened second, is over the cap
    trainer = Trainer(cfg, r, tiny_model_path, metrics=metrics)
    trainer.start()
    try:
        text = metrics.render().decode()
        assert by_line(text, "onlinerl_trainer_steps_total") == {"shared": 0}  # the shared series from the start
        assert by_line(text, "onlinerl_trainer_policy_version") == {"shared": 0}

        train(trainer, r, [sample(i, ("alpha", "beta", "gamma")[i % 3]) for i in range(9)])  # one update per line
        train(trainer, r, [sample(100 + i, "alpha") for i in range(3)])  # alpha alone
        text = metrics.render().decode()
        assert by_line(text, "onlinerl_trainer_steps_total") == {"shared": 1, "alpha": 2, OTHER_LABEL: 1}
        updates = trainer.last_updates["alpha"]  # the last update's statistics, alpha's own
        for gauge, key in (("loss", "loss"), ("approx_kl", "approx_kl"), ("clip_fraction", "clip_fraction")):
            values = by_line(text, f"onlinerl_trainer_{gauge}")
            assert set(values) == {"shared", "alpha"}, gauge  # beta's over the cap: not exported as "other"'s loss
            assert values["alpha"] == pytest.approx(updates[key]), gauge
        assert series(text, "onlinerl_trainer_samples_total") == {(): 12}  # job-wide: no line label

        assert trainer.publish("alpha") == 1
        assert trainer.publish() == 1  # shared v1, beta v1
        versions = by_line(metrics.render().decode(), "onlinerl_trainer_policy_version")
        assert versions == {"shared": 1, "alpha": 1}
    finally:
        trainer.close()
