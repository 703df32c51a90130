"""The chart installs AND upgrades the CRD: a normal template from a byte-identical copy of crds/onlinerljob.yaml,
kept on uninstall. (Helm's crds/ folder is installed once and never upgraded, so it is not used.)"""

from __future__ import annotations

import yaml

from tests.chart.helm import CHART, ROOT, by_kind, render

SOURCE = ROOT / "crds" / "onlinerljob.yaml"
COPY = CHART / "files" / "crds" / "onlinerljob.yaml"


def test_chart_crd_is_a_byte_identical_copy() -> None:
    assert SOURCE.is_file(), "crds/onlinerljob.yaml is missing"
    assert COPY.read_bytes() == SOURCE.read_bytes(), (
        "the chart's CRD drifted from crds/onlinerljob.yaml: cp crds/onlinerljob.yaml charts/onlinerl/files/crds/"
    )


def test_no_helm_crds_folder() -> None:
    assert not (CHART / "crds").exists(), "Helm's crds/ folder is never upgraded: render the CRD as a template"


def test_rendered_crd_equals_the_source_plus_release_metadata() -> None:
    source = yaml.safe_load(COPY.read_text())
    (rendered,) = by_kind(render(None, False), "CustomResourceDefinition")
    assert rendered["spec"] == source["spec"], "fromYaml/toYaml changed the schema"
    assert rendered["metadata"]["name"] == source["metadata"]["name"] == "onlinerljobs.onlinerl.dev"
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert rendered["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for key, value in (source["metadata"].get("labels") or {}).items():
        assert rendered["metadata"]["labels"][key] == value


def test_crd_switches() -> None:
    values = {v.stem: v for v in (CHART.parent.parent / "tests" / "chart" / "values").glob("*.yaml")}
    assert not by_kind(render(values["monitoring-off"], False), "CustomResourceDefinition")
    (crd,) = by_kind(render(values["bring-your-own-sa"], False), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
