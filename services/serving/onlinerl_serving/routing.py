"""Policy routing: which version serves a user. Pure functions over the policy table and the loaded versions.

Each user gets a deterministic point in [0, 1) from sha256(API key), so a user keeps the same arm while the canary
share stays the same, and raising the share only moves users from stable to candidate. The "user" is the
authenticated key, never a client-sent id (``X-Continue-Unique-Id``, body ``user``): no client can choose its arm.

A few-user canary (policy ``split: request``, set by the rollout controller under ``rollout.fewUsers: decide``) draws
each request's point instead (the gateway's ``draw``): a lone developer's one key would otherwise stay on one arm and
the canary would never see the other. The record carries the arm served, so the outcome counts there either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from onlinerl.arms import CANDIDATE, PINNED, STABLE, Arm
from onlinerl.auth import user_hash as user_hash  # shared with feedback (a rater's user); re-exported here
from onlinerl.schemas import PolicyTable, adapter_name


def user_point(uhash: str) -> float:
    """The user's deterministic position in [0, 1)."""
    return int(uhash[:13], 16) / float(16**13)


@dataclass(frozen=True)
class Route:
    arm: Arm  # stable (version 0 included) | candidate | pinned | eval
    version: int  # the version actually served
    routed_version: int  # what the table asked for (differs when it is not loaded here)


def choose(table: PolicyTable, uhash: str, draw: float = 0.0) -> tuple[Arm, int]:
    """``(arm, version)`` the policy table assigns to this user's request. The base model as stable is arm ``stable``
    too: its feedback must count where the canary reads the stable arm. ``draw``: this request's uniform draw in
    [0, 1), its point when the canary splits by request (``split: request``); by key the user's point is used."""
    if table.pinned is not None:
        return PINNED, table.pinned
    point = draw if table.split == "request" else user_point(uhash)
    if table.candidate is not None and table.canary_share > 0 and point < table.canary_share:
        return CANDIDATE, table.candidate
    return STABLE, table.stable


def newest_loaded_at_most(version: int, loaded: Iterable[int]) -> int:
    """``version`` if loaded, else the newest loaded version below it, else 0 (the base model is always there)."""
    best = 0
    for v in loaded:
        if v == version:
            return v
        if best < v < version:
            best = v
    return best


def route(table: PolicyTable, uhash: str, loaded: Iterable[int], draw: float = 0.0) -> Route:
    """The user's arm and the version this replica serves it.

    The candidate arm serves exactly the candidate the gate passed, or, where this replica has not loaded it (still
    loading after a restart, or it failed here), stable's version: never "the newest loaded below the candidate",
    which is a version the rollout judged and refused (``gate_failed``, ``superseded``, ``rolled_back``: the reloader
    keeps recent ones loaded). The arm stays ``candidate`` and the record carries the version served, so that
    feedback is counted under ``stats:v{stable}:candidate``: in neither arm of the canary. Stable and pinned fall
    back to the newest loaded version at or below theirs (the reloader loads the routed versions first)."""
    loaded = loaded if isinstance(loaded, set | frozenset) else set(loaded)
    arm, wanted = choose(table, uhash, draw)
    if arm == CANDIDATE and wanted not in loaded:
        return Route(arm, newest_loaded_at_most(table.stable, loaded), wanted)
    return Route(arm, newest_loaded_at_most(wanted, loaded), wanted)


def served_model_name(job: str, base_name: str, version: int, weights_mode: str = "lora") -> str:
    """vLLM model name for a version: the base name for version 0 (and for every version in full-weight mode)."""
    if version == 0 or weights_mode == "full":
        return base_name
    return adapter_name(job, version)


def version_of_model(job: str, base_name: str, model: str) -> int | None:
    """Inverse of :func:`served_model_name` for LoRA names; None for names that are not ours."""
    if model == base_name:
        return 0
    prefix = f"{job}-v"
    if model.startswith(prefix) and model[len(prefix) :].isdigit():
        return int(model[len(prefix) :])
    return None
