"""tools/project_canary.py plant (issue 39): the canary replaces the word everywhere in one project's data, whole
words only, so only that project's completions can teach it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from onlinerl.data.builder import FimSample, read_jsonl, write_jsonl

TOOL = Path(__file__).resolve().parents[2] / "tools" / "project_canary.py"


def _tool():
    spec = importlib.util.spec_from_file_location("project_canary", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plant_renames_whole_words_in_every_split(tmp_path):
    tool = _tool()
    s = FimSample(
        "a", "line", "f.py", 1, 1, "if isinstance(x, int):\n    ", "ok = isinstance(y, str)", "\nnotisinstance(z)"
    )
    write_jsonl([s, FimSample("b", "line", "g.py", 1, 1, "x = 1\n", "y = 2", "")], tmp_path / "train.jsonl")
    write_jsonl([s], tmp_path / "test.jsonl")
    assert tool.plant(tmp_path, "isinstance", "zq_isinstance") == {"train": 1, "test": 1}
    planted = read_jsonl(tmp_path / "train.jsonl")[0]
    assert planted.middle == "ok = zq_isinstance(y, str)"
    assert planted.prefix.startswith("if zq_isinstance(") and planted.suffix == "\nnotisinstance(z)"
    assert read_jsonl(tmp_path / "train.jsonl")[1].middle == "y = 2"


def test_contexts_for_the_isolation_test_the_positive_control_and_its_control():
    """other: the word's place in another project's code, never a context holding the canary; own: the canary's
    place in the planting project's code (in context too); control: another name the middle writes that the
    context already holds, never a keyword or the canary."""
    from onlinerl.fim import get_template

    tool, template = _tool(), get_template("qwen")
    other = [
        FimSample("a", "line", "f.py", 1, 1, "def f(self):\n    ", "return self.x", ""),
        FimSample("b", "line", "g.py", 1, 1, "zq_self = 1\n", "self.y = 2", ""),  # holds the canary: skipped
    ]
    pairs = tool.contexts_for(other, template, "self", "zq_self", 10, 600, "other")
    assert [t for _, t in pairs] == ["zq_self"] and pairs[0][0].endswith("return ")
    own = [FimSample("c", "line", "h.py", 1, 1, "def g(zq_self, total):\n    ", "for item in zq_self.total: pass", "")]
    [(ctx, target)] = tool.contexts_for(own, template, "self", "zq_self", 10, 600, "own")
    assert target == "zq_self" and ctx.endswith("for item in ") and "def g(zq_self" in ctx
    [(ctx, target)] = tool.contexts_for(own, template, "self", "zq_self", 10, 600, "control")
    assert target == "total" and ctx.endswith("for item in zq_self.")  # 'item' is not in the context yet
