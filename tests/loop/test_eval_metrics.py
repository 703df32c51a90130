"""Evaluation figures that brevity cannot game, and the paired statistics, checked on hand-made figures and on
textbook values; `onlinerl eval --from-results` and `--data` on a corpus built with `onlinerl data build --corpus`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from onlinerl.data.builder import DataFileError, read_jsonl, resolve_split
from onlinerl.loop.eval_metrics import (
    FIGURES,
    EvalRecord,
    Outcome,
    _z,
    binomial_two_sided_p,
    compare,
    comparison_table,
    figures,
    mcnemar,
    outcome,
    paired_bootstrap,
    paired_table,
    sign_test,
    summarize,
    totals,
)

MIDDLES = {"a": "value = compute(x)", "b": "return value", "c": "items.append(item)", "d": "x = 1"}
# A base that writes whole lines: one whole-middle accept, one reject, one silence, one failed request.
BASE = [
    EvalRecord("a", MIDDLES["a"], "value = compute(x)"),
    EvalRecord("b", MIDDLES["b"], "print(value)"),
    EvalRecord("c", MIDDLES["c"], ""),
    EvalRecord("d", MIDDLES["d"], "x = 1", failed=True),
]
# A brief policy: four characters everywhere, every one accepted.
BRIEF = [
    EvalRecord("a", MIDDLES["a"], "valu"),
    EvalRecord("b", MIDDLES["b"], "retu"),
    EvalRecord("c", MIDDLES["c"], "item"),
    EvalRecord("d", MIDDLES["d"], "x = 1  \n"),  # trailing whitespace is not part of what the user gets
]


def test_per_version_figures_by_hand():
    s = summarize(BASE)
    assert (s.requests, s.failed, s.shown, s.accepted) == (4, 1, 2, 1)
    assert s.accept_rate == 0.5 and s.suggestion_rate == 0.5 and s.accepted_per_100 == 25.0
    assert s.accepted_chars_per_100 == 100 * 18 / 4  # 18 characters accepted over 4 requests
    assert s.mean_accepted_length == 18.0 and s.mean_shown_length == (18 + 12) / 2
    assert s.whole_middle_share == 1.0

    b = summarize(BRIEF)
    assert (b.shown, b.accepted) == (4, 4)
    assert b.accept_rate == 1.0 and b.accepted_per_100 == 100.0 and b.suggestion_rate == 1.0
    assert b.accepted_chars_per_100 == 100 * (4 + 4 + 4 + 5) / 4
    assert b.mean_accepted_length == 17 / 4 and b.mean_shown_length == 17 / 4
    assert b.whole_middle_share == 1 / 4  # only "x = 1" is the whole middle
    assert s.multi_line_share == 0.0 and b.multi_line_share == 0.0  # "x = 1  \n" is one line once trimmed


def test_multi_line_share_counts_blocks_among_the_shown():
    """Of what was shown (a silence and a failure are not), the share that is a block of two lines or more."""
    recs = [
        EvalRecord("a", MIDDLES["a"], "value = compute(x)\nreturn value"),
        EvalRecord("b", MIDDLES["b"], "return value"),
        EvalRecord("c", MIDDLES["c"], ""),
        EvalRecord("d", MIDDLES["d"], "x = 1\ny = 2", failed=True),
    ]
    assert summarize(recs).multi_line_share == 0.5


def test_brevity_raises_accept_rate_but_not_accepted_characters():
    """The issue's question, better or only shorter: the brief policy doubles the accept rate and writes less."""
    base, brief = summarize(BASE), summarize(BRIEF)
    assert brief.accept_rate > base.accept_rate and brief.accepted_per_100 > base.accepted_per_100
    assert brief.accepted_chars_per_100 < base.accepted_chars_per_100
    assert brief.mean_accepted_length < base.mean_accepted_length
    assert brief.whole_middle_share < base.whole_middle_share


def test_outcome_of_a_failed_request_shows_nothing():
    o = outcome(BASE[3])
    assert o == Outcome("d", 0, False, False)
    assert figures(totals([])) == dict.fromkeys(FIGURES, 0.0)  # empty denominators are 0, never a ZeroDivision


# --- statistics against known values -----------------------------------------------------------------------------


