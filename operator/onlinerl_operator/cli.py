"""The operator's command line: ``run`` (the default: the kopf operator) and ``render`` (the offline dry run).

``python -m onlinerl_operator render -f JOB.yaml [--namespace NS] [--monitoring] [--keda] [--jobset]`` prints, without
a cluster, the manifests the operator would apply for each OnlineRLJob in the file, as a YAML stream, in the order a
reconcile pass applies them (plan.apply_plan: the same functions the operator runs, not a copy). Like
``helm template``: for reviews, diffs between two specs, and policy checks in CI (GitOps) before the job is applied.

The operator asks the cluster's discovery which optional APIs it serves; offline, the options say so
(``--api-versions`` takes helm's spelling, e.g. ``keda.sh/v1alpha1``). A bad file fails with exit status 2 and a
message naming what to fix: not YAML, no OnlineRLJob in it, or a spec the CRD (and the operator) refuses.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml

from onlinerl_operator import constants as c

RENDER_UID = "00000000-0000-0000-0000-000000000000"  # no cluster, no uid: the owner references show this one
SHORTCUT_APIS = {
    "monitoring": ("monitoring.coreos.com/v1", "the Prometheus operator: ServiceMonitor, PodMonitor"),
    "keda": ("keda.sh/v1alpha1", "KEDA: ScaledObject autoscalers"),
    "jobset": ("jobset.x-k8s.io/v1alpha2", "JobSet: the multi-node trainer as one JobSet"),
    "custom_metrics": ("custom.metrics.k8s.io/v1beta1", "prometheus-adapter: HPAs on the load metric"),
}


class RenderError(ValueError):
    """The file cannot be rendered; the message says what to fix."""


def run_operator() -> None:
    """Run the operator (standalone: one replica, Recreate strategy).

    Namespaces: ``ONLINERL_OPERATOR_NAMESPACES`` (comma-separated; empty = cluster-wide). Observe interval:
    ``ONLINERL_OPERATOR_INTERVAL`` seconds (default 10)."""
    import kopf

    from onlinerl_operator.handlers import build_registry

    logging.basicConfig(
        level=os.environ.get("ONLINERL_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    namespaces = [n.strip() for n in os.environ.get("ONLINERL_OPERATOR_NAMESPACES", "").split(",") if n.strip()]
    interval = float(os.environ.get("ONLINERL_OPERATOR_INTERVAL", "10"))
    kopf.run(
        registry=build_registry(interval=interval, health_port=c.OPERATOR_PORT),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )


# --- render -----------------------------------------------------------------------------------------------------
def load_jobs(text: str, source: str) -> list[dict[str, Any]]:
    """The OnlineRLJobs of a YAML stream (other documents, such as the examples' Secrets, are skipped)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"{source} is not YAML: {exc}") from None
    if not all(isinstance(d, dict) for d in docs):
        raise RenderError(f"{source}: every YAML document must be a Kubernetes object (a mapping)")
    jobs = [d for d in docs if d.get("kind") == c.KIND]
    if not jobs:
        kinds = ", ".join(sorted({str(d.get("kind")) for d in docs})) or "nothing"
        raise RenderError(f"{source} holds no {c.KIND} (found: {kinds}); render takes an {c.KIND} manifest")
    for job in jobs:
        if job.get("apiVersion") != c.API_VERSION:
            raise RenderError(f"{source}: apiVersion {job.get('apiVersion')!r} is not served; use {c.API_VERSION}")
    return jobs


def _name_rule() -> tuple[int, str]:
    """metadata.name's rule as the CRD states it (crdgen: one source)."""
    from onlinerl_operator.crdgen import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]
    name = schema["properties"]["name"]
    return name["maxLength"], name["pattern"]


