"""Offline algorithm screen: train a candidate algorithm on the samples a live run already collected.

A live 60-minute run cannot rank training algorithms: it is one run per session, and its held-out figures carry
about ±10 points of noise. The samples a run's trainer consumed are still on disk, though: valkey's append-only file
logs every ``XADD`` to the samples stream (the entries are deleted after acknowledgement, the log keeps them). This
tool extracts them and feeds them, in their original order and with their original stream ids (so negative
subsampling keeps the same rejects), to a fresh stack whose trainer runs the candidate algorithm. Every candidate
then learns from the same data and is evaluated on the same held-out samples: a paired screen in ~15 minutes where a
live run costs ~90. What it cannot show is the on-policy loop (a better policy earning more accepts): a candidate
that ranks first here still needs the live run.

    .venv/bin/python bench/replay_samples.py extract --aof .onlinerl-demo12/valkey/appendonlydir --out a.jsonl
    .venv/bin/python bench/replay_samples.py inject --state STATE --archive a.jsonl
    .venv/bin/python bench/replay_samples.py wait --state STATE          # prints the last published version
(bench/replay_screen.sh runs the three around `onlinerl up` and `onlinerl eval`.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onlinerl.config import RewardConfig


def resp_commands(data: bytes) -> Iterator[list[bytes]]:
    """The commands of an append-only file, each as its argument list (RESP arrays of bulk strings)."""
    i, n = 0, len(data)
    while i < n:
        if data[i : i + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {i}: {data[i : i + 20]!r} (is this an .aof file?)")
        end = data.index(b"\r\n", i)
        count = int(data[i + 1 : end])
        i = end + 2
        args = []
        for _ in range(count):
            end = data.index(b"\r\n", i)
            length = int(data[i + 1 : end])
            i = end + 2
            args.append(data[i : i + length])
            i += length + 2
        yield args


def aof_files(path: Path) -> list[Path]:
    """An .aof file, or an appendonlydir: its incremental files in manifest order (the base holds no samples)."""
    if path.is_file():
        return [path]
    manifest = path / "appendonly.aof.manifest"
    if manifest.is_file():
        # lines like "file appendonly.aof.1.incr.aof seq 1 type i": key value pairs
        pairs = [line.split() for line in manifest.read_text().splitlines() if line.strip()]
        entries = [dict(zip(p[::2], p[1::2], strict=True)) for p in pairs]
        return [path / e["file"] for e in entries if e.get("type") == "i"]
    return sorted(path.glob("*.incr.aof"))


def extract(aof: Path, key_suffix: str = ":samples") -> list[tuple[str, str]]:
    """(stream id, sample json) of every XADD to a samples stream, in log order."""
    out: list[tuple[str, str]] = []
    for file in aof_files(aof):
        for args in resp_commands(file.read_bytes()):
            if args[0].upper() == b"XADD" and args[1].endswith(key_suffix.encode()):
                fields = dict(zip(args[3::2], args[4::2], strict=True))
                out.append((args[2].decode(), fields[b"data"].decode()))
    return out


def _client(state: Path):
    from onlinerl.keys import Keys
    from onlinerl.loop.local import local_config
    from onlinerl.redisconn import connect

    cfg = local_config(state)
    return connect(cfg.redis), Keys(cfg.job), cfg


def cmd_extract(args: argparse.Namespace) -> int:
    entries = extract(args.aof)
    with args.out.open("w") as f:
        for sid, data in entries:
            f.write(json.dumps({"id": sid, "data": json.loads(data)}) + "\n")
    rewards = [json.loads(d)["reward"] for _, d in entries]
    accepts = sum(1 for _, d in entries if json.loads(d).get("accepted"))
    mean = sum(rewards) / max(len(rewards), 1)
    print(f"{len(entries)} samples ({accepts} accepted, mean reward {mean:.3f}) -> {args.out}")
    return 0


def rescored(sample: dict, reward: RewardConfig) -> float:
    """The reward ``reward`` gives the sample's recorded outcome (accepted or not, the text shown; a silence sample
    shows nothing): another reward table screened on the same outcomes."""
    from onlinerl_feedback.reward import reward_for

    return reward_for(bool(sample.get("accepted")), sample.get("shown_text") or "", reward)


def cmd_inject(args: argparse.Namespace) -> int:
    """XADD the archive's samples with their original ids to the stack's samples stream (its job's key)."""
    from onlinerl.dataplane import samples

    r, keys, cfg = _client(args.state)
    lines = [json.loads(line) for path in args.archive for line in path.read_text().splitlines() if line.strip()]
    for row in lines:
        sample = row["data"]
        sample["tenant"] = sample.get("tenant") or cfg.job
        if args.rewards:  # another reward table on the same outcomes (the archive's runs had no silence samples)
            accepted, rejected = (float(x) for x in args.rewards.split(","))
            sample["reward"] = accepted if sample["accepted"] else rejected
        elif args.rescore:
            sample["reward"] = rescored(sample, cfg.feedback.reward)
        samples.add(r, keys, json.dumps(sample), entry_id=row["id"])
    print(f"injected {len(lines)} samples into {keys.samples}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait until the trainer acknowledged every entry (the stream is empty: acked entries are deleted), then print
    the newest published version."""
    from onlinerl.dataplane import samples
    from onlinerl.dataplane import trainer as trainer_status

    r, keys, _ = _client(args.state)
    deadline = time.monotonic() + args.timeout
    last = -1
    while True:
        left = samples.length(r, keys)
        if left != last:
            st = trainer_status.read_status(r, keys)
            print(f"[replay] {left} samples left, trainer {st.get('version', '?')}", file=sys.stderr, flush=True)
            last = left
        if left == 0:
            break
        if time.monotonic() > deadline:
            print(f"[replay] timed out with {left} samples left", file=sys.stderr)
            return 1
        time.sleep(5)
    # The last acknowledgement follows the last publish: the status hash names that version.
    print(trainer_status.read_status(r, keys).get("version", "0"))
    return 0


UPDATE_LINE = re.compile(
    r"update: (\d+) samples, negative-advantage share ([\d.]+), entropy ([\d.]+), approx KL [^,]+, "
    r"KL to base ([\d.e+-]+|nan|off) ?[^,]*, clip fraction ([\d.]+)(?:, running entropy ([\d.]+|nan))?"
)


def update_summary(log_text: str) -> dict[str, float]:
    """The trainer's per-update log lines, summed up: steps, samples, share with A < 0, entropy ranges (per update
    and running), last KL."""
    rows = [[float("nan" if x in ("off", None) else x) for x in m.groups()] for m in UPDATE_LINE.finditer(log_text)]
    if not rows:
        return {"steps": 0}
    samples = sum(r[0] for r in rows)
    running = [r[5] for r in rows if r[5] == r[5]]  # logged since the band became a running one
    return {
        "steps": len(rows),
        "samples": samples,
        "negative_advantage_share": sum(r[0] * r[1] for r in rows) / samples,
        "entropy_min": min(r[2] for r in rows),
        "entropy_max": max(r[2] for r in rows),
        "running_entropy_min": min(running, default=float("nan")),
        "running_entropy_max": max(running, default=float("nan")),
        "kl_to_base_last": rows[-1][3],
        "clip_fraction_max": max(r[4] for r in rows),
    }


def cmd_updates(args: argparse.Namespace) -> int:
    print(json.dumps(update_summary(args.log.read_text())))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    e = sub.add_parser("extract", help="samples of a run from valkey's append-only file -> JSONL archive")
    e.add_argument("--aof", type=Path, required=True, help="an .aof file or an appendonlydir")
    e.add_argument("--out", type=Path, required=True)
    e.set_defaults(func=cmd_extract)
    i = sub.add_parser("inject", help="archive -> the running stack's samples stream")
    i.add_argument("--state", type=Path, required=True)
    i.add_argument("--archive", type=Path, required=True, nargs="+", help="archives, oldest first")
    i.add_argument("--rewards", default="", help="ACCEPTED,REJECTED: recompute each reward (e.g. 1,0 for rlinf)")
    i.add_argument(
        "--rescore", action="store_true", help="recompute each reward with the stack config's feedback.reward table"
    )
    i.set_defaults(func=cmd_inject)
    w = sub.add_parser("wait", help="until the trainer acknowledged every sample; prints the last version")
    w.add_argument("--state", type=Path, required=True)
    w.add_argument("--timeout", type=float, default=3600)
    w.set_defaults(func=cmd_wait)
    u = sub.add_parser("updates", help="a trainer log's updates, summed up (JSON)")
    u.add_argument("log", type=Path)
    u.set_defaults(func=cmd_updates)
    args = p.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
