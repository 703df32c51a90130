"""The guard on vLLM starts: a run starts no more engines than the plan in tests/engines.py allows.

Each engine start costs 25-40 s of CPU and a stop 5-15 s on our 2 cores, so the plan is part of ``make test``'s
budget. Two checks: the source (no test starts vLLM past the plan's entry points) and the run itself (every engine
log under this session's temporary folder, counted, against the plan for the modules that ran).
"""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest

from tests.engines import OWN_ENGINES, PLAN, REPO, RESTARTS

TESTS = REPO / "tests"
ENGINE_READY_LINE = "Starting vLLM server on http"  # vLLM's API server logs it once per start


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _called(call: ast.Call) -> str:
    """The plain function name a call names (``start_vllm(...)``), '' for methods (``pod.start_vllm()``)."""
    return call.func.id if isinstance(call.func, ast.Name) else ""


def _starts_an_engine(call: ast.Call) -> bool:
    if _called(call) == "start_own_engine":
        return True
    external = any(
        k.arg == "external_engine" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )
    return _called(call) == "start_stack" and not external


def test_no_test_starts_vllm_outside_the_plan() -> None:
    """``start_vllm`` only through tests/engines.py; ``start_own_engine``, an engine-starting ``start_stack`` and a
    shared engine's ``start_again`` only in the modules the plan lists."""
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        module = path.relative_to(REPO).as_posix()
        if module in ("tests/engines.py", "tests/test_engine_plan.py"):
            continue
        calls = _calls(ast.parse(path.read_text()))
        if any(_called(c) == "start_vllm" for c in calls):
            offenders.append(f"{module}: calls start_vllm (use a shared engine fixture or start_own_engine)")
        if any(_starts_an_engine(c) for c in calls) and module not in OWN_ENGINES:
            offenders.append(f"{module}: starts its own engine but is not in OWN_ENGINES (tests/engines.py)")
        restarts = any(isinstance(c.func, ast.Attribute) and c.func.attr == "start_again" for c in calls)
        if restarts and module not in RESTARTS:
            offenders.append(f"{module}: restarts a shared engine but is not in RESTARTS (tests/engines.py)")
    assert not offenders, "\n".join(offenders)


def test_the_plan_names_only_modules_that_exist_and_fixtures_that_are_defined() -> None:
    for module in [*OWN_ENGINES, *RESTARTS]:
        assert (REPO / module).is_file(), module
    conftest = (TESTS / "conftest.py").read_text()
    for fixture in PLAN:
        assert f"def {fixture}(" in conftest, fixture


def engine_starts(root: Path) -> dict[str, int]:
    """Engine starts by log file, read from every log under ``root`` (a restart appends to its log)."""
    counts = {}
    for log in root.rglob("*.log"):
        try:
            n = log.read_text(errors="replace").count(ENGINE_READY_LINE)
        except OSError:
            continue
        if n:
            counts[str(log.relative_to(root))] = n
    return counts


@pytest.mark.engine_plan_guard
def test_this_run_started_no_more_engines_than_planned(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Runs last (tests/conftest.py orders it): the starts of the whole session so far against the plan."""
    ran = {item.nodeid.split("::", 1)[0] for item in request.session.items}
    shared = {f for item in request.session.items for f in item.fixturenames if f in PLAN}
    allowed = len(shared) + sum(n for plan in (OWN_ENGINES, RESTARTS) for module, n in plan.items() if module in ran)
    starts = engine_starts(tmp_path_factory.getbasetemp())
    total = sum(starts.values())
    print(f"vLLM engine starts: {total} (plan allows {allowed}): {starts}")
    assert total <= allowed, f"{total} vLLM starts, the plan allows {allowed}: {starts}"


def test_a_start_past_a_modules_plan_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from onlinerl.config import from_mapping
    from tests.engines import start_own_engine

    with pytest.raises(AssertionError, match="over its plan of 0"):
        start_own_engine(__file__, from_mapping({}), tmp_path, tmp_path / "vllm.log")
    assert not (tmp_path / "vllm.log").exists()


def test_engine_starts_are_counted_from_every_log_restarts_included() -> None:
    with tempfile.TemporaryDirectory() as tmp:  # outside the session's folder, which the guard counts
        root = Path(tmp)
        (root / "a").mkdir()
        (root / "a" / "vllm.log").write_text(f"x\n{ENGINE_READY_LINE}://127.0.0.1:1\n...\n{ENGINE_READY_LINE}://:1\n")
        (root / "gateway.log").write_text("no engine here\n")
        assert engine_starts(root) == {"a/vllm.log": 2}
