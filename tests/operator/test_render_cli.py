"""`python -m onlinerl_operator render`: the operator's own render, offline, as a review or a CI job would run it.

What it proves, all from the YAML stream the command prints (no cluster; the command runs in-process, and once as a
real subprocess):

- every example renders, and everything it prints validates strictly against Kubernetes 1.29 and 1.33
  (kubernetes-validate's strict schemas: unknown fields are errors). Kinds of CRDs that Kubernetes itself does not
  define (ServiceMonitor, PodMonitor: monitoring.coreos.com; ScaledObject: KEDA; JobSet) have no schema there and
  are skipped, by name, nothing else;
- each example's header states the GPUs it needs, and that figure is the sum of the rendered GPU limits times the
  pods that carry them;
- a job with the job-wide and every component's pod template: every pod it creates (the serving, feedback and
  rollout Deployments, the Redis StatefulSet, the trainer Job; with two nodes the Indexed Job or each Job of the
  JobSet) carries the job-wide nodeSelector, imagePullSecrets, priorityClassName and serviceAccountName, and its own
  component's tolerations and affinity; the monitors carry spec.monitoring.labels and the Ingress its annotations;
- the optional APIs are inputs: without --monitoring no monitor is printed, with --jobset the trainer is a JobSet;
- the order is the reconciler's (plan.apply_plan: config and storage first, the trainer last);
- bad files fail with exit status 2 and a message naming what to fix: not YAML, no OnlineRLJob, a refused spec
  (the CRD's rules), a name the CRD refuses, an unknown API; a fragment that asks for the operator's own labels is
  reported (and its value kept), and --fail-on-problems turns that into exit status 1.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from onlinerl_operator import cli
from onlinerl_operator import constants as c
from tests.operator.helpers import EXAMPLES, ROOT

K8S_VERSIONS = ("1.29", "1.33")
# Kinds whose schema Kubernetes does not ship (CustomResourceDefinitions of other projects): skipped by name.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject", "JobSet"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "JobSet")


def run_render(*args: str, stdin: str | None = None) -> tuple[int, list[dict[str, Any]], str]:
    """The command in-process: exit status, the printed manifests, what it wrote to stderr."""
    out, err = io.StringIO(), io.StringIO()
    old_err, old_in = sys.stderr, sys.stdin
    sys.stderr, sys.stdin = err, io.StringIO(stdin or "")
    try:
        parsed = cli.parser().parse_args(["render", *args])
        try:
            rc = cli.render(parsed, out)
        except cli.RenderError as exc:
            print(f"error: {exc}", file=sys.stderr)
            rc = 2
    finally:
        sys.stderr, sys.stdin = old_err, old_in
    docs = [d for d in yaml.safe_load_all(out.getvalue()) if d] if out.getvalue() else []
    return rc, docs, err.getvalue()


def validate_strictly(manifests: list[dict[str, Any]]) -> list[str]:
    """Validate every manifest on each version; returns the kinds skipped (CRD kinds only)."""
    skipped = []
    for m in manifests:
        if m["kind"] in CRD_KINDS:
            skipped.append(m["kind"])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(m, version, strict=True)
    return skipped


def pod_templates(m: dict[str, Any]) -> list[dict[str, Any]]:
    if m["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in m["spec"]["replicatedJobs"]]
    if m["kind"] in WORKLOAD_KINDS:
        return [m["spec"]["template"]]
    return []


def pods_per_template(m: dict[str, Any]) -> int:
    spec = m["spec"]
    if m["kind"] == "JobSet":
        return sum(r["replicas"] * r["template"]["spec"].get("parallelism", 1) for r in spec["replicatedJobs"])
    if m["kind"] == "Job":
        return spec.get("parallelism", 1)
    return spec.get("replicas", 1)


def gpus_rendered(manifests: list[dict[str, Any]]) -> int:
    total = 0
    for m in manifests:
        for template in pod_templates(m):
            per_pod = sum(
                int(ct.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                for ct in template["spec"]["containers"]
            )
            total += per_pod * pods_per_template(m)
    return total


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_and_validates(example: Path) -> None:
    for flags in ((), ("--monitoring",), ("--monitoring", "--keda", "--jobset", "--custom-metrics")):
        rc, docs, err = run_render("-f", str(example), "--namespace", "team-a", *flags)
        assert rc == 0, err
        assert docs and all(d["metadata"]["namespace"] == "team-a" for d in docs)
        if len(flags) > 1:  # every optional API: the most kinds (validating costs seconds on this machine)
            assert set(validate_strictly(docs)) <= CRD_KINDS
        monitors = {d["kind"] for d in docs} & {"ServiceMonitor", "PodMonitor"}
        assert monitors == ({"ServiceMonitor", "PodMonitor"} if "--monitoring" in flags else set())


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_header_states_the_gpus_the_render_asks_for(example: Path) -> None:
    header = re.search(r"^# GPUs needed: (\d+)\b", example.read_text(), re.MULTILINE)
    assert header, f"{example.name}: the first comment must say '# GPUs needed: N'"
    rc, docs, err = run_render("-f", str(example))
    assert rc == 0, err
    assert gpus_rendered(docs) == int(header.group(1)), example.name


def test_example_gpu_figures() -> None:
    """The figures the issue reported, from the render: the LoRA example needs 3 GPUs, the 8-GPU one 12."""
    figures = {p.name: gpus_rendered(run_render("-f", str(p))[1]) for p in EXAMPLES}
    assert figures == {"cpu-demo.yaml": 0, "gpu-8x-full-zero3.yaml": 12, "gpu-lora-qwen-1.5b.yaml": 3}


JOB_WIDE = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"cost-center": "42"}},
    "spec": {
        "nodeSelector": {"pool": "onlinerl"},
        "imagePullSecrets": [{"name": "private-registry"}],
        "priorityClassName": "onlinerl-high",
        "serviceAccountName": "onlinerl-runner",
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "onlinerl", "effect": "NoSchedule"}],
    },
}


def component_template(component: str) -> dict[str, Any]:
    """Each component its own toleration and node affinity, so the test can tell whose reached which pod."""
    return {
        "metadata": {"labels": {"fragment-of": component}},
        "spec": {
            "tolerations": [{"key": f"only-{component}", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "role", "operator": "In", "values": [component]}]}
                        ]
                    }
                }
            },
        },
    }


def templated_job(nodes: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "podTemplate": JOB_WIDE,
        "auth": {"apiKeysSecret": "keys"},
        "rollout": {"strategy": "canary"},
        "monitoring": {"labels": {"release": "kube-prometheus-stack"}},
        "ingress": {
            "enabled": True,
            "host": "code.example.com",
            "tlsSecret": "code-tls",
            "annotations": {
                "cert-manager.io/cluster-issuer": "letsencrypt",
                "nginx.ingress.kubernetes.io/proxy-buffering": "off",
            },
        },
        "redis": {"storageClass": "fast-rwo"},
        "trainer": {"nodes": nodes, "gpus": 1 if nodes > 1 else 0, "engine": "deepspeed" if nodes > 1 else "auto"},
    }
    for component in ("serving", "feedback", "trainer", "redis", "rollout"):
        spec.setdefault(component, {})["podTemplate"] = component_template(component)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "tpl"}, "spec": spec}


def assert_every_pod_templated(docs: list[dict[str, Any]]) -> set[str]:
    seen = set()
    for m in docs:
        for template in pod_templates(m):
            component = template["metadata"]["labels"][c.LABEL_COMPONENT]
            seen.add(component)
            pod, where = template["spec"], f"{m['kind']} {m['metadata']['name']}"
            assert pod["nodeSelector"] == {"pool": "onlinerl"}, where
            assert pod["imagePullSecrets"] == [{"name": "private-registry"}], where
            assert pod["priorityClassName"] == "onlinerl-high", where
            assert pod["serviceAccountName"] == "onlinerl-runner", where
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert [t["key"] for t in pod["tolerations"]] == ["dedicated", f"only-{component}"], where
            terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [component], where
            labels = template["metadata"]["labels"]
            assert labels["team"] == "ml" and labels["fragment-of"] == component, where
            assert labels[c.LABEL_JOB] == "tpl", where  # the operator's selector labels are intact
            assert template["metadata"]["annotations"]["cost-center"] == "42", where
    return seen


def test_both_pod_templates_reach_every_pod_and_everything_validates(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(templated_job()))
    rc, docs, err = run_render("-f", str(job), "-n", "team-a", "--monitoring")
    assert (rc, err) == (0, "")
    assert assert_every_pod_templated(docs) == {"serving", "feedback", "trainer", "redis", "rollout"}
    kinds = {d["kind"]: d for d in docs}
    for monitor in ("ServiceMonitor", "PodMonitor"):
        assert kinds[monitor]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert kinds[monitor]["metadata"]["labels"][c.LABEL_JOB] == "tpl"
    ingress = kinds["Ingress"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ingress["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert ingress["spec"]["tls"] == [{"hosts": ["code.example.com"], "secretName": "code-tls"}]
    (claim,) = kinds["StatefulSet"]["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["storageClassName"] == "fast-rwo"
    assert validate_strictly(docs) == ["ServiceMonitor", "PodMonitor"]
    # the reconciler's order: config and storage before the pods, the trainer last
    order = [d["kind"] for d in docs]
    assert order[0] == "ConfigMap" and order[-1] == "Job"
    assert order.index("StatefulSet") < order.index("Deployment")


@pytest.mark.parametrize("flags", [(), ("--jobset",)], ids=["indexed-job", "jobset"])
def test_multi_node_trainer_pods_are_templated(tmp_path: Path, flags: tuple[str, ...]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(templated_job(nodes=2)))
    rc, docs, err = run_render("-f", str(job), *flags)
    assert rc == 0, err
    (trainer,) = [d for d in docs if d["metadata"]["name"] == "tpl-trainer" and d["kind"] in ("Job", "JobSet")]
    assert trainer["kind"] == ("JobSet" if flags else "Job")
    assert assert_every_pod_templated([trainer]) == {"trainer"}
    validate_strictly(docs)


def test_without_the_redis_storage_fields_redis_gets_its_own_rwo_claim_on_the_default_class() -> None:
    rc, docs, err = run_render("-f", str(ROOT / "examples" / "cpu-demo.yaml"))
    assert rc == 0, err
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "storageClassName" not in claim["spec"]


def test_a_fragment_cannot_take_the_operators_labels(tmp_path: Path) -> None:
    job = templated_job()
    job["spec"]["serving"]["podTemplate"]["metadata"]["labels"][c.LABEL_COMPONENT] = "feedback"  # would steal traffic
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    rc, docs, err = run_render("-f", str(path))
    assert rc == 0
    assert f"metadata.labels.{c.LABEL_COMPONENT}" in err and "'feedback'" in err
    (serving,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tpl-serving"]
    assert serving["spec"]["template"]["metadata"]["labels"][c.LABEL_COMPONENT] == "serving"
    assert run_render("-f", str(path), "--fail-on-problems")[0] == 1


JOB_HEAD = f"apiVersion: {c.API_VERSION}\nkind: {c.KIND}\nmetadata: {{name: bad}}\n"


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        ("spec: [unclosed", (), "is not YAML"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", (), "holds no OnlineRLJob (found: Pod)"),
        ("- a\n- b\n", (), "must be a Kubernetes object"),
        (JOB_HEAD.replace("v1alpha1", "v9"), (), "use onlinerl.dev/v1alpha1"),
        (
            JOB_HEAD + "spec: {auth: {allowAnonymous: true}, trainer: {batchSize: 4, microBatchSize: 8}}\n",
            (),
            "must not exceed trainer.batchSize",
        ),
        (
            JOB_HEAD + "spec: {auth: {allowAnonymous: true}, ingress: {enabled: true, tlsSecret: t}}\n",
            (),
            "ingress.tlsSecret needs ingress.host",
        ),
        (
            JOB_HEAD + "spec: {auth: {allowAnonymous: true}, podTemplate: {spec: {containers: []}}}\n",
            (),
            "containers: the operator renders these",
        ),
        (JOB_HEAD.replace("name: bad", "name: Bad_Name"), (), "metadata.name 'Bad_Name' is refused by the CRD"),
        (JOB_HEAD.replace("name: bad", "name: " + "a" * 49), (), "at most 48 characters"),
        (JOB_HEAD + "spec: {auth: {allowAnonymous: true}}\n", ("-a", "example.com/v1"), "looks for none of these"),
    ],
    ids=[
        "not-yaml",
        "not-a-job",
        "not-objects",
        "wrong-version",
        "cel-rule",
        "tls-no-host",
        "containers",
        "name",
        "long",
        "api",
    ],
)
def test_bad_files_fail_with_a_message_that_says_what_to_fix(
    tmp_path: Path, text: str, args: tuple[str, ...], message: str
) -> None:
    rc, docs, err = run_render("-f", "-", *args, stdin=text)
    assert rc == 2 and docs == []
    assert err.startswith("error: ") and message in err, err


def test_missing_file_and_the_real_command_line(tmp_path: Path) -> None:
    assert run_render("-f", str(tmp_path / "absent.yaml"))[2].endswith("no such file\n")
    proc = subprocess.run(
        [sys.executable, "-m", "onlinerl_operator", "render", "-f", str(ROOT / "examples" / "cpu-demo.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"# {c.KIND} default/demo:")
    kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
    assert kinds[0] == "ConfigMap" and kinds[-1] == "Job" and "ServiceMonitor" not in kinds


def test_monitoring_labels_cannot_take_the_operators_labels(tmp_path: Path) -> None:
    job = templated_job()
    job["spec"]["monitoring"]["labels"] = {c.LABEL_JOB: "someone-else", "release": "prom"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    rc, docs, err = run_render("-f", str(path), "--monitoring")
    assert rc == 0, err
    for monitor in [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]:
        assert (
            monitor["metadata"]["labels"][c.LABEL_JOB] == "tpl" and monitor["metadata"]["labels"]["release"] == "prom"
        )
