"""A password-protected valkey: components connect with the password in their Redis URL, a client without it is
refused. Every Redis client has deadlines: a half-open connection fails fast, a blocking read outlives its block."""

from __future__ import annotations

import ast
import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from onlinerl.config import RedisConfig
from onlinerl.procs import Child, log_tail, wait_for
from onlinerl.redisconn import BLOCK_MARGIN_SECONDS, connect, connect_async, redacted, timeouts
from onlinerl.valkey import EmbeddedValkey, ensure_password_file, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path / "valkey", password=ensure_password_file(tmp_path / "redis-password")).start()
    try:
        yield server
    finally:
        server.stop()


def test_password_file_is_private_url_safe_and_stable(tmp_path: Path) -> None:
    pw = ensure_password_file(tmp_path / "pw")
    assert len(pw) == 48 and pw.isalnum() and ensure_password_file(tmp_path / "pw") == pw
    assert oct((tmp_path / "pw").stat().st_mode & 0o777) == "0o600"
    assert redacted(f"redis://:{pw}@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"


def test_clients_without_the_password_are_refused(locked: EmbeddedValkey) -> None:
    good = connect(RedisConfig(url=locked.url))
    entry = good.xadd("onlinerl:t:samples", {"sample": "{}"})
    assert [e[0] for e in good.xrange("onlinerl:t:samples")] == [entry]
    for url in (locked.public_url, f"redis://:wrong@127.0.0.1:{locked.port}/0"):
        with pytest.raises(redis.AuthenticationError):
            connect(RedisConfig(url=url)).xadd("onlinerl:t:samples", {"sample": "forged"})
    with socket.create_connection(("127.0.0.1", locked.port), timeout=2) as raw:  # a bare RESP client
        raw.sendall(b"*3\r\n$4\r\nXADD\r\n$18\r\nonlinerl:t:samples\r\n$1\r\n*\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    assert good.xlen("onlinerl:t:samples") == 1  # nothing forged got in
    good.close()


def _rollout_controller(tmp_path: Path, name: str, url: str) -> tuple[Child, int]:
    port = free_port()
    cfg = tmp_path / f"{name}.yaml"
    spec = {
        "job": "t",
        "redis": {"url": url},
        "auth": {"allowAnonymous": True},
        "rollout": {"gate": {"enabled": False}},
    }
    cfg.write_text(yaml.safe_dump(spec))
    argv = [sys.executable, "-m", "onlinerl_rollout", "--config", str(cfg), "--port", str(port), "--interval", "0.2"]
    return Child(name, argv, tmp_path / f"{name}.log").start(), port


def test_a_component_works_with_the_password_and_not_without(locked: EmbeddedValkey, tmp_path: Path) -> None:
    """The rollout controller (a real component process): healthy with the password, unhealthy without it."""
    good, good_port = _rollout_controller(tmp_path, "with-password", locked.url)
    bad, bad_port = _rollout_controller(tmp_path, "without-password", locked.public_url)
    try:
        good.wait_healthy(f"http://127.0.0.1:{good_port}/healthz", 30)
        wait_for(lambda: "authenticated" in log_tail(bad.log_path), 30, what="the refused controller to log it")
        wait_for(lambda: _status(bad_port) is not None, 30, what="the refused controller's HTTP server")
        assert _status(bad_port) == 503 and _status(good_port) == 200
        assert locked.password not in log_tail(good.log_path) + log_tail(bad.log_path)
    finally:
        good.stop()
        bad.stop()


def _status(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts and never answers: what a half-open connection looks like to a client."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for s in held:
            s.close()
        srv.close()


def test_a_half_open_connection_fails_within_the_deadline(silent_server: int) -> None:
    cfg = RedisConfig(url=f"redis://127.0.0.1:{silent_server}/0", socket_timeout_seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        connect(cfg, retry_on_timeout=False).ping()
    assert time.monotonic() - t0 < 3

    async def aping() -> None:
        await connect_async(cfg, retry_on_timeout=False).ping()

    t0 = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        asyncio.run(aping())
    assert time.monotonic() - t0 < 3


def test_a_blocking_read_outlives_its_block_time(locked: EmbeddedValkey) -> None:
    """XREADGROUP BLOCK 1 s with a 0.3 s reply deadline configured: the deadline is raised above the block."""
    cfg = RedisConfig(url=locked.url, socket_timeout_seconds=0.3)
    assert timeouts(cfg, 1.0)["socket_timeout"] == 1.0 + BLOCK_MARGIN_SECONDS
    r = connect(cfg, longest_block_seconds=1.0)
    r.xgroup_create("s", "g", id="0", mkstream=True)
    t0 = time.monotonic()
    assert r.xreadgroup("g", "c", {"s": ">"}, count=1, block=1000) == []
    assert 0.9 < time.monotonic() - t0 < 1.0 + BLOCK_MARGIN_SECONDS
    r.close()


def _redis_client_calls(path: Path) -> list[tuple[int, set[str]]]:
    """``(line, keyword names)`` of every ``redis.Redis(...)`` / ``*.from_url(...)`` on a redis module in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = ast.unparse(node.func.value)
        if node.func.attr in ("Redis", "from_url") and "redis" in owner.lower():
            out.append((node.lineno, {k.arg for k in node.keywords if k.arg}))
    return out


def test_every_redis_client_in_the_code_has_deadlines() -> None:
    """Every client is built through onlinerl.redisconn or passes both timeouts itself."""
    sources = [p for d in ("onlinerl", "services", "operator") for p in (ROOT / d).rglob("*.py")]
    missing = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in sources
        if p.name != "redisconn.py"
        for line, kws in _redis_client_calls(p)
        if not {"socket_timeout", "socket_connect_timeout"} <= kws
    ]
    assert not missing, f"Redis clients without socket_timeout/socket_connect_timeout: {missing}"
