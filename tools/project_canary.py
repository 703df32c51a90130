"""Isolation of per-project adapters, shown with a canary (issue 39).

``plant``: give one project a convention no other project has. Every whole-word occurrence of ``--word`` (default
``self``) in a data set's prefixes, middles and suffixes becomes ``--canary`` (default ``zq_self``), so
that project's accepted completions, and only its, contain the canary.

``measure``: how likely each policy is to write the canary where the word belongs, on code that does *not* contain
it: samples of another project (both splits: none of them holds the canary) whose middle holds ``--word``. The
context is the sample's FIM prompt plus its middle up to the word; the score is log p(canary tokens | context), read
from vLLM's ``prompt_logprobs`` for each served model (the base, the shared line's newest version, each project
line's newest). Because the canary is not in the context, a policy can only raise its probability by having learned
it: the planting project's adapter should (the positive control); another project's adapter must not rise above
the base (the isolation promise).

    .venv/bin/python tools/project_canary.py plant STATE/data-alpha
    .venv/bin/python tools/project_canary.py measure --state STATE --data STATE/data-beta --lines alpha,beta \
        --out STATE/canary-after.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onlinerl.data.builder import read_jsonl, resolve_split, write_jsonl  # noqa: E402

# ``self`` is in 28% of the standard library's training middles (so the planting project meets its convention
# often within an hour) and in 151 of networkx's middles (the contexts scored on the other project's code).
WORD = "self"
CANARY = "zq_self"


def plant(data: Path, word: str = WORD, canary: str = CANARY) -> dict[str, int]:
    """Rename ``word`` to ``canary`` in every split of a ``data build`` folder, in place; counts per split."""
    pattern = re.compile(rf"\b{re.escape(word)}\b")
    counts = {}
    for split in ("train", "test"):
        path = resolve_split(data, split)
        if not path.is_file():
            continue
        samples = read_jsonl(path)
        counts[split] = sum(1 for s in samples if pattern.search(s.middle))
        renamed = [
            replace(
                s,
                prefix=pattern.sub(canary, s.prefix),
                middle=pattern.sub(canary, s.middle),
                suffix=pattern.sub(canary, s.suffix),
            )
            for s in samples
        ]
        write_jsonl(renamed, path)
    return counts


def _tokenize(http: httpx.Client, url: str, model: str, text: str) -> list[int]:
    r = http.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    return r.json()["tokens"]


def canary_logprob(
    http: httpx.Client, url: str, model: str, context: str, canary: str, tokenizer_model: str
) -> float | None:
    """log p(canary | context) under ``model``. The tokenizer merges a run of spaces with the word after it, so
    when the canary's tokens do not follow the context's own tokens unchanged, the context's trailing whitespace
    moves into the scored text (the same text for every model). None when even that does not align."""
    stripped = context.rstrip(" \t")
    for head in (context, stripped):
        target = context[len(head) :] + canary
        ctx = _tokenize(http, url, tokenizer_model, head)
        full = _tokenize(http, url, tokenizer_model, head + target)
        if full[: len(ctx)] == ctx and len(full) > len(ctx):
            break
    else:
        return None
    r = http.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": full, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0},
    )
    r.raise_for_status()
    per_token = r.json()["choices"][0]["prompt_logprobs"]
    total = 0.0
    for i in range(len(ctx), len(full)):
        entry = per_token[i] or {}
        total += float(entry[str(full[i])]["logprob"])
    return total


def measure(args: argparse.Namespace) -> int:
    from onlinerl.dataplane import versions
    from onlinerl.fim import get_template
    from onlinerl.keys import Keys
    from onlinerl.lines import adapter_name
    from onlinerl.loop.local import local_config
    from onlinerl.loop.template import template_for
    from onlinerl.redisconn import connect

    cfg = local_config(args.state)
    template = get_template(args.template) if args.template else template_for(cfg, None)
    url = args.engine_url or cfg.serving.engine_url
    r = connect(cfg.redis)
    keys = Keys(cfg.job)
    models = {"base": cfg.model.served_name}
    shared = max(versions.read(r, keys).loaded(), default=0)
    if shared:
        models[f"shared v{shared}"] = adapter_name(cfg.job, shared)
    for line in filter(None, args.lines.split(",")):
        newest = max(versions.read(r, keys.for_project(line)).loaded(), default=0)
        if newest:
            models[f"{line} v{newest}"] = adapter_name(cfg.job, newest, line)
    r.close()
    pattern = re.compile(rf"\b{re.escape(args.word)}\b")
    contexts = []
    samples = [s for split in ("test", "train") for s in read_jsonl(resolve_split(args.data, split))]
    for s in samples:
        m = pattern.search(s.middle)
        if m and args.canary not in s.prefix + s.suffix:
            prefix = s.prefix[-args.max_prefix_chars :]
            contexts.append(template.render(prefix, s.suffix) + s.middle[: m.start()])
        if len(contexts) >= args.limit:
            break
    scores: dict[str, list[float | None]] = {}
    with httpx.Client(timeout=120) as http:
        for name, model in models.items():
            base_model = models["base"]
            scores[name] = [canary_logprob(http, url, model, c, args.canary, base_model) for c in contexts]
            print(f"[canary] {name}: {len(contexts)} contexts scored", file=sys.stderr)
    usable = [i for i in range(len(contexts)) if all(scores[n][i] is not None for n in scores)]
    base = [scores["base"][i] for i in usable]
    report = {"canary": args.canary, "word": args.word, "contexts": len(usable), "models": models, "policies": {}}
    for name in scores:
        xs = [scores[name][i] for i in usable]
        diffs = [x - b for x, b in zip(xs, base, strict=True)]
        report["policies"][name] = {
            "mean_logprob": statistics.fmean(xs) if xs else None,
            "mean_minus_base": statistics.fmean(diffs) if diffs else None,
            "contexts_above_base": sum(1 for d in diffs if d > 0),
            "max_minus_base": max(diffs) if diffs else None,
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plant", help="rename --word to --canary in a data build folder, in place")
    p.add_argument("data", type=Path)
    p.add_argument("--word", default=WORD)
    p.add_argument("--canary", default=CANARY)
    m = sub.add_parser("measure", help="log p(canary) per policy on another project's held-out code")
    m.add_argument("--state", type=Path, required=True)
    m.add_argument("--data", type=Path, required=True, help="a data build folder without the canary")
    m.add_argument("--lines", default="", help="comma list of project lines to score (their newest version)")
    m.add_argument("--word", default=WORD)
    m.add_argument("--canary", default=CANARY)
    m.add_argument("--limit", type=int, default=60)
    m.add_argument("--max-prefix-chars", type=int, default=600)
    m.add_argument("--template", default=None)
    m.add_argument("--engine-url", default=None, help="default: serving.engineUrl of the local stack")
    m.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "plant":
        counts = plant(args.data, args.word, args.canary)
        print(json.dumps({"data": str(args.data), "middles_with_the_canary": counts}))
        return 0
    return measure(args)


if __name__ == "__main__":
    raise SystemExit(main())
