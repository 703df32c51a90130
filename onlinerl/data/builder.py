"""FIM data set from real Python source, cut on AST boundaries.

Each sample is a cursor position in a real file: ``prefix`` (text before), ``middle`` (what a good completion would
insert), ``suffix`` (text after). Middles come in four kinds, the shapes a Tab model meets in an editor:

* ``line``          a whole simple statement on one line (cursor at its indentation)
* ``rest_of_line``  the remainder of a statement line (cursor after some of its tokens)
* ``block``         two to six consecutive statements of one body
* ``function_body`` the whole body of a short function (cursor after the ``def`` line)

Output is deterministic for a seed, de-duplicated on (context, middle), filtered by length, carries provenance
(file, line range, kind) and splits train/test by *file*, so no source file is in both.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("line", "rest_of_line", "block", "function_body")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib2to3"}


@dataclass(frozen=True)
class FimSample:
    id: str
    kind: str
    file: str
    start_line: int
    end_line: int
    prefix: str
    middle: str
    suffix: str


@dataclass
class BuildOptions:
    corpus: Path | None = None
    seed: int = 0
    test_fraction: float = 0.15
    per_file: int = 12
    max_prefix_chars: int = 1200
    max_suffix_chars: int = 400
    min_middle_chars: int = 4
    max_middle_chars: int = 400
    max_middle_lines: int = 12
    kinds: tuple[str, ...] = KINDS
    max_files: int | None = None
    skip_dirs: set[str] = field(default_factory=lambda: set(SKIP_DIRS))


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_source_files(root: Path, skip_dirs: set[str]) -> list[Path]:
    """Every ``.py`` file under ``root`` in a stable order, skipping third-party and test folders."""
    return sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & skip_dirs))


def _stable_int(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def _line_starts(text: str) -> list[int]:
    starts, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _candidates(tree: ast.AST, lines: list[str]) -> Iterator[tuple[str, int, int]]:
    """``(kind, first_line, last_line)`` spans (1-based, inclusive) on statement boundaries."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first, last = body[0], body[-1]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                body = body[1:]  # skip the docstring: a completion rarely writes it
            if body and first.lineno > node.lineno:
                yield "function_body", body[0].lineno, last.end_lineno or last.lineno
        if not isinstance(body, list):
            continue
        stmts = [s for s in body if isinstance(s, ast.stmt)]
        for i, s in enumerate(stmts):
            end = s.end_lineno or s.lineno
            if end == s.lineno and not isinstance(s, ast.Pass | ast.Expr | ast.Import | ast.ImportFrom):
                yield "line", s.lineno, end
                yield "rest_of_line", s.lineno, end
            if i + 1 < len(stmts):
                j = min(len(stmts) - 1, i + 1 + (_stable_int(s.lineno, i) % 5))
                last = stmts[j]
                yield "block", s.lineno, last.end_lineno or last.lineno


def _cut(
    text: str, starts: list[int], lines: list[str], kind: str, a: int, b: int, rng: random.Random
) -> tuple[int, int] | None:
    """Character range ``[lo, hi)`` of the middle for a span, or None when the span does not fit."""
    line = lines[a - 1]
    indent = len(line) - len(line.lstrip())
    lo = starts[a - 1] + indent
    hi = starts[b - 1] + len(lines[b - 1].rstrip("\r\n"))
    if kind == "rest_of_line":
        body = line.rstrip("\r\n")[indent:]
        cuts = [i for i, ch in enumerate(body) if i > 0 and body[i - 1] in " (=,.[:" and i < len(body) - 2]
        if not cuts:
            return None
        lo += rng.choice(cuts)
    return (lo, hi) if hi > lo else None


