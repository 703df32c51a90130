"""Each component lives in its own room: the shared library imports no service, no service imports a sibling, and
the shared library has no import cycle. Checked on the source (every import statement, lazy ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "onlinerl"
# Importable name -> folder of every component package (the folder is the component's room).
COMPONENTS = {
    "onlinerl_serving": ROOT / "services" / "serving" / "onlinerl_serving",
    "onlinerl_feedback": ROOT / "services" / "feedback" / "onlinerl_feedback",
    "onlinerl_trainer": ROOT / "services" / "trainer" / "onlinerl_trainer",
    "onlinerl_rollout": ROOT / "services" / "rollout" / "onlinerl_rollout",
    "onlinerl_operator": ROOT / "operator" / "onlinerl_operator",
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved against ``package``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def module_name(path: Path, root: Path, top: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([top, *parts])


def test_component_folders_hold_exactly_one_package_and_are_not_importable_themselves() -> None:
    for name, folder in COMPONENTS.items():
        if not folder.exists():
            continue
        assert (folder / "__init__.py").is_file(), f"{folder} must be the package {name}"
        assert not (folder.parent / "__init__.py").exists(), f"{folder.parent} must not be importable itself"


def test_the_shared_library_imports_no_component() -> None:
    offenders = []
    for path in sorted(SHARED.rglob("*.py")):
        package = module_name(path.parent / "__init__.py", SHARED, "onlinerl")
        for module in imported_modules(path, package):
            if module.split(".")[0] in COMPONENTS:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, "the shared library must not import a service:\n" + "\n".join(offenders)


def test_no_component_imports_a_sibling_component() -> None:
    offenders = []
    for name, folder in COMPONENTS.items():
        for path in sorted(folder.rglob("*.py")) if folder.exists() else ():
            for module in imported_modules(path, name):
                top = module.split(".")[0]
                if top in COMPONENTS and top != name:
                    offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, "components talk through onlinerl/ contracts, never by importing each other:\n" + "\n".join(
        offenders
    )


def test_the_shared_library_has_no_import_cycle() -> None:
    modules = {module_name(p, SHARED, "onlinerl"): p for p in SHARED.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in imported_modules(path, package) if m in modules and m != name}

    # A package imports its parent package's __init__ implicitly: only edges between modules count here.
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    assert not cycles, "import cycles in onlinerl/:\n" + "\n".join(" -> ".join(c) for c in cycles)
