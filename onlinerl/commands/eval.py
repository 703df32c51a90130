"""``onlinerl eval``: compare policy versions on the held-out split through the serving path."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from onlinerl.commands.simulate import add_client_args, make_client_factory


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="offline evaluation of policy versions (held-out split)")
    add_client_args(p, split="test")
    p.add_argument("--versions", default="0,latest", help="comma list of versions; `latest` = newest loaded")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: <state>/eval)")
    p.add_argument(
        "--timeline", type=Path, default=None, help="simulate timeline to plot (default: <state>/timeline.jsonl)"
    )
    p.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL of an LLM judge (optional)")
    p.add_argument("--judge-model", default=None)
    p.add_argument("--judge-key", default="")
    p.set_defaults(func=_eval)


def latest_loaded_version(cfg) -> int:
    import redis

    from onlinerl.keys import Keys
    from onlinerl.schemas import PolicyVersionState

    r = redis.Redis.from_url(cfg.redis.url)
    try:
        states = [PolicyVersionState.from_json(v) for v in r.hvals(Keys(cfg.job).versions)]
    finally:
        r.close()
    loaded = [s.version for s in states if s.state == "loaded"]
    return max(loaded, default=0)


@contextlib.contextmanager
def held_versions(cfg, versions: list[int], timeout_s: float = 180.0) -> Iterator[None]:
    """Hold ``versions`` loaded for the evaluation (see :mod:`onlinerl.holds`) and wait until serving has them.

    Without it a trainer that keeps publishing gets the evaluated version retired mid-run (409 per request).
    """
    import redis

    from onlinerl.holds import hold, release
    from onlinerl.keys import Keys
    from onlinerl.procs import wait_for
    from onlinerl.schemas import PolicyVersionState

    keys = Keys(cfg.job)
    r = redis.Redis.from_url(cfg.redis.url)
    held = hold(r, keys.holds, versions)
    try:

        def loaded() -> bool:
            states = {s.version: s.state for s in map(PolicyVersionState.from_json, r.hvals(keys.versions))}
            return all(states.get(v) == "loaded" for v in held)

        if held:
            print(f"[eval] holding versions {held} loaded while evaluating", file=sys.stderr)
            wait_for(loaded, timeout=timeout_s, interval=1.0, what=f"serving to load held versions {held}")
        yield
    finally:
        release(r, keys.holds, held)
        r.close()


def _eval(args: argparse.Namespace) -> int:

    cfg, samples, factory = make_client_factory(args, "test")
    versions = [latest_loaded_version(cfg) if v.strip() == "latest" else int(v) for v in args.versions.split(",")]
    out = args.out or args.state / "eval"
    out.mkdir(parents=True, exist_ok=True)
    with held_versions(cfg, versions):
        return _run_eval(args, cfg, samples, factory, versions, out)


def _run_eval(args, cfg, samples, factory, versions: list[int], out: Path) -> int:
    from onlinerl.loop.eval_metrics import comparison_table, summarize
    from onlinerl.loop.evaluate import run_version

    summaries, judged = {}, {}
    for v in dict.fromkeys(versions):
        done = {"n": 0}

        def tick(total=len(samples), v=v, done=done) -> None:
            done["n"] += 1
            if sys.stderr.isatty():
                print(f"\r[eval] v{v}: {done['n']}/{total}", end="", file=sys.stderr, flush=True)
            elif done["n"] % max(1, total // 10) == 0 or done["n"] == total:  # a log file gets a line per 10%
                print(f"[eval] v{v}: {done['n']}/{total}", file=sys.stderr, flush=True)

        run = asyncio.run(run_version(samples, factory, v, args.concurrency, tick, args.max_prefix_chars))
        print(file=sys.stderr)
        summaries[f"v{v}"] = summarize(run.records)
        with open(out / f"v{v}.jsonl", "w") as f:
            for r in run.records:
                f.write(json.dumps(r.__dict__) + "\n")
        if args.judge_url:
            judged[f"v{v}"] = asyncio.run(_judge_all(args, samples, run.records))
    table = comparison_table(summaries)
    if judged:
        table += (
            "\n| judge score (0-10) | "
            + " | ".join(f"{judged[k]:.3f}" if judged.get(k) is not None else "n/a" for k in summaries)
            + " |"
        )
    (out / "comparison.md").write_text(table + "\n")
    (out / "summary.json").write_text(
        json.dumps({k: s.as_dict() for k, s in summaries.items()} | {"judge": judged}, indent=2)
    )
    print(table)
    timeline = args.timeline or args.state / "timeline.jsonl"
    if timeline.is_file():
        from onlinerl.loop.plots import plot_accept_rate

        png = plot_accept_rate(timeline, out / "accept_rate.png", title="simulated accept rate during online training")
        print(f"plot: {png}")
    print(f"results: {out}")
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
