"""The checkpoints family (``checkpoints`` stream): the trainer announces each published version, every serving pod's
reloader reads the whole stream (no group: each pod must see every announcement), the operator reads it for status.

The announce itself is the fenced script of ``trainer.Lease.announce`` (refused unless the caller holds the lease,
and unless the version is newer than the last one announced). The entry's fields are ``FIELDS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from onlinerl.dataplane.codec import entries, str_map, text
from onlinerl.keys import Keys

FIELDS = (
    "version",
    "path",
    "kind",
    "manifest_sha256",
    "created_at",
    "fence",
    "rollback_at",
    "parent_version",
    "contributors",
)
"""An announcement's fields: the version, its folder, ``lora``/``full``, the manifest's digest, when, by which lease,
the manual rollback its lineage follows, its parent version and who trained it (the manifest's ``contributors``)."""


def last_announced(client: redis.Redis, keys: Keys) -> int:
    """The newest announced version (0: none yet)."""
    last = client.xrevrange(keys.checkpoints, count=1)
    return int(str_map(last[0][1])["version"]) if last else 0


async def read_after(
    client: Any, keys: Keys, last_id: str, count: int = 100, block_ms: int | None = None
) -> list[tuple[str, dict[str, str]]]:
    """Announcements after ``last_id`` (``"0"``: from the start), blocking up to ``block_ms`` when given."""
    kwargs: dict[str, int] = {"count": count} if block_ms is None else {"count": count, "block": block_ms}
    reply = await client.xread({keys.checkpoints: last_id}, **kwargs)
    return [(i, str_map(f)) for _stream, raw in reply or () for i, f in entries(raw)]


async def read_streams_after(
    client: Any, positions: Mapping[str, str], count: int = 100, block_ms: int | None = None
) -> list[tuple[str, str, dict[str, str]]]:
    """``(stream, entry id, fields)`` after each stream's last id, for many lines' ``checkpoints`` streams in one
    XREAD (a serving pod follows the shared line and every project line, issue 39): one round trip however many lines,
    and an announcement on any of them ends the block at once. The keys share the job's hash tag (one Cluster slot)."""
    if not positions:
        return []
    kwargs: dict[str, int] = {"count": count} if block_ms is None else {"count": count, "block": block_ms}
    reply = await client.xread(dict(positions), **kwargs)
    return [(text(stream), i, str_map(f)) for stream, raw in reply or () for i, f in entries(raw)]


@dataclass(frozen=True)
class Announced:
    """One announced version's lineage: its parent (-1: announced before announcements named it) and who trained it
    (tenant -> user hashes; empty before announcements carried it)."""

    version: int
    parent: int
    contributors: dict[str, list[str]]


def lineage(client: redis.Redis, keys: Keys) -> list[Announced]:
    """Every announced version's lineage, oldest first (`onlinerl forget`: which versions learned from whom)."""
    out = []
    for _id, raw in entries(client.xrange(keys.checkpoints)):
        f = str_map(raw)
        try:
            contributors = orjson.loads(f.get("contributors") or "{}")
            out.append(Announced(int(f["version"]), int(f.get("parent_version") or -1), dict(contributors)))
        except (KeyError, ValueError, TypeError, orjson.JSONDecodeError):
            continue
    return out
