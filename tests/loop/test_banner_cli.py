"""`onlinerl up`'s banner names the CLI as the user can type it: `make run` starts ``.venv/bin/onlinerl up`` without
activating the venv, so a bare ``onlinerl status`` answered "command not found" to a newcomer (found trying `make run`
as a new user, issue 36)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onlinerl.loop.stack import cli_command


def test_off_path_the_banner_names_the_venvs_cli_by_a_path_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Path(sys.executable).parents[2]  # the checkout whose .venv runs this test
    monkeypatch.chdir(repo)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    typed = cli_command()
    assert typed == os.path.relpath(Path(sys.executable).parent / "onlinerl")
    assert not os.path.isabs(typed) and typed.endswith("onlinerl")
    done = subprocess.run([typed, "status", "--help"], capture_output=True, text=True, timeout=60, cwd=repo)
    assert done.returncode == 0 and "usage: onlinerl status" in done.stdout, done.stderr


def test_on_path_the_banner_says_plain_onlinerl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin")
    assert cli_command() == "onlinerl"
