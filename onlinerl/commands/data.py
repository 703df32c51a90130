"""``onlinerl data build|stats``: a FIM data set from real Python source."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

DEFAULT_OUT = Path(".onlinerl/data")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="build or inspect the FIM data set")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    b = dsub.add_parser("build", help="cut FIM samples on AST boundaries (default corpus: this Python's stdlib)")
    b.add_argument("--corpus", type=Path, default=None, help="directory of .py files (default: the standard library)")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--test-fraction",
        type=float,
        default=0.15,
        help="share of source files in test.jsonl; 1 puts every file there (a corpus kept for evaluation only)",
    )
    b.add_argument("--per-file", type=int, default=12, help="max samples per source file")
    b.add_argument("--max-files", type=int, default=None)
    b.set_defaults(func=_build)
    s = dsub.add_parser("stats", help="counts by kind and middle length")
    s.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory holding train.jsonl/test.jsonl")
    s.set_defaults(func=_stats)


def _progress(done: int, total: int) -> None:
    if done == total or done % 50 == 0:
        print(f"\r[data] {done}/{total} files", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _build(args: argparse.Namespace) -> int:
    from onlinerl.commands.errors import require
    from onlinerl.data.builder import BuildOptions, build, write_jsonl
    from onlinerl.data.stats import format_stats, summarize

    require(0 < args.test_fraction <= 1, f"--test-fraction must be in (0, 1], got {args.test_fraction}")
    opts = BuildOptions(
        corpus=args.corpus,
        seed=args.seed,
        test_fraction=args.test_fraction,
        per_file=args.per_file,
        max_files=args.max_files,
    )
    train, test = build(opts, _progress)
    write_jsonl(train, args.out / "train.jsonl")
    write_jsonl(test, args.out / "test.jsonl")
    meta = {"options": {k: str(v) for k, v in asdict(opts).items()}, "train": summarize(train), "test": summarize(test)}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2))
    print(format_stats("train", meta["train"]))
    print(format_stats("test", meta["test"]))
    print(args.out.resolve())
    return 0


def _stats(args: argparse.Namespace) -> int:
    from onlinerl.data.stats import stats_for_dir

    print(stats_for_dir(args.out))
    return 0
