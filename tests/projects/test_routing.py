"""Which policy line a sample trains (issue 39, services/trainer/onlinerl_trainer/routing.py): pure rules.

The tenant decides, never the sample's ``line`` field; a project with its own open line trains only it unless
``trainShared``; a project below ``minSamplesPerHour`` in a sliding hour trains the shared line.
"""

from __future__ import annotations

import pytest

from onlinerl.config import from_mapping
from onlinerl_trainer.adapters import adapter_key, lines_problem
from onlinerl_trainer.routing import HourlyTraffic, opens_line, route, served_line, stream_id_seconds


def test_an_open_project_trains_its_own_line_only_unless_train_shared():
    assert route("alpha", "alpha", {"", "alpha"}, train_shared=False).lines == ("alpha",)
    assert route("alpha", "", {"", "alpha"}, train_shared=False).lines == ("alpha",)  # served by shared: still own
    assert route("alpha", "alpha", {"", "alpha"}, train_shared=True).lines == ("alpha", "")


def test_a_project_without_an_open_line_trains_the_shared_line():
    assert route("gamma", "", {"", "alpha"}, train_shared=True).lines == ("",)
    assert route("alpha", "", {""}, train_shared=False).lines == ("",)  # listed but below its threshold


@pytest.mark.parametrize(
    ("tenant", "claimed", "expected"),
    [
        ("alpha", "beta", ("alpha",)),  # claims another project's line: trains its own
        ("gamma", "alpha", ("",)),  # no line of its own, claims alpha's: trains shared, never alpha
        ("beta", "alpha", ("beta",)),
    ],
)
def test_the_tenant_decides_not_the_samples_line_field(tenant, claimed, expected):
    decided = route(tenant, claimed, {"", "alpha", "beta"}, train_shared=False)
    assert decided.lines == expected and decided.claimed_other
    assert "alpha" not in decided.lines or tenant == "alpha"


def test_own_and_shared_claims_are_not_mismatches():
    assert not route("alpha", "alpha", {"", "alpha"}, False).claimed_other
    assert not route("alpha", "", {"", "alpha"}, False).claimed_other


def test_staleness_counts_on_the_line_that_served_only_when_that_claim_is_believable():
    lines = {"", "alpha"}
    assert served_line("alpha", "alpha", lines) == "alpha"
    assert served_line("alpha", "", lines) == ""
    assert served_line("alpha", "beta", lines) == ""  # another project's line: not believed
    assert served_line("beta", "beta", lines) == ""  # a line this trainer does not hold


def test_a_line_opens_at_the_threshold_and_only_for_projects_that_may_have_one():
    cfg = from_mapping({"projects": {"adapters": "listed", "listed": ["alpha"], "minSamplesPerHour": 3}}).projects
    assert not opens_line(cfg, "alpha", 2) and opens_line(cfg, "alpha", 3)
    assert not opens_line(cfg, "gamma", 1000)
    off = from_mapping({}).projects
    assert not opens_line(off, "alpha", 1000)
    every = from_mapping({"projects": {"adapters": "all", "minSamplesPerHour": 0}}).projects
    assert opens_line(every, "anyone", 0)


def test_hourly_traffic_slides_and_counts_a_replayed_entry_once():
    traffic = HourlyTraffic()
    t0 = 1_700_000_000.0
    assert traffic.add("alpha", f"{int(t0 * 1000)}-0", t0, now=t0) == 1
    assert traffic.add("alpha", f"{int(t0 * 1000)}-0", t0, now=t0) == 1  # the same entry again
    assert traffic.add("alpha", "x-1", t0 + 1800, now=t0 + 1800) == 2
    assert traffic.add("beta", "y-1", t0 + 1800, now=t0 + 1800) == 1  # per project
    assert traffic.count("alpha", now=t0 + 3601) == 1  # the first one left the hour
    assert traffic.count("alpha", now=t0 + 1800 + 3601) == 0
    traffic.add("alpha", "z-1", t0, now=t0)
    traffic.forget("alpha")
    assert traffic.count("alpha", now=t0) == 0


def test_stream_ids_carry_their_append_time():
    assert stream_id_seconds("1700000000123-4") == pytest.approx(1_700_000_000.123)
    assert stream_id_seconds("garbage") == 0.0


def test_adapter_names_keep_the_shared_files_and_cannot_collide():
    assert adapter_key("") == "default"
    assert adapter_key("alpha") == "project-alpha"
    assert adapter_key("a.b") == "project-a~b" != adapter_key("a-b")  # '.' is not allowed in a module name
    assert "." not in adapter_key("x.y.z")


def test_per_project_adapters_refuse_what_this_trainer_cannot_hold():
    def cfg(**trainer):
        return from_mapping({"trainer": trainer, "projects": {"adapters": "all"}})

    assert lines_problem(from_mapping({"trainer": {"engine": "deepspeed"}})) is None  # projects off: as before
    assert lines_problem(cfg(engine="torch")) is None
    assert lines_problem(cfg(engine="auto")) is None
    problem = lines_problem(cfg(engine="deepspeed"))
    assert problem is not None and "trainer.engine: torch" in problem and "projects.adapters: off" in problem
    assert "trainer.gpus" in (lines_problem(cfg(gpus=2)) or "")
    assert "trainer.weights: lora" in (lines_problem(cfg(weights="full")) or "")