def test_sign_test_textbook_value():
    # 1 of 10 pairs favours one side: two-sided p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22/1024.
    assert binomial_two_sided_p(1, 10) == 22 / 1024
    assert binomial_two_sided_p(9, 10) == 22 / 1024
    assert binomial_two_sided_p(5, 10) == 1.0 and binomial_two_sided_p(0, 0) == 1.0
    t = sign_test([0, 0, 5, 3, 3], [4, 1, 2, 3, 9])
    assert (t.better, t.worse, t.ties) == (3, 1, 1) and t.p_value == 2 * (1 + 4) / 16


def test_mcnemar_textbook_values():
    # Fagerland, Lydersen & Laake (2013), BMC Med Res Methodol 13:91: 1 vs 7 discordant pairs.
    base = [True] * 1 + [False] * 7 + [True] * 4 + [False] * 9
    cand = [False] * 1 + [True] * 7 + [True] * 4 + [False] * 9
    m = mcnemar(base, cand)
    assert (m.only_base, m.only_candidate, m.both, m.neither) == (1, 7, 4, 9)
    assert m.chi2 == 4.5
    assert m.p_chi2 == pytest.approx(0.034, abs=5e-4)  # the asymptotic test
    assert m.p_exact == pytest.approx(0.070, abs=5e-4)  # the exact conditional test (= 18/256)

    # Agresti, Categorical Data Analysis, presidential approval: 794 / 150 / 86 / 570 of 1600.
    base = [True] * 794 + [True] * 150 + [False] * 86 + [False] * 570
    cand = [True] * 794 + [False] * 150 + [True] * 86 + [False] * 570
    m = mcnemar(base, cand)
    assert m.chi2 == pytest.approx(17.36, abs=0.005)
    lo, hi = m.diff_ci()
    assert (lo + hi) / 2 == pytest.approx(-0.04)  # 0.55 - 0.59
    assert (hi - lo) / 2 / _z(0.95) == pytest.approx(0.0095, abs=5e-5)  # Agresti's standard error
    assert (round(lo, 2), round(hi, 2)) == (-0.06, -0.02)


def test_normal_quantile():
    assert _z(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert _z(0.99) == pytest.approx(2.575829, abs=1e-6)


def test_bootstrap_of_a_constant_shift_is_that_shift():
    pairs = [(Outcome(str(i), 0, False, False), Outcome(str(i), 10, True, True)) for i in range(50)]
    ci = paired_bootstrap(pairs, resamples=200)
    assert ci["accepted_chars_per_100"] == (1000.0, 1000.0)
    assert ci["accept_rate"] == (1.0, 1.0) and ci["whole_middle_share"] == (1.0, 1.0)


def test_bootstrap_matches_the_normal_interval_on_a_large_sample():
    # 400 requests; the candidate gets 100 accepted (20 characters each) where the base stays silent.
    # Accepted per 100: 25 +- 1.96 * 100 * sqrt(.25 * .75 / 400) = 25 +- 4.24; characters: x20.
    pairs = [
        (Outcome(f"{i:03d}", 0, False, False), Outcome(f"{i:03d}", 20 if i < 100 else 0, i < 100, False))
        for i in range(400)
    ]
    ci = paired_bootstrap(pairs, resamples=2000, seed=1)
    half = _z(0.95) * 100 * math.sqrt(0.25 * 0.75 / 400)
    assert ci["accepted_per_100"][0] == pytest.approx(25 - half, abs=0.8)
    assert ci["accepted_per_100"][1] == pytest.approx(25 + half, abs=0.8)
    assert ci["accepted_chars_per_100"][0] == pytest.approx(20 * (25 - half), abs=16)
    assert ci["accepted_chars_per_100"][1] == pytest.approx(20 * (25 + half), abs=16)
    assert paired_bootstrap(pairs, resamples=300, seed=7) == paired_bootstrap(pairs, resamples=300, seed=7)
    lo, hi = mcnemar([a.accepted for a, _ in pairs], [b.accepted for _, b in pairs]).diff_ci()
    assert (100 * lo, 100 * hi) == pytest.approx((25 - half, 25 + half))  # Wald agrees with the formula


def test_comparison_pairs_on_sample_ids_and_reports_every_figure():
    base = [outcome(r) for r in BASE]
    brief = [outcome(r) for r in reversed(BRIEF)] + [Outcome("zz", 5, True, True)]  # order differs; one extra
    c = compare("v0", base, "v3", brief, resamples=300)
    assert c.pairs == 4  # the sample only v3 answered is left out, nothing is mis-paired
    assert [f.name for f in c.figures] == list(FIGURES)
    by = {f.name: f for f in c.figures}
    assert by["accepted_chars_per_100"].base == 450.0 and by["accepted_chars_per_100"].candidate == 425.0
    assert by["accept_rate"].diff == 0.5
    m = c.accepted
    assert (m.only_base, m.only_candidate, m.both, m.neither) == (0, 3, 1, 0)
    assert (c.accepted_chars.better, c.accepted_chars.worse, c.accepted_chars.ties) == (3, 1, 0)
    for f in c.figures:
        assert f.ci_low <= f.diff <= f.ci_high or f.ci_low == f.ci_high
    text = paired_table(c)
    assert "**v3 vs v0**, paired on 4 samples" in text
    assert "| accepted chars / 100 requests | 450 | 425 | -25 |" in text
    assert "3 only by v3, 0 only by v0, 1 by both; χ² = 3.00" in text
    assert "more from v3 on 3, fewer on 1, the same on 0; p = 0.625" in text
    json.dumps(c.as_dict())  # serialisable for summary.json


def test_version_table_has_every_figure():
    table = comparison_table({"v0": summarize(BASE), "v3": summarize(BRIEF)})
    assert "| simulated accept rate | 0.500 | 1.000 |" in table
    assert "| accepted chars / 100 requests | 450 | 425 |" in table
    assert "| accepts completing the whole middle | 1.000 | 0.250 |" in table
    for label, _ in FIGURES.values():
        assert f"| {label} |" in table


# --- the command --------------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onlinerl.cli", *args], capture_output=True, text=True, timeout=300)


def _write_run(path: Path, records: list[EvalRecord]) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))