def samples_from_file(path: Path, rel: str, opts: BuildOptions) -> list[FimSample]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    starts = _line_starts(text)
    rng = random.Random(_stable_int(opts.seed, rel))
    spans = sorted({c for c in _candidates(tree, lines) if c[0] in opts.kinds})
    rng.shuffle(spans)
    out: list[FimSample] = []
    per_kind: dict[str, int] = {}
    quota = max(1, opts.per_file // len(opts.kinds) + 1)
    for kind, a, b in spans:
        if len(out) >= opts.per_file or per_kind.get(kind, 0) >= quota:
            continue
        if b - a + 1 > opts.max_middle_lines:
            continue
        cut = _cut(text, starts, lines, kind, a, b, rng)
        if cut is None:
            continue
        lo, hi = cut
        middle = text[lo:hi]
        if not (opts.min_middle_chars <= len(middle.strip()) and len(middle) <= opts.max_middle_chars):
            continue
        prefix = text[max(0, lo - opts.max_prefix_chars) : lo]
        suffix = text[hi : hi + opts.max_suffix_chars]
        sid = hashlib.sha256(f"{rel}:{lo}:{hi}:{kind}".encode()).hexdigest()[:16]
        out.append(FimSample(sid, kind, rel, a, b, prefix, middle, suffix))
        per_kind[kind] = per_kind.get(kind, 0) + 1
    return out


def is_test_file(rel: str, seed: int, test_fraction: float) -> bool:
    """Split by file: a stable hash of the path decides, so no file is in both splits for any seed."""
    return (_stable_int("split", seed, rel) % 10_000) < test_fraction * 10_000


def build(opts: BuildOptions, progress=None) -> tuple[list[FimSample], list[FimSample]]:
    """``(train, test)``: deterministic for ``opts.seed``, de-duplicated, split by source file."""
    root = (opts.corpus or stdlib_dir()).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} does not exist")
    files = iter_source_files(root, opts.skip_dirs)
    if opts.max_files:
        files = files[: opts.max_files]
    seen: set[str] = set()
    train: list[FimSample] = []
    test: list[FimSample] = []
    for i, path in enumerate(files):
        rel = path.relative_to(root).as_posix()
        target = test if is_test_file(rel, opts.seed, opts.test_fraction) else train
        for s in samples_from_file(path, rel, opts):
            key = hashlib.sha256(f"{s.prefix[-200:]}\x00{s.middle}\x00{s.suffix[:100]}".encode()).hexdigest()
            if key in seen:
                continue
            seen.add(key)
            target.append(s)
        if progress:
            progress(i + 1, len(files))
    return train, test


def write_jsonl(samples: list[FimSample], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(asdict(s), ensure_ascii=False) + "\n")


class DataFileError(ValueError):
    """A split file that is not what ``onlinerl data build`` writes; the message names the file and line."""


_FIELD_TYPES = {
    "id": str,
    "kind": str,
    "file": str,
    "start_line": int,
    "end_line": int,
    "prefix": str,
    "middle": str,
    "suffix": str,
}


def _sample(obj: object, where: str) -> FimSample:
    if not isinstance(obj, dict):
        raise DataFileError(f"{where}: expected a JSON object (one FIM sample per line), got {type(obj).__name__}")
    missing, unknown = set(_FIELD_TYPES) - set(obj), set(obj) - set(_FIELD_TYPES)
    if missing or unknown:
        raise DataFileError(
            f"{where}: not a FIM sample (missing {sorted(missing)}, unknown {sorted(unknown)}); "
            "build splits with `onlinerl data build --corpus DIR --out DIR`"
        )
    for name, kind in _FIELD_TYPES.items():
        if not isinstance(obj[name], kind) or isinstance(obj[name], bool):
            raise DataFileError(f"{where}: field {name!r} must be {kind.__name__}, got {type(obj[name]).__name__}")
    return FimSample(**obj)


def read_jsonl(path: Path) -> list[FimSample]:
    """Samples of a split file, validated line by line (a wrong ``--data`` file fails with its file and line)."""
    out: list[FimSample] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DataFileError(f"{path}:{n}: not JSON ({exc})") from None
            out.append(_sample(obj, f"{path}:{n}"))
    return out


def resolve_split(path: Path, split: str) -> Path:
    """The split file for ``--data``: the path itself, or ``<dir>/<split>.jsonl`` for a ``data build --out`` dir."""
    return path / f"{split}.jsonl" if path.is_dir() else path
