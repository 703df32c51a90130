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
        --own STATE/data-alpha --out STATE/canary-after.json
    .venv/bin/python tools/project_canary.py offline --config STATE/config.yaml --data STATE/data-beta \
        --own STATE/data-alpha --adapter "alpha v25=CKPT/projects/alpha/v25" --adapter "beta v24=CKPT/projects/beta/v24"

``--own`` adds the positive control (module docstring of :func:`contexts_for`): on the planting project's held-out
code the canary is in context, every policy gives it a fair probability, and the planting adapter's rise over the
base, beyond its rise on other in-context names (``control``), is what it learned from its users' accepts. The
first run measured only the other project's code (log p about -26, where nothing can move) and read its flat
positive control as "RL cannot learn a token the base never samples"; in context the base does sample it.
"""

from __future__ import annotations

import argparse
import json
import keyword
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


# Names that are no project's convention: a control identifier is any other name the middle writes.
KEYWORDS = frozenset(keyword.kwlist) | {"self", "cls", "print", "len"}
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")


def contexts_for(
    samples: list, template, word: str, canary: str, limit: int, max_prefix: int, where: str
) -> list[tuple[str, str]]:
    """``(context, scored text)`` pairs, pure. ``where``:

    - ``other``: another project's code, where its middle writes ``word``; the canary is nowhere in the context,
      so only a policy that learned it out of context can raise it (the strict isolation test);
    - ``own``: the planting project's held-out code, where its middle writes the canary, which the context also
      holds (its convention, as its users see it): the positive control, where the planting adapter must rise;
    - ``control``: the same samples, scoring another identifier the middle writes and the context already holds:
      how much each policy raises in-context copying in general, so that a rise on the canary can be told apart
      from a generic one (an adapter that copies more raises every in-context name, the canary included).
    """
    pattern = re.compile(rf"\b{re.escape(canary if where != 'other' else word)}\b")
    out: list[tuple[str, str]] = []
    for s in samples:
        prefix = s.prefix[-max_prefix:]
        m = pattern.search(s.middle)
        if m is None or (where == "other" and canary in s.prefix + s.suffix):
            continue
        if where == "control":
            m = next(
                (
                    c
                    for c in IDENT.finditer(s.middle)
                    if c.group() not in KEYWORDS and c.group() != canary and c.group() in prefix
                ),
                None,
            )
            if m is None:
                continue
        target = canary if where != "control" else m.group()
        out.append((template.render(prefix, s.suffix) + s.middle[: m.start()], target))
        if len(out) >= limit:
            break
    return out


def score(http: httpx.Client, url: str, models: dict[str, str], pairs: list[tuple[str, str]]) -> dict:
    """log p(target | context) under every model, and each policy's shift from the base on the same contexts."""
    base_model = models["base"]
    scores = {}
    for name, model in models.items():
        scores[name] = [canary_logprob(http, url, model, c, t, base_model) for c, t in pairs]
        print(f"[canary] {name}: {len(pairs)} contexts scored", file=sys.stderr)
    usable = [i for i in range(len(pairs)) if all(scores[n][i] is not None for n in scores)]
    base = [scores["base"][i] for i in usable]
    report: dict = {"contexts": len(usable), "models": models, "policies": {}}
    for name in scores:
        xs = [scores[name][i] for i in usable]
        diffs = [x - b for x, b in zip(xs, base, strict=True)]
        report["policies"][name] = {
            "mean_logprob": statistics.fmean(xs) if xs else None,
            "mean_minus_base": statistics.fmean(diffs) if diffs else None,
            "median_minus_base": statistics.median(diffs) if diffs else None,
            "contexts_above_base": sum(1 for d in diffs if d > 0),
            "max_minus_base": max(diffs) if diffs else None,
        }
    return report


def _samples(data: Path, splits: tuple[str, ...]) -> list:
    return [s for split in splits for s in read_jsonl(resolve_split(data, split))]


