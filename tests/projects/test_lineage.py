"""A new project adapter never starts from shared weights trained on another project with its own line (issue 39)."""

from __future__ import annotations

import pytest

from onlinerl.schemas import CheckpointManifest
from onlinerl_trainer.lineage import clean_start


def _store(chain: dict[int, tuple[int, dict[str, list[str]]]]):
    """version -> (parent, contributors); a version missing from it has no manifest (pruned)."""

    def manifest(v: int) -> CheckpointManifest:
        if v not in chain:
            raise FileNotFoundError(f"v{v}/manifest.json")
        parent, contributors = chain[v]
        return CheckpointManifest(
            job="j", version=v, parent_version=parent, kind="lora", base_model="b", contributors=contributors
        )

    return manifest


LISTED = {"alpha", "beta"}.__contains__


def test_a_clean_stable_is_the_start():
    m = _store({1: (0, {"demo": ["u1"]}), 2: (1, {"beta": ["u2"], "demo": ["u3"]})})
    assert clean_start(2, m, "beta", LISTED) == (2, "")  # its own samples and unlisted tenants' are fine
    assert clean_start(0, m, "beta", LISTED) == (0, "")


def test_the_start_is_below_the_oldest_version_trained_on_another_listed_project():
    m = _store({1: (0, {"demo": ["u"]}), 2: (1, {"demo": ["u"]}), 3: (2, {"alpha": ["a"]}), 4: (3, {"demo": ["u"]})})
    start, why = clean_start(4, m, "beta", LISTED)
    assert start == 2 and "v3 was trained on project(s) alpha" in why and "not shared stable v4" in why
    assert clean_start(4, m, "alpha", LISTED) == (4, "")  # alpha's own code is alpha's to start from
    m = _store({1: (0, {"alpha": ["a"]}), 2: (1, {})})
    assert clean_start(2, m, "beta", LISTED)[0] == 0  # tainted from the first version: the fresh LoRA


def test_a_version_whose_manifest_is_gone_is_not_vouched_for():
    m = _store({3: (2, {}), 2: (1, {})})  # v1 pruned
    start, why = clean_start(3, m, "beta", LISTED)
    assert start == 0 and "v1's manifest cannot be read" in why


@pytest.mark.parametrize("parent", [5, 6])
def test_a_lineage_loop_ends(parent):
    m = _store({5: (parent, {}), 6: (5, {})})
    assert clean_start(6, m, "beta", LISTED) == (6, "")