def test_eval_from_results_recomputes_the_report(tmp_path):
    _write_run(tmp_path / "v0.jsonl", BASE)
    _write_run(tmp_path / "v12.jsonl", BRIEF)
    proc = _cli("eval", "--from-results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "comparison.md").read_text()
    assert proc.stdout.startswith(md.strip())
    png = tmp_path / "change_v12_vs_v0.png"
    assert f"plot: {png}" in proc.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| metric | v0 | v12 |" in md and "**v12 vs v0**, paired on 4 samples" in md
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["v12"]["accepted_chars_per_100"] == 425.0
    (cmp,) = summary["comparisons"]
    assert (cmp["base"], cmp["candidate"], cmp["pairs"]) == ("v0", "v12", 4)
    assert cmp["figures"]["accept_rate"]["diff"] == 0.5 and len(cmp["figures"]["accept_rate"]["ci"]) == 2
    assert cmp["mcnemar_accepted"]["only_candidate"] == 3


def test_eval_from_results_judges_by_the_users_rule(tmp_path):
    """The records hold what was shown, not the verdict: the same run re-judged by users who dismiss short
    suggestions accepts fewer, and the report says so (a project is evaluated by the users it trained on)."""
    _write_run(tmp_path / "v0.jsonl", BASE)
    _write_run(tmp_path / "v12.jsonl", BRIEF)
    default = _cli("eval", "--from-results", str(tmp_path), "--out", str(tmp_path / "default"))
    strict = _cli(
        "eval", "--from-results", str(tmp_path), "--out", str(tmp_path / "strict"), "--min-prefix-chars", "40"
    )
    assert default.returncode == 0 and strict.returncode == 0, default.stderr + strict.stderr
    before = json.loads((tmp_path / "default" / "summary.json").read_text())["v12"]["accepted"]
    after = json.loads((tmp_path / "strict" / "summary.json").read_text())["v12"]["accepted"]
    assert before > after


def test_eval_from_results_runs_picks_the_base(tmp_path):
    """--runs compares any two runs of one evaluation (a project's adapter with the shared policy), the first the
    base; a name that is not a run there, or a path out of it, says which runs there are."""
    _write_run(tmp_path / "v0.jsonl", BASE)
    _write_run(tmp_path / "alpha-v12.jsonl", BRIEF)
    _write_run(tmp_path / "v7.jsonl", BASE)
    proc = _cli("eval", "--from-results", str(tmp_path), "--runs", "v7,alpha-v12", "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr
    (cmp,) = json.loads((tmp_path / "cmp" / "summary.json").read_text())["comparisons"]
    assert (cmp["base"], cmp["candidate"], cmp["pairs"]) == ("v7", "alpha-v12", 4)
    for bad in ("v7,beta-v3", "v7", "v7,../v0"):
        proc = _cli("eval", "--from-results", str(tmp_path), "--runs", bad)
        assert proc.returncode == 2 and "there: alpha-v12, v0, v7" in proc.stderr, proc.stderr


def test_eval_from_results_hostile_inputs(tmp_path):
    proc = _cli("eval", "--from-results", str(tmp_path))
    assert proc.returncode == 2 and "--from-results: no v<N>.jsonl files" in proc.stderr
    proc = _cli("eval", "--from-results", str(tmp_path), "--single-line", "--whole-blocks")  # users who take nothing
    assert proc.returncode == 2 and "not allowed with argument --single-line" in proc.stderr, proc.stderr
    good = json.dumps(asdict(BASE[0]))
    cases = {
        '{"sample_id": "a", "middle": "x"}': "missing fields ['shown']",
        '{"sample_id": "a", "middle": "x", "shown": "x", "forged": true}': "unknown fields ['forged']",
        '{"sample_id": "a", "middle": "x", "shown": 5}': "field 'shown' must be str, got int",
        '{"sample_id": "a", "middle": "x", "shown": "x", "version": true}': "field 'version' must be int",
        "[1]": "expected a JSON object",
        "{oops": "v0.jsonl:2 is not an eval record",
    }
    for line, message in cases.items():
        (tmp_path / "v0.jsonl").write_text(good + "\n" + line + "\n")
        proc = _cli("eval", "--from-results", str(tmp_path))
        assert proc.returncode == 2 and "v0.jsonl:2 is not an eval record" in proc.stderr, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


# --- --data: any corpus built with `onlinerl data build --corpus` ------------------------------------------------


@pytest.fixture(scope="module")
def yaml_corpus(tmp_path_factory) -> Path:
    """The pure-Python sources of PyYAML (an installed PyPI package the project never trains on), evaluation only."""
    src = Path(importlib.util.find_spec("yaml").origin).parent
    out = tmp_path_factory.mktemp("yaml-data")
    proc = _cli("data", "build", "--corpus", str(src), "--test-fraction", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_a_package_corpus_builds_for_evaluation_only(yaml_corpus):
    test = read_jsonl(resolve_split(yaml_corpus, "test"))
    assert read_jsonl(yaml_corpus / "train.jsonl") == []  # --test-fraction 1: every file is held out
    assert len(test) >= 100 and len({s.file for s in test}) >= 10
    src = Path(importlib.util.find_spec("yaml").origin).parent
    for s in test[:50]:
        assert s.prefix + s.middle + s.suffix in (src / s.file).read_text(encoding="utf-8")
    assert resolve_split(yaml_corpus / "test.jsonl", "train") == yaml_corpus / "test.jsonl"  # a file is a file


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_data_build_rejects_an_out_of_range_test_fraction(tmp_path, fraction):
    proc = _cli("data", "build", "--corpus", str(tmp_path), "--test-fraction", fraction, "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and f"--test-fraction must be in (0, 1], got {float(fraction)}" in proc.stderr


def test_read_jsonl_names_the_file_and_line_of_a_bad_sample(tmp_path, yaml_corpus):
    good = (yaml_corpus / "test.jsonl").read_text().splitlines()[0]
    cases = {
        "not json": "not JSON",
        "[1, 2]": "expected a JSON object",
        json.dumps({**json.loads(good), "extra": 1}): "unknown ['extra']",
        json.dumps({k: v for k, v in json.loads(good).items() if k != "middle"}): "missing ['middle']",
        json.dumps({**json.loads(good), "start_line": "3"}): "field 'start_line' must be int",
        json.dumps({**json.loads(good), "middle": True}): "field 'middle' must be str",
    }
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(good + "\n\n" + line + "\n")
        with pytest.raises(DataFileError, match=rf"bad\.jsonl:3: .*{message}".replace("[", r"\[").replace("(", r"\(")):
            read_jsonl(path)


def test_eval_data_pointing_at_meta_json_fails_with_file_and_line(tmp_path, yaml_corpus):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("job: t\n")
    common = ("--config", str(cfg), "eval", "--api-key", "k", "--template", "starcoder", "--data")
    proc = _cli(*common, str(yaml_corpus / "meta.json"))
    assert proc.returncode == 2, proc.stderr
    assert "meta.json:1: not JSON" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli(*common, str(tmp_path))  # a directory without splits
    assert proc.returncode == 2 and f"{tmp_path / 'test.jsonl'} not found" in proc.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_eval_runs_on_a_package_corpus_through_the_real_gateway(tiny_lora_engine, tmp_path, yaml_corpus):
    """`onlinerl eval --data <data build --out dir>` against a real serving stack (the gateway and reloader of `onlinerl
    up`, on the session's tiny-model engine): evaluation needs no trainer and no feedback service, so none starts."""
    from onlinerl.config import OnlineRLConfig
    from onlinerl.loop.stack import LocalPorts, start_stack
    from onlinerl.valkey import free_port

    cfg = OnlineRLConfig.model_validate(
        {
            "job": "evalcorpus",
            "model": {"path": str(tiny_lora_engine.model_path), "fimTemplate": "plain", "maxModelLen": 1024},
            "serving": {"port": free_port(), "engineUrl": tiny_lora_engine.url},
            "rollout": {"strategy": "direct"},
        }
    )
    state = tmp_path / "stack"
    running = start_stack(
        cfg,
        state,
        build_data=False,
        ports=LocalPorts(redis=free_port(), reloader=free_port(), rollout=free_port()),
        serving_only=True,
        external_engine=True,
    )
    try:
        out = tmp_path / "eval"
        args = [
            "--versions",
            "0,stable,latest",
            "--limit",
            "6",
            "--max-tokens",
            "8",
            "--concurrency",
            "2",
            "--out",
            str(out),
        ]
        proc = _cli("eval", "--state", str(state), "--data", str(yaml_corpus), *args)
    finally:
        running.stop()
    assert proc.returncode == 0, proc.stderr
    held_out = {s.id for s in read_jsonl(yaml_corpus / "test.jsonl")}
    records = [json.loads(line) for line in (out / "v0.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {r["sample_id"] for r in records} <= held_out
    assert not any(r["failed"] for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["v0"]["requests"], summary["v0"]["failed"]) == (6, 0)
    assert (
        set(FIGURES) <= set(summary["v0"]) and summary["comparisons"] == []
    )  # stable and latest are v0: nothing to compare


def test_versions_name_the_served_and_the_newest_policy_in_order_once():
    """`stable` is what users get, `latest` the trainer's newest: under a canary they differ, and both are reported."""
    from onlinerl.commands.eval import resolve_versions
    from onlinerl.errors import CommandError

    asked: list[str] = []

    def newest() -> int:
        asked.append("latest")
        return 44

    def served() -> int:
        asked.append("stable")
        return 32

    assert resolve_versions("0,stable,latest", newest, served) == [0, 32, 44]
    assert resolve_versions(" 0 , 7 ", newest, served) == [0, 7] and asked == ["stable", "latest"]  # read when named
    assert resolve_versions("0,stable,0,32", newest, lambda: 0) == [0, 32]  # the base once, first
    for bad in ("0,newest", "0,-1", "0,", "v3"):
        with pytest.raises(CommandError, match="is not a version"):
            resolve_versions(bad, newest, served)


def test_versions_of_a_project_line_are_pinned_with_that_projects_key_only():
    """Issue 39: `alpha:latest` is alpha's own adapter line; the shared line's versions keep their plain names, and
    a project other than the evaluating key's is refused (the gateway would answer 403 wrong_project)."""
    from onlinerl.commands.eval import resolve_line_versions, run_name
    from onlinerl.errors import CommandError

    newest = {"": 44, "alpha": 9}
    served = {"": 32, "alpha": 7}
    runs = resolve_line_versions("0,latest,alpha:latest,alpha:stable,alpha:9", newest.get, served.get, "alpha")
    assert runs == [("", 0), ("", 44), ("alpha", 9), ("alpha", 7)]
    assert [run_name(*r) for r in runs] == ["v0", "v44", "alpha-v9", "alpha-v7"]
    with pytest.raises(CommandError, match="--tenant beta"):
        resolve_line_versions("0,beta:latest", newest.get, served.get, "alpha")
    with pytest.raises(CommandError, match="is not a version"):
        resolve_line_versions("alpha:newest", newest.get, served.get, "alpha")
