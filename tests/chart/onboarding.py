"""What the onboarding texts (the chart's NOTES and README, the README, the example headers) tell a new user to type,
pulled out so the tests can hold it against what the operator renders and what the services load."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml

from onlinerl.auth import KeyRing, key_with_role
from onlinerl_operator.render import RenderContext, endpoints, render_all
from onlinerl_operator.spec import parse_spec
from tests.chart.helm import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CPU_DEMO = ROOT / "examples" / "cpu-demo.yaml"
# `kubectl ... create secret generic NAME \` + `--from-literal=keys.yaml='...'` (the next line, maybe commented out)
KEYS_SECRET = re.compile(r"create secret generic (\S+) \\\n[#\s]*--from-literal=keys\.yaml='([^']+)'")
PORT_FORWARD = re.compile(r"port-forward svc/(\S+) (\d+):(\d+)")


def header(path: Path) -> str:
    """The comment lines an example starts with, without their '# '."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:])
    return "\n".join(lines)


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def keys_secrets(text: str) -> list[tuple[str, str]]:
    """(Secret name, keys.yaml literal) of every `create secret generic` command in ``text``."""
    return KEYS_SECRET.findall(text)


def load_keys_literal(literal: str, folder: Path) -> dict[str, str]:
    """Load the documented keys.yaml the way serving and feedback do, placeholders filled in: role -> tenant."""
    filled = re.sub(r"<([\w-]+)>", lambda m: f"orl-{m.group(1)}-0123456789abcdef", literal)
    path = folder / "keys.yaml"
    path.write_text(filled)
    ring = KeyRing.from_file(path)
    roles = {}
    for placeholder, role in (("your-key", "user"), ("eval-key", "eval")):
        identity = ring.identity_for(f"orl-{placeholder}-0123456789abcdef")
        assert identity is not None, f"{placeholder} of {literal!r} is not a key"
        assert identity.role == role, f"{placeholder} has role {identity.role}, not {role}"
        roles[role] = identity.tenant
    assert key_with_role(path)[0] == "orl-eval-key-0123456789abcdef"  # what the rollout gate takes
    return roles


def demo_context() -> RenderContext:
    [job] = [d for d in docs(CPU_DEMO) if d["kind"] == "OnlineRLJob"]
    name = job["metadata"]["name"]
    return RenderContext(name=name, namespace="team-a", uid="u-1", cfg=parse_spec(name, job["spec"]))


def rendered_services(ctx: RenderContext) -> dict[str, int]:
    """Service name -> port, as the operator renders them."""
    return {m["metadata"]["name"]: m["spec"]["ports"][0]["port"] for m in render_all(ctx) if m["kind"] == "Service"}


def check_port_forwards(text: str, ctx: RenderContext) -> set[str]:
    """Every `port-forward svc/X L:R` in ``text`` names a Service the job has, on its port; returns the names."""
    services = rendered_services(ctx)
    forwards = PORT_FORWARD.findall(text.replace("<job>", ctx.name))
    assert forwards, "no port-forward in the text"
    for name, local, remote in forwards:
        assert name in services, f"svc/{name} is not a Service of job {ctx.name}: {sorted(services)}"
        assert int(remote) == services[name], f"svc/{name} listens on {services[name]}, not {remote}"
        assert local == remote, "the local port differs from the one the addresses in the text use"
    return {name for name, _, _ in forwards}


def local_continue_config(ctx: RenderContext) -> dict[str, Any]:
    """The job's status config rewritten by the sed command of the cpu-demo header, run by the real sed."""
    lines = header(CPU_DEMO).splitlines()
    [command] = [ln.strip().lstrip("| ") for ln in lines if ln.strip().startswith("| sed ")]
    argv = shlex.split(command)
    out = subprocess.run(argv, input=endpoints(ctx)["continueConfig"], capture_output=True, text=True, check=True)
    return yaml.safe_load(out.stdout)
