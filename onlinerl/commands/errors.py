"""Small helpers for command argument checks."""

from __future__ import annotations

from onlinerl.errors import CommandError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CommandError(message)
