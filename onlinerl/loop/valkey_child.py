"""The embedded valkey as one of `onlinerl up`'s supervised children.

Every other component depends on it, so a valkey that died (OOM killer, kill -9) and stayed dead would stop the whole
loop while the supervisor restarted nothing. :class:`ValkeyChild` gives :class:`onlinerl.procs.Supervisor` the few
things it uses of a :class:`onlinerl.procs.Child` (name, alive, start, pid, proc, log_path, health_url, reap_group).
A restart starts the server again on the same port, with the same users, from the same AOF (``appendfsync always``):
everything it acknowledged is back, and the clients reconnect to the URL they already have.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

from onlinerl.valkey import EmbeddedValkey

log = logging.getLogger(__name__)


@dataclass
class ValkeyChild:
    valkey: EmbeddedValkey
    name: str = "valkey"
    health_url: str | None = None  # start() itself waits until the server answers an authenticated PING

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.valkey.process

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.valkey.data_dir / "valkey.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ValkeyChild:
        """Start again from the AOF; a failed start leaves it dead, so the supervisor counts it and backs off."""
        try:
            self.valkey.start()
        except Exception as exc:  # any start failure is a death the supervisor must count
            log.error("valkey did not start again: %s", exc)
        return self

    def reap_group(self) -> None:
        """valkey-server forks only for AOF rewrites, and a fork dies with its parent: nothing left to end."""


__all__ = ["ValkeyChild"]
