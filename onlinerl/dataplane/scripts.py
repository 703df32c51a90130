"""The one way to run a Lua script: a ``Script`` holds its source and SHA1 and runs it on any client we use.

Why one way: each script is an atomic step of the contract (the feedback append, the trainer's fenced writes, the
rollout's apply...), and running it four different ways meant four different answers to "what if Redis restarted and
its script cache is empty". Here the answer is written once: EVALSHA (the source is not resent on every call), and on
NOSCRIPT the same call as EVAL. That retry is safe because a NOSCRIPT reply means the script did not run at all.

Clients:
- ``run``: a synchronous redis-py client (trainer, rollout controller, operator, CLI);
- ``run_async``: a redis-py asyncio client (reloader);
- ``run_piped``: anything with an async ``call(*args)`` (``PipelinedConnection``, feedback's group commit);
- ``eval_command`` / ``evalsha_command``: the bare arg-lists, for a caller that sends commands itself
  (the gateway packs its record EVAL with other commands; a redis-py pipeline queues it with ``execute_command``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import NoScriptError


class Caller(Protocol):
    """Anything that sends one command and awaits its reply: ``PipelinedConnection``, feedback's ``Pipeliner``."""

    async def call(self, *args: Any) -> Any: ...


@dataclass(frozen=True)
class Script:
    """A Lua script: ``source`` and its ``sha1`` (what EVALSHA names it by). Define each once, at module level."""

    source: str
    sha1: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha1", hashlib.sha1(self.source.encode()).hexdigest())

    def eval_command(self, keys: Sequence[Any], args: Sequence[Any] = ()) -> tuple[Any, ...]:
        """``EVAL source numkeys keys... args...``: the full source, so it never answers NOSCRIPT (for pipelines
        whose replies are read later, where a retry would reorder them; Redis caches the script either way)."""
        return ("EVAL", self.source, len(keys), *keys, *args)

    def evalsha_command(self, keys: Sequence[Any], args: Sequence[Any] = ()) -> tuple[Any, ...]:
        """``EVALSHA sha1 numkeys keys... args...``: may answer NOSCRIPT (then send ``eval_command``)."""
        return ("EVALSHA", self.sha1, len(keys), *keys, *args)

    def run(self, client: Any, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """Run on a synchronous redis-py client; error replies raise ``redis.ResponseError``."""
        try:
            return client.execute_command(*self.evalsha_command(keys, args))
        except NoScriptError:  # the script cache is empty (Redis restarted); it did not run
            return client.execute_command(*self.eval_command(keys, args))

    async def run_async(self, client: Any, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """Run on a redis-py asyncio client."""
        try:
            return await client.execute_command(*self.evalsha_command(keys, args))
        except NoScriptError:
            return await client.execute_command(*self.eval_command(keys, args))

    async def run_piped(self, conn: Caller, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """Run on a ``PipelinedConnection`` or a ``Pipeliner`` (one command, one reply)."""
        try:
            return await conn.call(*self.evalsha_command(keys, args))
        except NoScriptError:
            return await conn.call(*self.eval_command(keys, args))
