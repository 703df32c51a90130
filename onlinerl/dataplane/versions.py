"""The versions family (``versions`` hash, ``reloader`` status hash): what serving has done with each announced version.

Writer: the reloader of each serving pod (``version -> PolicyVersionState JSON``: loading, loaded, failed, retired;
and its last action in ``reloader``). Readers: the trainer (never prune a loaded version), the rollout controller
(gate a loaded version), the operator and `onlinerl status`/`eval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from onlinerl.dataplane.codec import pairs, str_map, text
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyVersionState


@dataclass
class VersionTable:
    """Every version's state; ``malformed``: versions whose entry does not parse (a reloader bug: the trainer keeps
    them, the rollout ignores them)."""

    states: dict[int, PolicyVersionState] = field(default_factory=dict)
    malformed: set[int] = field(default_factory=set)

    def loaded(self) -> set[int]:
        return {v for v, s in self.states.items() if s.state == "loaded"}


def _table(raw: Any) -> VersionTable:
    table = VersionTable()
    for name, value in pairs(raw):
        try:
            version = int(text(name))
        except ValueError:
            continue
        try:
            table.states[version] = PolicyVersionState.from_json(value)
        except ValueError:
            table.malformed.add(version)
    return table


def read(client: redis.Redis, keys: Keys) -> VersionTable:
    return _table(client.hgetall(keys.versions))


async def save_state(client: Any, keys: Keys, state: PolicyVersionState) -> None:
    """The reloader records one version's state."""
    await client.hset(keys.versions, str(state.version), state.to_json())


# --- the reloader's status hash --------------------------------------------------------------------------------------
async def set_reloader_status(client: Any, keys: Keys, fields: dict[str, str]) -> None:
    """Fields of the reloader's last action: last_reload_at, last_version, last_error, weights_version."""
    await client.hset(keys.reloader_status, mapping=fields)


def read_reloader_status(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return str_map(client.hgetall(keys.reloader_status))