def _report(args: argparse.Namespace, http: httpx.Client, url: str, models: dict[str, str], template) -> dict:
    """Every requested measurement: on the other project's code (``--data``), and with ``--own`` on the planting
    project's held-out code with its control identifiers."""
    report = {"canary": args.canary, "word": args.word}
    if args.data:
        pairs = contexts_for(
            _samples(args.data, ("test", "train")),
            template,
            args.word,
            args.canary,
            args.limit,
            args.max_prefix_chars,
            "other",
        )
        report["other"] = score(http, url, models, pairs)
    if args.own:
        held_out = _samples(args.own, ("test",))
        for where in ("own", "control"):
            pairs = contexts_for(held_out, template, args.word, args.canary, args.limit, args.max_prefix_chars, where)
            report[where] = score(http, url, models, pairs)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


def measure(args: argparse.Namespace) -> int:
    """Against the running local stack: the base, the shared line's newest version and each line's newest."""
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
    with httpx.Client(timeout=120) as http:
        _report(args, http, url, models, template)
    return 0


def offline(args: argparse.Namespace) -> int:
    """A stopped run's saved adapters (``--adapter NAME=FOLDER``), scored on a vLLM started here for the purpose."""
    import yaml

    from onlinerl.config import OnlineRLConfig
    from onlinerl.loop.template import template_for
    from onlinerl.valkey import free_port
    from onlinerl_serving.engine import start_vllm

    cfg = OnlineRLConfig.model_validate(yaml.safe_load(args.config.read_text()))
    port = free_port()
    child = start_vllm(cfg, cfg.model.path, args.log, port=port)
    url = f"http://127.0.0.1:{port}"
    models = {"base": cfg.model.served_name}
    try:
        with httpx.Client(timeout=120) as http:
            for item in args.adapter:
                name, _, folder = item.partition("=")
                served = re.sub(r"[^A-Za-z0-9_.-]", "-", name)
                r = http.post(f"{url}/v1/load_lora_adapter", json={"lora_name": served, "lora_path": folder})
                r.raise_for_status()
                models[name] = served
            _report(args, http, url, models, template_for(cfg, None))
    finally:
        child.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plant", help="rename --word to --canary in a data build folder, in place")
    p.add_argument("data", type=Path)
    p.add_argument("--word", default=WORD)
    p.add_argument("--canary", default=CANARY)
    m = sub.add_parser("measure", help="log p(canary) per policy of the running local stack")
    m.add_argument("--state", type=Path, required=True)
    m.add_argument("--lines", default="", help="comma list of project lines to score (their newest version)")
    m.add_argument("--template", default=None)
    m.add_argument("--engine-url", default=None, help="default: serving.engineUrl of the local stack")
    o = sub.add_parser("offline", help="log p(canary) per saved adapter of a stopped run, on a vLLM started here")
    o.add_argument("--config", type=Path, required=True, help="the run's config.yaml (model, template)")
    o.add_argument("--adapter", action="append", default=[], help="NAME=FOLDER of a saved adapter (repeat)")
    o.add_argument("--log", type=Path, default=Path("/tmp/project-canary-vllm.log"))
    for q in (m, o):
        q.add_argument("--data", type=Path, default=None, help="another project's data build (without the canary)")
        q.add_argument("--own", type=Path, default=None, help="the planting project's data build: positive control")
        q.add_argument("--word", default=WORD)
        q.add_argument("--canary", default=CANARY)
        q.add_argument("--limit", type=int, default=60)
        q.add_argument("--max-prefix-chars", type=int, default=600)
        q.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "plant":
        counts = plant(args.data, args.word, args.canary)
        print(json.dumps({"data": str(args.data), "middles_with_the_canary": counts}))
        return 0
    if not (args.data or args.own):
        ap.error("give --data (another project's code) and/or --own (the planting project's)")
    return measure(args) if args.cmd == "measure" else offline(args)


if __name__ == "__main__":
    raise SystemExit(main())
