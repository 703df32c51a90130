"""The pod-template merge (render_pod_template): pure functions, so every rule is checked on plain dicts.

Rules: the component's fragment over the job's (maps merged, its scalars win, lists appended, nodeSelectorTerms
replaced); then the fragment over what the operator rendered (its labels, annotations and set fields kept and each
clash reported; lists appended after its own entries). Hostile inputs: a fragment that names containers, or tries to
take over the operator's selector labels or its config-hash annotation.
"""

from __future__ import annotations

import pytest

from onlinerl.config import ConfigError, from_mapping
from onlinerl_operator import constants as c
from onlinerl_operator.render_pod_template import apply_fragment, component_fragment, customise, merge_fragments

JOB = {
    "metadata": {"labels": {"team": "ml", "tier": "job"}},
    "spec": {
        "nodeSelector": {"pool": "general", "zone": "a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "priorityClassName": "ml-default",
        "imagePullSecrets": [{"name": "registry"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
                }
            }
        },
    },
}
TRAINER = {
    "metadata": {"labels": {"tier": "gpu"}},
    "spec": {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "ml-training",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
                }
            },
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        },
    },
}


def test_component_wins_on_scalars_and_map_keys_lists_are_appended() -> None:
    merged = merge_fragments(JOB, TRAINER)
    assert merged["metadata"]["labels"] == {"team": "ml", "tier": "gpu"}
    assert merged["spec"]["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert merged["spec"]["priorityClassName"] == "ml-training"
    assert [t["key"] for t in merged["spec"]["tolerations"]] == ["dedicated", "nvidia.com/gpu"]
    assert merged["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    # nodeSelectorTerms are ORed: appending would let the trainer land on the job's pool as well
    terms = merged["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
    assert "podAntiAffinity" in merged["spec"]["affinity"]
    # the inputs are not modified
    assert JOB["spec"]["nodeSelector"] == {"pool": "general", "zone": "a"}
    assert len(JOB["spec"]["tolerations"]) == 1


def test_empty_component_leaves_the_job_fragment() -> None:
    assert merge_fragments(JOB, {"metadata": {}, "spec": {}}) == JOB
    assert merge_fragments({"metadata": {}, "spec": {}}, TRAINER) == TRAINER


RENDERED = {
    "metadata": {
        "labels": {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: "trainer"},
        "annotations": {c.ANNO_CONFIG_HASH: "abc"},
    },
    "spec": {
        "containers": [{"name": "trainer", "image": "t"}],
        "restartPolicy": "Never",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}],
    },
}


def test_fragment_adds_to_the_rendered_pod() -> None:
    fragment = merge_fragments(JOB, TRAINER)
    fragment["spec"]["topologySpreadConstraints"] = [
        {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    merged, conflicts = apply_fragment(RENDERED, fragment)
    assert conflicts == []
    assert merged["metadata"]["labels"] == {
        c.LABEL_JOB: "demo",
        c.LABEL_COMPONENT: "trainer",
        "team": "ml",
        "tier": "gpu",
    }
    assert merged["spec"]["containers"] == RENDERED["spec"]["containers"]
    assert merged["spec"]["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert [t["topologyKey"] for t in merged["spec"]["topologySpreadConstraints"]] == ["zone", "kubernetes.io/hostname"]
    assert merged["spec"]["priorityClassName"] == "ml-training"
    assert RENDERED["spec"].get("nodeSelector") is None  # pure: the input is untouched


def test_owned_labels_annotations_and_fields_are_kept_and_reported() -> None:
    hostile = {
        "metadata": {
            "labels": {c.LABEL_JOB: "other-job", c.LABEL_COMPONENT: "trainer"},  # same value: no clash
            "annotations": {c.ANNO_CONFIG_HASH: "forged"},
        },
        "spec": {"restartPolicy": "Always"},
    }
    merged, conflicts = apply_fragment(RENDERED, hostile)
    assert merged["metadata"]["labels"][c.LABEL_JOB] == "demo"
    assert merged["metadata"]["annotations"][c.ANNO_CONFIG_HASH] == "abc"
    assert merged["spec"]["restartPolicy"] == "Never"
    assert len(conflicts) == 3
    assert any(f"metadata.labels.{c.LABEL_JOB}" in m and "'other-job'" in m for m in conflicts)
    assert any(f"metadata.annotations.{c.ANNO_CONFIG_HASH}" in m for m in conflicts)
    assert any("spec.restartPolicy" in m for m in conflicts)


def test_spec_fragment_parses_from_the_config_and_refuses_containers() -> None:
    cfg = from_mapping(
        {
            "podTemplate": JOB,
            "trainer": {"podTemplate": TRAINER},
            "serving": {"podTemplate": {"spec": {"runtimeClassName": "nvidia"}}},
        }
    )
    assert component_fragment(cfg, "trainer") == merge_fragments(JOB, TRAINER)
    serving = component_fragment(cfg, "serving")
    assert serving["spec"]["runtimeClassName"] == "nvidia"
    assert serving["spec"]["nodeSelector"] == {"pool": "general", "zone": "a"}
    with pytest.raises(ValueError, match="no pod template for component"):
        component_fragment(cfg, "gateway")
    with pytest.raises(ConfigError, match=r"podTemplate\.spec: .*containers: the operator renders these"):
        from_mapping({"podTemplate": {"spec": {"containers": [{"name": "x", "image": "evil"}]}}})
    with pytest.raises(ConfigError, match=r"tolerations\.0\.effect"):
        from_mapping({"trainer": {"podTemplate": {"spec": {"tolerations": [{"effect": "Sometimes"}]}}}})


def test_customise_reaches_every_template_of_a_jobset() -> None:
    cfg = from_mapping({"podTemplate": {"spec": {"serviceAccountName": "runner"}}})
    template = {"metadata": {"labels": {}}, "spec": {"containers": []}}
    jobset = {
        "kind": "JobSet",
        "metadata": {"name": "demo-trainer"},
        "spec": {"replicatedJobs": [{"template": {"spec": {"template": template}}} for _ in range(2)]},
    }
    out, conflicts = customise(cfg, "trainer", jobset)
    assert conflicts == []
    accounts = [r["template"]["spec"]["template"]["spec"]["serviceAccountName"] for r in out["spec"]["replicatedJobs"]]
    assert accounts == ["runner", "runner"]
    assert "serviceAccountName" not in template["spec"]
