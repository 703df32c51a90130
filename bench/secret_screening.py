"""Secret screening (issue 38): its added latency per request at the gateway, its recall on a seeded corpus, and its
false-positive rate on the Python standard library.

1. Latency. Requests shaped like Continue's (a prompt of a real standard-library file cut at a random line: up to
   ~4,000 characters of prefix, the FIM template, and the file's next lines as the completion) go through the
   gateway's own record step in process, as ``Gateway._start_record`` runs it before ``data: [DONE]``: the record
   built from the accumulator, then ``SecretScreen.screen`` (audit) or nothing (off). Interleaved per request, so
   machine noise hits both alike; p50/p99 of each and of the difference, and the screening call timed alone (the
   added time without a difference's noise). What the screening adds to a request is this: the rest of the request
   (vLLM, the relay, the Redis write) is the same with and without. Optionally the first 200 requests through
   detect-secrets 1.5's default plugins and filters (``--detect-secrets DIR``: a folder holding it, e.g. ``pip install
   --target DIR detect-secrets==1.5.0``; not a project dependency), through its file API (``scan_file`` on a
   temporary file: its line API searches eagerly, without the filters).
2. Recall. Real standard-library files, each with a few seeded fake credentials (tests/privacy_corpus.py: 16 kinds,
   random values in each provider's published shape) inserted at random lines as code holds them: a finding counts
   when its kind is the planted one and its span is exactly the secret. The planted formats are the ones the rules
   know: this measures that each rule fires in real code around it, not coverage of formats nobody wrote a rule for.
3. False positives. Every .py file of the standard library (as shipped, none planted): each finding is a false
   positive; reported per file and per MB, by kind, with the files that have one.

    .venv/bin/python bench/secret_screening.py [--requests 2000] [--detect-secrets /tmp/ds]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onlinerl.fim import get_template  # noqa: E402
from onlinerl.secret_scan import scan  # noqa: E402
from onlinerl_serving.capture import RolloutAccumulator  # noqa: E402
from onlinerl_serving.screening import SecretScreen  # noqa: E402
from tests.privacy_corpus import seeded_secrets  # noqa: E402

QWEN = get_template("qwen")
DS_REQUESTS = 200  # detect-secrets takes tens of milliseconds a request: the first 200 requests only
DS_SETTINGS: list = []  # detect-secrets' settings context, held open while it runs


def stdlib_files() -> list[Path]:
    std = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in std.rglob("*.py") if "site-packages" not in p.parts)


def requests(files: list[Path], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(prompt, completion) pairs cut from real files as Continue would send them."""
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < 20:
            continue
        cut = rng.randrange(5, len(lines) - 3)
        prefix = "".join(lines[max(0, cut - 120) : cut])[-4000:]
        suffix = "".join(lines[cut + 3 : cut + 40])[:1000]
        completion = "".join(lines[cut : cut + rng.randint(1, 3)])
        out.append((QWEN.render(prefix, suffix), completion))
    return out


def record_step(screen: SecretScreen | None, prompt: str, completion: str) -> tuple[float, float]:
    """The gateway's record step for one request (``_start_record`` before the Redis write) and, of it, the
    screening call alone, in seconds."""
    t0 = time.perf_counter()
    acc = RolloutAccumulator()
    acc.add_choice({"text": completion, "token_ids": [1] * 8, "logprobs": {"token_logprobs": [-1.0] * 8}})
    acc.offsets = [0] * 8
    record = acc.to_record(
        tenant="acme",
        arm="stable",
        version=0,
        served_model="onlinerl-base",
        user_hash="u",
        prompt=prompt,
        sampling={"temperature": 0.7, "top_p": 1.0, "max_tokens": 64},
        created_at=0.0,
    )
    t1 = time.perf_counter()
    if screen is not None:
        screen.screen(record)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency(reqs: list[tuple[str, str]], detect_secrets: bool) -> dict[str, list[float]]:
    screen = SecretScreen("audit")
    runs: dict[str, list[float]] = {"off": [], "audit": [], "audit: the screening call alone": []}
    if detect_secrets:
        runs["detect-secrets 1.5 (scan_file: its filters apply)"] = []
    for _ in range(50):  # warm-up
        record_step(screen, *reqs[0])
    for i, (prompt, completion) in enumerate(reqs):
        runs["off"].append(record_step(None, prompt, completion)[0])
        total, alone = record_step(screen, prompt, completion)
        runs["audit"].append(total)
        runs["audit: the screening call alone"].append(alone)
        if detect_secrets and i < DS_REQUESTS:
            t0 = time.perf_counter()
            ds_findings(prompt + "\n" + completion)
            runs["detect-secrets 1.5 (scan_file: its filters apply)"].append(time.perf_counter() - t0 + runs["off"][-1])
    return runs


def ds_findings(text: str) -> list:
    """detect-secrets' findings in ``text`` through its file API (its line API searches eagerly, without the filters
    that keep its false positives down): a temporary .py file per call."""
    from detect_secrets.core.scan import scan_file

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(text)
    try:
        return list(scan_file(fh.name))
    finally:
        os.unlink(fh.name)


