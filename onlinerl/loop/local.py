"""Where the CLI finds a running local stack: the effective config and demo key that `onlinerl up` wrote."""

from __future__ import annotations

from pathlib import Path

from onlinerl.config import OnlineRLConfig, load_config
from onlinerl.errors import CommandError
from onlinerl.loop.stack import DEMO_TENANT, StackPaths, ensure_demo_key

DEFAULT_STATE = Path(".onlinerl")


def local_config(state: Path, config_path: str | None = None) -> OnlineRLConfig:
    """``--config`` if given, else the config `onlinerl up` wrote into the state directory."""
    if config_path:
        return load_config(config_path)
    paths = StackPaths(state)
    if not paths.config.is_file():
        raise CommandError(
            f"no running stack found ({paths.config} missing): start one with `make run` "
            "(or `onlinerl up`), or pass --config"
        )
    return load_config(paths.config)


def local_api_key(state: Path, given: str | None) -> tuple[str, str]:
    """``(api_key, project)``: the given key (project from --project) or the local demo key."""
    if given:
        return given, DEMO_TENANT
    paths = StackPaths(state)
    if not paths.keys.is_file():
        raise CommandError(f"{paths.keys} missing: pass --api-key, or start the stack with `make run`")
    return ensure_demo_key(paths), DEMO_TENANT


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
