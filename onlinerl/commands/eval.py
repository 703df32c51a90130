"""``onlinerl eval``: compare policy versions on the held-out split through the serving path."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from onlinerl.commands.simulate import accept_rule, add_client_args, make_client_factory

if TYPE_CHECKING:
    from onlinerl.loop.user_model import AcceptRule


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="offline evaluation of policy versions (held-out split)")
    add_client_args(p, split="test")
    p.add_argument(
        "--versions",
        default="0,latest",
        help="comma list of versions; `latest` = newest loaded, `stable` = what the policy table serves users; "
        "`PROJECT:V` (e.g. alpha:latest) is a version of that project's own adapter line, evaluated with that "
        "project's eval key (--tenant PROJECT); the first is the base every other is compared with",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: <state>/eval)")
    p.add_argument(
        "--timeline", type=Path, default=None, help="simulate timeline to plot (default: <state>/timeline.jsonl)"
    )
    p.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL of an LLM judge (optional)")
    p.add_argument("--judge-model", default=None)
    p.add_argument("--judge-key", default="")
    p.add_argument(
        "--from-results",
        type=Path,
        default=None,
        help="recompute the report from the v<N>.jsonl files an earlier `onlinerl eval` wrote (no stack needed; "
        "the lowest version is the base)",
    )
    p.add_argument(
        "--runs",
        default=None,
        help="with --from-results: the runs to compare, in order, by the names of their files (e.g. v22,alpha-v15 "
        "compares project alpha's adapter with the shared v22 on the same samples); the first is the base",
    )
    p.set_defaults(func=_eval)


def resolve_versions(spec: str, latest: Callable[[], int], stable: Callable[[], int]) -> list[int]:
    """``--versions`` as numbers, in order and without repeats (the first is the base every other is compared with).

    ``latest`` (the trainer's newest loaded version) and ``stable`` (the version users get) are read only when named:
    under a canary they differ, and what users were served is the figure the product promises."""
    from onlinerl.errors import CommandError

    named = {"latest": latest, "stable": stable}
    out: list[int] = []
    for token in (t.strip() for t in spec.split(",")):
        if token in named:
            out.append(named[token]())
        elif token.isdigit():
            out.append(int(token))
        else:
            raise CommandError(f"--versions: {token!r} is not a version (a number, `latest` or `stable`)")
    return list(dict.fromkeys(out))


def resolve_line_versions(
    spec: str, latest: Callable[[str], int], stable: Callable[[str], int], tenant: str | None
) -> list[tuple[str, int]]:
    """``--versions`` with policy lines: ``[(line, version)]`` in order, without repeats; ``''`` is the shared line.
    A project line's versions are pinned with that project's own key, so every project named must be ``tenant``."""
    from onlinerl.errors import CommandError

    out: list[tuple[str, int]] = []
    for token in (t.strip() for t in spec.split(",")):
        line, _, version = token.rpartition(":")
        if line and line != tenant:
            raise CommandError(
                f"--versions: {token!r} is a version of project {line!r}'s line: evaluate it with that project's "
                f"key (--tenant {line}); one evaluation compares one project's line with the shared one"
            )
        out += [(line, v) for v in resolve_versions(version, lambda ln=line: latest(ln), lambda ln=line: stable(ln))]
    return list(dict.fromkeys(out))


def run_name(line: str, version: int) -> str:
    """A run's name in the report and its results file: ``v3`` on the shared line, ``alpha-v3`` on alpha's."""
    return f"{line}-v{version}" if line else f"v{version}"


def _read_table(cfg, read: Callable, line: str = "") -> int:
    """``read(client, keys)`` on a short-lived connection to the job's Redis (``line``'s keys)."""
    from onlinerl.keys import Keys
    from onlinerl.redisconn import connect as redis_connect

    r = redis_connect(cfg.redis)
    try:
        keys = Keys(cfg.job)
        return read(r, keys.for_project(line) if line else keys)
    finally:
        r.close()


def stable_version(cfg, line: str = "") -> int:
    from onlinerl.dataplane import policy

    return _read_table(cfg, lambda r, keys: policy.read(r, keys).stable, line)


def latest_loaded_version(cfg, line: str = "") -> int:
    from onlinerl.dataplane import versions

    return _read_table(cfg, lambda r, keys: max(versions.read(r, keys).loaded(), default=0), line)


@contextlib.contextmanager
def held_versions(cfg, versions: list[int], timeout_s: float = 180.0, line: str = "") -> Iterator[None]:
    """Hold ``versions`` of ``line`` loaded for the evaluation (:mod:`onlinerl.dataplane.holds`) and wait until
    serving has them.

    Without it a trainer that keeps publishing gets the evaluated version retired mid-run (409 per request).
    """
    from onlinerl.dataplane import versions as version_states
    from onlinerl.dataplane.holds import hold, release
    from onlinerl.keys import Keys
    from onlinerl.procs import wait_for
    from onlinerl.redisconn import connect as redis_connect

    keys = Keys(cfg.job).for_project(line) if line else Keys(cfg.job)
    r = redis_connect(cfg.redis)
    held = hold(r, keys, versions)
    try:

        def loaded() -> bool:
            return set(held) <= version_states.read(r, keys).loaded()

        if held:
            where = f" of project {line}'s line" if line else ""
            print(f"[eval] holding versions {held}{where} loaded while evaluating", file=sys.stderr)
            wait_for(loaded, timeout=timeout_s, interval=1.0, what=f"serving to load held versions {held}{where}")
        yield
    finally:
        release(r, keys, held)
        r.close()


def _eval(args: argparse.Namespace) -> int:
    if args.from_results is not None:
        return _report_from_results(args.from_results, args.out, accept_rule(args), args.runs)
    cfg, samples, factory = make_client_factory(args, "test")
    runs = resolve_line_versions(
        args.versions,
        lambda line: latest_loaded_version(cfg, line),
        lambda line: stable_version(cfg, line),
        getattr(args, "tenant", None),
    )
    out = args.out or args.state / "eval"
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as holding:
        for line in dict.fromkeys(line for line, _ in runs):
            holding.enter_context(held_versions(cfg, [v for ln, v in runs if ln == line], line=line))
        return _run_eval(args, cfg, samples, factory, runs, out)


def _run_eval(args, cfg, samples, factory, runs_wanted: list[tuple[str, int]], out: Path) -> int:
    from onlinerl.loop.evaluate import run_version

    runs, judged = {}, {}
    for line, v in runs_wanted:  # resolve_line_versions: in order, each once
        done = {"n": 0}
        name = run_name(line, v)

        def tick(total=len(samples), name=name, done=done) -> None:
            done["n"] += 1
            if sys.stderr.isatty():
                print(f"\r[eval] {name}: {done['n']}/{total}", end="", file=sys.stderr, flush=True)
            elif done["n"] % max(1, total // 10) == 0 or done["n"] == total:  # a log file gets a line per 10%
                print(f"[eval] {name}: {done['n']}/{total}", file=sys.stderr, flush=True)

        def on_line(uid: int, line=line):
            client = factory(uid)
            client.pin_line = line  # a project line's version is pinned on that line (X-OnlineRL-Line)
            return client

        run = asyncio.run(run_version(samples, on_line, v, args.concurrency, tick, args.max_prefix_chars))
        print(file=sys.stderr)
        runs[name] = run.records
        with open(out / f"{name}.jsonl", "w") as f:
            for r in run.records:
                f.write(json.dumps(r.__dict__) + "\n")
        if args.judge_url:
            judged[name] = asyncio.run(_judge_all(args, samples, run.records))
    write_report(runs, out, judged, accept_rule(args))
    timeline = args.timeline or args.state / "timeline.jsonl"
    if timeline.is_file():
        from onlinerl.loop.plots import plot_accept_rate

        png = plot_accept_rate(timeline, out / "accept_rate.png", title="simulated accept rate during online training")
        print(f"plot: {png}")
    print(f"results: {out}")
    return 0


def write_report(runs: dict, out: Path, judged: dict | None = None, rule: AcceptRule | None = None) -> str:
    """Per-version figures and, for each version after the first, its paired comparison with the first, each
    completion judged by ``rule`` (the simulated users' Tab rule; default: ``AcceptRule()``).

    Writes ``comparison.md`` and ``summary.json`` under ``out``; returns the markdown (also printed).
    """
    from onlinerl.loop.eval_metrics import compare, comparison_table, outcome, paired_table, summarize
    from onlinerl.loop.user_model import AcceptRule

    judged = judged or {}
    rule = rule or AcceptRule()
    summaries = {name: summarize(records, rule) for name, records in runs.items()}
    table = comparison_table(summaries)
    if judged:
        table += (
            "\n| judge score (0-10) | "
            + " | ".join(f"{judged[k]:.3f}" if judged.get(k) is not None else "n/a" for k in summaries)
            + " |"
        )
    names = list(runs)
    outcomes = {name: [outcome(r, rule) for r in records] for name, records in runs.items()}
    comparisons = [compare(names[0], outcomes[names[0]], name, outcomes[name]) for name in names[1:]]
    text = "\n\n".join([table, *(paired_table(c) for c in comparisons)])
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(text + "\n")
    summary = {k: s.as_dict() for k, s in summaries.items()} | {"judge": judged}
    summary["comparisons"] = [c.as_dict() for c in comparisons]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(text)
    if comparisons:
        from onlinerl.loop.plots import plot_comparison

        for c in comparisons:
            print(f"plot: {plot_comparison(c, out / f'change_{c.candidate}_vs_{c.base}.png')}")
    return text


def _report_from_results(results: Path, out: Path | None, rule: AcceptRule, names: str | None = None) -> int:
    """Recompute the report from a finished evaluation's ``v<N>.jsonl`` files: no stack, no model. ``rule`` may differ
    from the one the evaluation was first reported with: the records hold what was shown, not the verdict.
    The lowest version is the base every other one is compared with; ``names`` (comma list of file stems, e.g.
    ``v22,alpha-v15``) picks the runs and their order instead, the first being the base.
    """
    from onlinerl.errors import CommandError
    from onlinerl.loop.eval_metrics import record_from_dict

    if names:
        files = [results / f"{name.strip()}.jsonl" for name in names.split(",") if name.strip()]
        missing = [p.name for p in files if not p.is_file() or p.parent != results]
        if missing or len(files) < 2:
            have = ", ".join(sorted(p.stem for p in results.glob("*.jsonl"))) or "none"
            raise CommandError(
                f"--runs {names}: give two or more runs of {results} by name (missing: {missing or 'none'}; "
                f"there: {have})"
            )
    else:
        files = sorted((p for p in results.glob("v*.jsonl") if p.stem[1:].isdigit()), key=lambda p: int(p.stem[1:]))
    if not files:
        raise CommandError(f"--from-results: no v<N>.jsonl files in {results} (the directory `onlinerl eval` wrote)")
    runs = {}
    for path in files:
        records = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(record_from_dict(json.loads(line)))
            except ValueError as exc:
                raise CommandError(f"--from-results: {path}:{n} is not an eval record ({exc})") from None
        runs[path.stem] = records
    write_report(runs, out or results, rule=rule)
    return 0


async def _judge_all(args, samples, records) -> float | None:
    import httpx

    from onlinerl.loop.judge import judge

    by_id = {s.id: s for s in samples}
    scores = []
    async with httpx.AsyncClient(timeout=60) as http:
        for r in records:
            s = by_id[r.sample_id]
            score = await judge(http, args.judge_url, args.judge_model, args.judge_key, s.prefix, s.suffix, r.shown)
            if score is not None:
                scores.append(score)
    return sum(scores) / len(scores) if scores else None
