"""`onlinerl up` checks every port it needs before it starts anything (no vLLM here: seconds).

The newcomer's case: a second `onlinerl up` beside a running one used to get as far as the embedded valkey and die
with a traceback (``OSError: Port 16379 is already in use``). Now: one line naming each busy port, what it is for and
its holder (another `onlinerl up` with its state directory, when it is one), exit code 2, nothing started and nothing
written. The same against a whole running stack, and the loopback default, are tests/loop/test_up_safe_defaults.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from onlinerl import ports
from onlinerl.config import OnlineRLConfig
from onlinerl.loop.stack import LocalPorts, exposure_warning, needed_ports
from onlinerl.portcheck import STATE_ENV, busy_ports, describe, holder_of, port_free
from onlinerl.procs import wait_for
from onlinerl.valkey import free_port

ONLINERL = str(Path(sys.executable).parent / "onlinerl")
HOLD = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(120)"


def _listener(port: int, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(port=port)], env={**os.environ, **env})
    wait_for(lambda: not port_free("127.0.0.1", port), 10, what=f"a listener on {port}")
    return proc


def _config(tmp_path: Path, **serving) -> tuple[Path, dict[str, int]]:
    """A config and flags whose every port is free, as a user with a second stack would write them."""
    p = {n: free_port() for n in ("gateway", "engine", "feedback", "metrics", "redis", "reloader", "rollout")}
    data = {
        "serving": {"port": p["gateway"], "engineUrl": f"http://127.0.0.1:{p['engine']}", **serving},
        "feedback": {"port": p["feedback"]},
        "trainer": {"metricsPort": p["metrics"]},
    }
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump(data))
    return f, p


def _up(config: Path, state: Path, p: dict[str, int], *extra: str) -> subprocess.CompletedProcess:
    argv = [ONLINERL, "--config", str(config), "up", "--state", str(state), "--redis-port", str(p["redis"])]
    argv += ["--reloader-port", str(p["reloader"]), "--rollout-port", str(p["rollout"]), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("which", ["redis", "gateway", "engine", "rollout"])
def test_a_busy_port_is_one_line_exit_2_naming_the_other_stack(tmp_path: Path, which: str) -> None:
    config, p = _config(tmp_path)
    first_state = (tmp_path / "first" / ".onlinerl").resolve()
    holder = _listener(p[which], {STATE_ENV: str(first_state)})  # a process of another stack (as its valkey is)
    try:
        t0 = time.monotonic()
        out = _up(config, tmp_path / "second", p)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    line = lines[0]
    assert f"another `onlinerl up` (state {first_state}) holds port {p[which]} (" in line, line
    assert f"pid {holder.pid})" in line
    assert took < 30, took
    assert not (tmp_path / "second").exists()  # nothing started, nothing written


def test_the_up_process_itself_is_known_by_its_command_line(tmp_path: Path) -> None:
    """The CLI process (and what it starts without the variable, valkey) is named from ``onlinerl up --state``."""
    port = free_port()
    argv = [sys.executable, "-c", HOLD.format(port=port), "onlinerl", "up", "--state", "mine"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != STATE_ENV})
    try:
        wait_for(lambda: not port_free("127.0.0.1", port), 10, what="the listener")
        (busy,) = busy_ports([("127.0.0.1", port, "valkey")])
    finally:
        proc.kill()
        proc.wait()
    assert busy.state == str((tmp_path / "mine").resolve()) and busy.pid == proc.pid


def test_any_other_holder_is_named_by_pid(tmp_path: Path) -> None:
    port = free_port()
    other = _listener(port, {STATE_ENV: ""})
    try:
        busy = busy_ports([("127.0.0.1", port, "feedback")])
        assert holder_of(port).startswith(f"pid {other.pid} (")
    finally:
        other.kill()
        other.wait()
    assert [b.port for b in busy] == [port]
    line = describe(busy)
    assert f"port {port} (feedback) is held by pid {other.pid} (" in line and "\n" not in line
    assert "serving.port" in line  # says what to change


def test_every_port_of_the_stack_is_checked_on_its_own_address() -> None:
    """valkey and vLLM always on loopback; the rest on --host; with replicas, each replica's own ports too."""
    cfg = OnlineRLConfig.model_validate({"serving": {"port": 18000}, "feedback": {"port": 18002}})
    local = LocalPorts(redis=16400, reloader=18004, rollout=18005)
    wanted = needed_ports(cfg, local, "0.0.0.0")
    assert ("127.0.0.1", 16400, "valkey") in wanted and ("127.0.0.1", ports.ENGINE, "vLLM") in wanted
    assert {w for h, _, w in wanted if h == "0.0.0.0"} == {
        "gateway",
        "reloader",
        "feedback",
        "trainer metrics",
        "rollout controller",
    }
    multi = OnlineRLConfig.model_validate({"serving": {"port": 18000, "replicas": 2}})
    names = {w for _, _, w in needed_ports(multi, LocalPorts(replica_base=19000), ports.LOOPBACK)}
    assert {"vLLM-0", "vLLM-1", "gateway-0", "gateway-1", "reloader-0", "reloader-1", "balancer"} <= names
    direct = OnlineRLConfig.model_validate({"rollout": {"strategy": "direct"}, "redis": {"url": "redis://x:1/0"}})
    names = {w for _, _, w in needed_ports(direct, local, ports.LOOPBACK)}
    assert "rollout controller" not in names and "valkey" not in names


def test_opening_the_stack_names_what_becomes_reachable() -> None:
    cfg = OnlineRLConfig.model_validate({"serving": {"port": 18000}, "feedback": {"port": 18002}})
    assert exposure_warning(cfg, LocalPorts(), ports.LOOPBACK) == ""
    warning = exposure_warning(cfg, LocalPorts(), "0.0.0.0")
    for part in ("gateway :18000", "feedback :18002", "trainer metrics :8003", "reloader :8004", "rollout"):
        assert part in warning, warning
    assert "valkey and vLLM stay on 127.0.0.1" in warning


def test_an_address_not_of_this_machine_is_said_so_not_busy(tmp_path: Path) -> None:
    config, p = _config(tmp_path)
    out = _up(config, tmp_path / "s", p, "--host", "192.0.2.1")  # TEST-NET-1: never a local address
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot listen on 192.0.2.1:" in out.stderr and "in use" not in out.stderr


def test_a_port_in_time_wait_is_not_busy() -> None:
    """A stopped stack leaves its closed connections in TIME_WAIT; servers bind with SO_REUSEADDR, so must the check."""
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    server.close()
    assert port_free("127.0.0.1", port)
