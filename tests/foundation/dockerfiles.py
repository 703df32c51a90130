"""What each image of `make images` holds, read from its Dockerfile: the base image, the Python distributions its
`pip install` lines put in (with every dependency, resolved from pyproject.toml for onlinerl's extras and from the
installed metadata of this venv for the rest), and the commands those distributions install."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "onlinerl"
MAKE_VARIABLES = {"IMAGE_REGISTRY", "IMAGE_TAG", "CONTAINER_TOOL", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
# pip options that take a value (the value is not a requirement)
PIP_VALUE_OPTIONS = {"-r", "-c", "-e", "-i", "-f", "--index-url", "--extra-index-url", "--find-links", "--constraint"}


@dataclass
class Dockerfile:
    path: Path
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)  # COPY sources (build context paths)
    installed: list[Requirement] = field(default_factory=list)  # pip install, with dependencies
    installed_alone: list[Requirement] = field(default_factory=list)  # pip install --no-deps
    uninstalled: set[str] = field(default_factory=set)
    entrypoint: list[str] = field(default_factory=list)
    pip_options: list[list[str]] = field(default_factory=list)  # the options of each pip install


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _requirement(arg: str) -> Requirement:
    """``.[a,b]`` (this project with extras) or a requirement string."""
    if arg == "." or arg.startswith(".["):
        return Requirement(PROJECT + arg[1:])
    return Requirement(arg)


def parse(path: Path) -> Dockerfile:
    out = Dockerfile(path)
    for word, args in _instructions(path.read_text()):
        if word == "FROM":
            out.base = args.split()[0]
        elif word == "ENV":
            out.env.update(dict(pair.split("=", 1) for pair in shlex.split(args) if "=" in pair))
        elif word == "COPY":
            out.copied += shlex.split(args)[:-1]
        elif word == "ENTRYPOINT":
            out.entrypoint = json.loads(args)
        elif word == "RUN":
            for command in re.split(r"&&|;", args):
                _pip(shlex.split(command), out)
    return out


def _pip(argv: list[str], out: Dockerfile) -> None:
    if argv[:3] == ["python", "-m", "pip"] or argv[:3] == ["python3", "-m", "pip"]:
        argv = ["pip", *argv[3:]]
    if len(argv) < 2 or argv[0] not in ("pip", "pip3"):
        return
    action, rest = argv[1], argv[2:]
    if action == "uninstall":
        out.uninstalled |= {canonicalize_name(a) for a in rest if not a.startswith("-")}
        return
    if action != "install":
        return
    options, reqs, skip_next = [], [], False
    for arg in rest:
        if skip_next:
            options.append(arg)
            skip_next = False
        elif arg.startswith("-"):
            options.append(arg)
            skip_next = arg in PIP_VALUE_OPTIONS
        else:
            reqs.append(_requirement(arg))
    out.pip_options.append(options)
    (out.installed_alone if "--no-deps" in options else out.installed).extend(reqs)


@functools.cache
def _project_extras() -> dict[str, list[Requirement]]:
    """onlinerl's own requirements ("" = the base dependencies), from pyproject.toml rather than a stale install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"": [Requirement(r) for r in project["dependencies"]]}
    extras.update({k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()})
    return extras


def _requires(req: Requirement) -> list[Requirement]:
    if canonicalize_name(req.name) == PROJECT:
        return [r for extra in ("", *sorted(req.extras)) for r in _project_extras()[extra]]
    try:
        declared = metadata.distribution(req.name).requires or []
    except metadata.PackageNotFoundError:
        return []  # not in this venv (a platform-only dependency): its own dependencies are unknown here
    out = []
    for text in declared:
        dep = Requirement(text)
        if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
            out.append(dep)
    return out


def distributions(image: Dockerfile) -> frozenset[str]:
    """Canonical names of every distribution the image ends up with."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(image.installed)
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        todo += _requires(req)
    names = {name for name, _ in seen} | {canonicalize_name(r.name) for r in image.installed_alone}
    return frozenset(names - image.uninstalled)


@functools.cache
def commands(dists: frozenset[str]) -> frozenset[str]:
    """Executables the distributions install on PATH: console scripts and plain scripts (DeepSpeed's `deepspeed`)."""
    out: set[str] = set()
    for name in dists:
        if name == PROJECT:  # console scripts from pyproject.toml, whatever this venv has installed
            out |= set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out |= {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
        out |= {Path(str(f)).name for f in dist.files or [] if str(f).startswith("../../../bin/")}
    return frozenset(out)


@functools.cache
def module_distributions() -> dict[str, frozenset[str]]:
    """Top-level import name -> canonical names of the distributions that provide it (this venv's metadata)."""
    return {k: frozenset(canonicalize_name(d) for d in v) for k, v in metadata.packages_distributions().items()}


def make_env(path: str | None = None) -> dict[str, str]:
    """The environment for a `make` of our own: none of the caller's image settings or make flags (under `make test`
    MAKEFLAGS is set), optionally another PATH."""
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}
    return env if path is None else {**env, "PATH": path}


def make_images(*make_args: str, target: str = "images") -> dict[str, Path]:
    """`make -n images` (or another ``target``): image reference -> the Dockerfile it is built from (one `-t` per
    build line)."""
    out = subprocess.run(
        ["make", "-n", target, *make_args],
        cwd=ROOT,
        env=make_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    built: dict[str, Path] = {}
    for line in out.splitlines():
        argv = shlex.split(line)
        if "build" in argv and "-t" in argv and "-f" in argv:
            built[argv[argv.index("-t") + 1]] = ROOT / argv[argv.index("-f") + 1]
    return built
