"""The prompt an event joins on.

Continue's upload carries ``prompt`` (the rendered FIM string it sent to /v1/completions) and the gateway keys its
rollout records by exactly that string, so the posted prompt is used verbatim. Older clients that send only
``prefix``/``suffix`` get the prompt rendered with the configured FIM template (``model.fimTemplate``; ``auto``
reads the special tokens from ``tokenizer.json`` of ``model.path``, else the fallback template, which is what the
gateway's default model, SmolLM2, uses).
"""

from __future__ import annotations

import json
from pathlib import Path

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import FimTemplate, resolve_template
from onlinerl.schemas import CompletionOutcome


def tokenizer_vocab(model_path: str) -> list[str]:
    """Token strings of ``model_path/tokenizer.json`` without importing transformers; [] when unreadable."""
    if not model_path:
        return []
    try:
        data = json.loads((Path(model_path) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return []
    vocab = list((data.get("model") or {}).get("vocab") or {})
    return vocab + [t.get("content", "") for t in data.get("added_tokens") or []]


def configured_template(cfg: OnlineRLConfig) -> FimTemplate:
    return resolve_template(cfg.model.fim_template, tokenizer_vocab(cfg.model.path))


def event_prompt(event: CompletionOutcome, template: FimTemplate) -> str:
    """The posted prompt, or the one rendered from prefix/suffix when the client did not send it."""
    if event.prompt:
        return event.prompt
    return template.render(event.prefix, event.suffix)
