"""The FIM template a local command renders with: its own module so that `onlinerl up` (stack) and the CLI helpers
(local) both use it without importing each other."""

from __future__ import annotations

from pathlib import Path

from onlinerl.config import OnlineRLConfig


def template_for(cfg: OnlineRLConfig, name: str | None):
    """The FIM template simulate/eval render with: --template, else the model's (auto-detected from its tokenizer)."""
    from onlinerl.fim import get_template, resolve_template

    if name:
        return get_template(name)
    if cfg.model.fim_template != "auto":
        return get_template(cfg.model.fim_template)
    vocab: list[str] = []
    if cfg.model.path and Path(cfg.model.path, "tokenizer.json").is_file():
        import json

        vocab = list(json.loads(Path(cfg.model.path, "tokenizer.json").read_text())["model"]["vocab"])
        added = json.loads(Path(cfg.model.path, "tokenizer.json").read_text()).get("added_tokens", [])
        vocab += [t["content"] for t in added]
    return resolve_template("auto", vocab)
