"""A Python started at the repository root sees the standard library, not our component folders (issue 17).

Each component folder (services/<x>/, operator/) holds one package named onlinerl_<x>; none is importable itself.
`operator/` used to be, and shadowed the standard library's `operator`, so even `python -c "import json"` failed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_at_root(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_import_json_from_the_repository_root() -> None:
    done = run_at_root("import json, operator; print(json.dumps({'ok': operator.add(1, 2)}))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"ok": 3}'


def test_the_standard_library_wins_for_every_module_it_owns() -> None:
    """No folder or module at the root takes a standard-library name (the hostile version: all of them)."""
    shadowing = sorted(
        p.name
        for p in ROOT.iterdir()
        if p.name.removesuffix(".py") in sys.stdlib_module_names and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    assert shadowing == []


def test_component_packages_import_under_their_own_names() -> None:
    done = run_at_root(
        "import onlinerl_serving, onlinerl_feedback, onlinerl_operator, operator; print(operator.__file__)"
    )
    assert done.returncode == 0, done.stderr
    assert str(ROOT) not in done.stdout, done.stdout
