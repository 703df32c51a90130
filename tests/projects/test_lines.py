"""Policy lines (issue 39): a project's own adapter line has its own policy keys; what the job shares stays one."""

from __future__ import annotations

import pytest

from onlinerl.config import ConfigError, from_mapping
from onlinerl.keys import Keys


def test_a_project_line_names_its_own_policy_keys_and_shares_the_job_keys():
    shared = Keys("job1")
    acme = shared.for_project("acme")
    line_keys = ("policy", "checkpoints", "holds", "decisions", "rollout", "controller_status")
    for name in line_keys:
        assert getattr(acme, name) != getattr(shared, name), name
        assert getattr(acme, name).startswith("orl:{job1}:p:acme:"), name
    assert acme.stats(3, "stable") == "orl:{job1}:p:acme:stats:v3:stable"
    assert acme.replica_versions("r0") != shared.replica_versions("r0")
    for name in ("samples", "audit", "trainer_lease", "trainer_fence", "replicas"):
        assert getattr(acme, name) == getattr(shared, name), name
    # the shared line keeps the names it always had, and the other project's line is apart from both
    assert shared.policy == "orl:{job1}:policy"
    assert acme.shared == shared
    assert shared.for_project("beta").policy != acme.policy


@pytest.mark.parametrize("name", ["a:b", "a}b", "", "x" * 64, "a b"])
def test_a_project_name_that_could_reach_another_line_is_refused(name):
    with pytest.raises(ValueError, match=r"not allowed|not a string"):
        Keys("job1").for_project(name)


def test_projects_config_default_is_one_shared_policy_and_lists_are_checked():
    cfg = from_mapping({})
    assert cfg.projects.adapters == "off" and not cfg.projects.has_own_line("acme")
    cfg = from_mapping({"projects": {"adapters": "listed", "listed": ["acme"]}})
    assert cfg.projects.has_own_line("acme") and not cfg.projects.has_own_line("beta")
    assert cfg.projects.train_shared is False
    with pytest.raises(ConfigError, match="listed twice"):
        from_mapping({"projects": {"adapters": "listed", "listed": ["acme", "acme"]}})
    with pytest.raises(ConfigError, match="not allowed"):
        from_mapping({"projects": {"listed": ["a:b"]}})


def test_adapter_names_and_checkpoint_folders_parse_back_to_one_line():
    from onlinerl.lines import adapter_name, checkpoint_root, parse_adapter_name
    from onlinerl.schemas import adapter_name as shared_adapter_name

    assert adapter_name("job1", 4) == shared_adapter_name("job1", 4) == "job1-v4"
    assert parse_adapter_name("job1", "job1-v4") == ("", 4)
    for project in ("acme", "v3", "a-v2", "x.y_z"):
        name = adapter_name("job1", 7, project)
        assert parse_adapter_name("job1", name) == (project, 7)
        assert parse_adapter_name("job2", name) is None
    for foreign in ("job1@-v3", "job1@a:b-v3", "job1@acme-vx", "job1-vx", "base"):
        assert parse_adapter_name("job1", foreign) is None
    assert str(checkpoint_root("/ck", "job1")) == "/ck/job1"
    assert str(checkpoint_root("/ck", "job1", "acme")) == "/ck/job1/projects/acme"
    with pytest.raises(ValueError):
        checkpoint_root("/ck", "job1", "../x")