def recall(files: list[Path], rng: random.Random, per_kind: int, detect_secrets: bool) -> dict:
    planted = seeded_secrets(rng.randrange(1 << 30), per_kind)
    rng.shuffle(planted)
    found = collections.Counter()
    total = collections.Counter()
    ds_found = collections.Counter()
    wrong_kind = 0
    for i in range(0, len(planted), 3):  # three secrets per file
        group = planted[i : i + 3]
        lines = rng.choice(files).read_text(errors="replace").splitlines(keepends=True) or ["\n"]
        spots = sorted(rng.randrange(len(lines) + 1) for _ in group)
        for offset, (spot, (_kind, _secret, line)) in enumerate(zip(spots, group, strict=True)):
            lines.insert(spot + offset, line + "\n")
        text = "".join(lines)
        findings = scan(text)
        for kind, secret, _line in group:
            total[kind] += 1
            at = text.index(secret)
            hit = [f for f in findings if f.start == at and f.end == at + len(secret)]
            if any(f.kind == kind for f in hit):
                found[kind] += 1
            elif hit:
                wrong_kind += 1
        if detect_secrets:
            values = [s.secret_value for s in ds_findings(text) if s.secret_value]
            for kind, secret, _line in group:
                if any(secret in v or v in secret for v in values):
                    ds_found[kind] += 1
    return {"found": found, "total": total, "wrong_kind": wrong_kind, "ds_found": ds_found}


def false_positives(files: list[Path]) -> dict:
    by_kind = collections.Counter()
    files_hit = []
    size = 0
    for p in files:
        text = p.read_text(errors="replace")
        size += len(text.encode())
        findings = scan(text)
        for f in findings:
            by_kind[f.kind] += 1
        if findings:
            files_hit.append(f"{p.relative_to(p.parents[1])}: " + ", ".join(f.kind for f in findings))
    return {"files": len(files), "mb": size / 1e6, "by_kind": by_kind, "files_hit": files_hit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--per-kind", type=int, default=6, help="seeded secrets per kind for the recall corpus")
    ap.add_argument("--detect-secrets", type=Path, default=None, help="folder holding detect-secrets 1.5")
    ap.add_argument("--seed", type=int, default=38)
    args = ap.parse_args()
    if args.detect_secrets:
        sys.path.insert(0, str(args.detect_secrets))
        from detect_secrets.settings import default_settings

        DS_SETTINGS.append(default_settings())  # its default plugins and filters, for the whole run
        DS_SETTINGS[0].__enter__()
    rng = random.Random(args.seed)
    files = stdlib_files()
    reqs = requests(files, args.requests, rng)
    sizes = [len(p) + len(c) for p, c in reqs]
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {platform.python_version()}, "
        f"{len(files)} stdlib files; {len(reqs)} requests, median {statistics.median(sizes):.0f} chars "
        f"(p99 {pct(sizes, 0.99)})"
    )
    runs = latency(reqs, bool(args.detect_secrets))
    print("\n| gateway record step | p50 µs | p99 µs | added p50 µs | added p99 µs |\n|---|---|---|---|---|")
    for name, xs in runs.items():
        alone = name.endswith("alone")  # already the added time itself
        added = xs if alone else [a - b for a, b in zip(xs, runs["off"], strict=False)]
        print(
            f"| {name} | {pct(xs, 0.5) * 1e6:.0f} | {pct(xs, 0.99) * 1e6:.0f} | "
            f"{pct(added, 0.5) * 1e6:.0f} | {pct(added, 0.99) * 1e6:.0f} |"
        )
    rec = recall(files, rng, args.per_kind, bool(args.detect_secrets))
    total, found = rec["total"], rec["found"]
    head = "| kind | planted | found (kind and span exact) |" + (
        " detect-secrets found |" if args.detect_secrets else ""
    )
    print("\n" + head + "\n|---|---|---|" + ("---|" if args.detect_secrets else ""))
    for kind in sorted(total):
        row = f"| {kind} | {total[kind]} | {found[kind]} |"
        print(row + (f" {rec['ds_found'][kind]} |" if args.detect_secrets else ""))
    all_total, all_found = sum(total.values()), sum(found.values())
    print(
        f"\nrecall {all_found}/{all_total} = {all_found / all_total:.3f} over {len(total)} kinds "
        f"({rec['wrong_kind']} found under another kind)"
        + (f"; detect-secrets {sum(rec['ds_found'].values())}/{all_total}" if args.detect_secrets else "")
    )
    fp = false_positives(files)
    n_fp = sum(fp["by_kind"].values())
    print(
        f"\nfalse positives on the standard library: {n_fp} findings in {len(fp['files_hit'])} of {fp['files']} files "
        f"({fp['mb']:.1f} MB): {n_fp / fp['files'] * 1000:.2f} per 1000 files, {n_fp / fp['mb']:.2f} per MB; "
        f"by kind {dict(fp['by_kind'])}"
    )
    for line in fp["files_hit"]:
        print(f"  {line}")
    if args.detect_secrets:
        sample = rng.sample(files, 100)
        ours = sum(len(scan(p.read_text(errors="replace"))) for p in sample)
        theirs = collections.Counter(s.type for p in sample for s in ds_findings(p.read_text(errors="replace")))
        print(
            f"\nthe same 100 random stdlib files: these rules {ours} findings; detect-secrets' default plugins and "
            f"filters {sum(theirs.values())} ({dict(theirs.most_common())})"
        )
        DS_SETTINGS[0].__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