def render_context(job: dict[str, Any], namespace: str | None, apis: frozenset[str], source: str) -> Any:
    """What the reconciler builds for ``job``, with the cluster's answers taken from the options."""
    from onlinerl_operator.render import RenderContext
    from onlinerl_operator.spec import SpecError, parse_spec

    meta = job.get("metadata") or {}
    name = meta.get("name")
    max_len, pattern = _name_rule()
    if not isinstance(name, str) or not name:
        raise RenderError(f"{source}: metadata.name is required")
    if len(name) > max_len or not re.fullmatch(pattern, name):
        raise RenderError(
            f"{source}: metadata.name {name!r} is refused by the CRD: at most {max_len} characters matching {pattern}"
        )
    try:
        cfg = parse_spec(name, job.get("spec"))
    except SpecError as exc:
        raise RenderError(f"{source}: {c.KIND} {name}: the CRD and the operator refuse this spec: {exc}") from None
    return RenderContext(
        name=name,
        namespace=namespace or meta.get("namespace") or "default",
        uid=meta.get("uid") or RENDER_UID,
        cfg=cfg,
        monitoring_api=SHORTCUT_APIS["monitoring"][0] in apis,
        apis=apis,
    )


def render_stream(ctx: Any) -> tuple[str, list[str]]:
    """The YAML stream of one job and its problems (what its Degraded condition would say)."""
    from onlinerl_operator.plan import apply_plan, plan_problems, pod_template_problems

    problems = plan_problems(ctx) + pod_template_problems(ctx)
    header = [f"# {c.KIND} {ctx.namespace}/{ctx.name}: what the operator applies, in order (rendered offline)."]
    if ctx.in_cluster_redis and not ctx.cfg.redis.password_secret:
        header.append(
            f"# Not shown: Secret {ctx.redis_password_secret}, created once by the operator with generated Redis "
            "passwords (set spec.redis.passwordSecret to bring your own)."
        )
    if ctx.uid == RENDER_UID:
        header.append(f"# ownerReferences carry uid {RENDER_UID}: the cluster assigns the real one.")
    header += [f"# problem: {p}" for p in problems]
    docs = yaml.safe_dump_all(apply_plan(ctx), sort_keys=False, width=120, explicit_start=True)
    return "\n".join(header) + "\n" + docs, problems


def served_apis(args: argparse.Namespace) -> frozenset[str]:
    from onlinerl_operator.plan import MONITORING_API, OPTIONAL_APIS

    known = (MONITORING_API, *OPTIONAL_APIS)
    apis = set(args.api_versions or [])
    unknown = sorted(apis - set(known))
    if unknown:
        raise RenderError(f"--api-versions {', '.join(unknown)}: the operator looks for none of these; known: {known}")
    apis |= {api for flag, (api, _) in SHORTCUT_APIS.items() if getattr(args, flag)}
    return frozenset(apis)


def render(args: argparse.Namespace, out: TextIO) -> int:
    source = args.filename
    text = sys.stdin.read() if source == "-" else _read(source)
    apis = served_apis(args)
    streams, problems = [], []
    for job in load_jobs(text, source):
        stream, found = render_stream(render_context(job, args.namespace, apis, source))
        streams.append(stream)
        problems += found
    out.write("".join(streams))
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    return 1 if problems and args.fail_on_problems else 0


def _read(source: str) -> str:
    path = Path(source)
    if not path.is_file():
        raise RenderError(f"{source}: no such file")
    return path.read_text()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m onlinerl_operator", description="The OnlineRLJob operator.")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("run", help="run the operator (the default); configured by ONLINERL_OPERATOR_* variables")
    r = sub.add_parser(
        "render",
        help="print the manifests the operator would apply for an OnlineRLJob, without a cluster",
        description="Print, as a YAML stream, what the operator applies for each OnlineRLJob in the file, in the "
        "order it applies them. Optional APIs are assumed absent unless named.",
    )
    r.add_argument("-f", "--filename", required=True, help="YAML file with one or more OnlineRLJobs ('-': stdin)")
    r.add_argument("-n", "--namespace", help="namespace of the job (default: its metadata.namespace, else default)")
    for flag, (api, what) in SHORTCUT_APIS.items():
        r.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=f"assume {api} is served ({what})")
    r.add_argument(
        "-a",
        "--api-versions",
        action="append",
        metavar="GROUP/VERSION",
        help="assume this API is served (repeatable, like helm template --api-versions)",
    )
    r.add_argument(
        "--fail-on-problems",
        action="store_true",
        help="exit 1 when the job would be Degraded (an asked-for API not served, a pod-template conflict)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in (None, "run"):
        run_operator()
        return 0
    try:
        return render(args, sys.stdout)
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
