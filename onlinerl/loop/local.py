"""Where the CLI finds a running local stack: the effective config and demo key that `onlinerl up` wrote."""

from __future__ import annotations

from pathlib import Path

from onlinerl.config import OnlineRLConfig, load_config
from onlinerl.errors import CommandError
from onlinerl.loop.stack import DEMO_TENANT, StackPaths, demo_user_keys, ensure_demo_key
from onlinerl.loop.template import template_for

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


def local_api_key(state: Path, given: str | None, role: str = "user", tenant: str | None = None) -> tuple[str, str]:
    """``(api_key, project)``: the given key (project from --project) or the local key of ``role`` (``eval`` for
    commands that pin a policy version) of ``tenant`` (default: the demo tenant)."""
    if given:
        return given, tenant or DEMO_TENANT
    return ensure_demo_key(_local_paths(state, tenant), role, tenant or DEMO_TENANT), tenant or DEMO_TENANT


def local_user_keys(state: Path, given: str | None, tenant: str | None = None) -> list[str]:
    """The simulated users' keys: the given key alone (every user shares it, so they share an arm), else the local
    stack's user keys of ``tenant`` (default: the demo tenant; one each, created by `onlinerl up`)."""
    if given:
        return [given]
    return demo_user_keys(_local_paths(state, tenant), tenant or DEMO_TENANT)


def _local_paths(state: Path, tenant: str | None) -> StackPaths:
    """The state's paths, once its keys file is known to hold ``tenant`` (the gateway reads keys only at start)."""
    paths = StackPaths(state)
    if not paths.keys.is_file():
        raise CommandError(f"{paths.keys} missing: pass --api-key, or start the stack with `make run`")
    if tenant and tenant != DEMO_TENANT and not demo_user_keys(paths, tenant):
        raise CommandError(
            f"{paths.keys} has no keys of project {tenant!r}: list it under projects.listed in the config "
            "`onlinerl up` starts with (it creates each listed project's keys), or pass --api-key"
        )
    return paths


__all__ = ["DEFAULT_STATE", "local_api_key", "local_config", "local_user_keys", "template_for"]
