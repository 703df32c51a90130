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
