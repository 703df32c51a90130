"""Counts of a FIM data set by kind and by middle length, as a plain-text table."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from onlinerl.data.builder import FimSample, read_jsonl

LENGTH_BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 10**9))


def bucket(n: int) -> str:
    for lo, hi in LENGTH_BUCKETS:
        if lo <= n < hi:
            return f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"
    return "?"


def summarize(samples: list[FimSample]) -> dict:
    by_kind = Counter(s.kind for s in samples)
    by_len = Counter(bucket(len(s.middle)) for s in samples)
    files = {s.file for s in samples}
    mean = sum(len(s.middle) for s in samples) / len(samples) if samples else 0.0
    return {
        "samples": len(samples),
        "files": len(files),
        "by_kind": dict(sorted(by_kind.items())),
        "by_middle_chars": {b: by_len.get(b, 0) for b in (bucket(lo) for lo, _ in LENGTH_BUCKETS)},
        "mean_middle_chars": round(mean, 1),
    }


def format_stats(name: str, summary: dict) -> str:
    lines = [
        f"{name}: {summary['samples']} samples from {summary['files']} files, "
        f"mean middle {summary['mean_middle_chars']} chars"
    ]
    lines.append("  by kind:         " + "  ".join(f"{k}={v}" for k, v in summary["by_kind"].items()))
    lines.append("  by middle chars: " + "  ".join(f"{k}={v}" for k, v in summary["by_middle_chars"].items()))
    return "\n".join(lines)


def stats_for_dir(directory: Path) -> str:
    parts = []
    for split in ("train", "test"):
        path = directory / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run `onlinerl data build --out {directory}` first")
        parts.append(format_stats(split, summarize(read_jsonl(path))))
    return "\n".join(parts)
