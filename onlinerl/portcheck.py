"""Before `onlinerl up` starts anything: is every port it needs free, and if not, who holds it?

A second `onlinerl up` beside a running one used to get as far as the embedded valkey and die there with a traceback
(``OSError: Port 16379 is already in use``). Checking every port first turns that into one line naming each busy
port, what it is for, and its holder when this user can see it: another `onlinerl up` (every process of a local
stack carries ``ONLINERL_STATE``, its state directory, in its environment) or any other process (pid and name).
Linux only for the holder (``/proc``); elsewhere the line says the port is busy without naming a holder.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

STATE_ENV = "ONLINERL_STATE"  # the state directory of the `onlinerl up` a process belongs to (set by the stack)
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp{,6}


@dataclass(frozen=True)
class Busy:
    port: int
    what: str  # the stack's use of it: "gateway", "valkey", ...
    pid: int | None = None  # the listening process, when this user can see it
    name: str = ""  # its command name
    state: str = ""  # its `onlinerl up`'s state directory, when it belongs to one


class CannotListen(ValueError):
    """Not "busy": the address itself cannot be listened on (not this machine's, or a privileged port)."""


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (with SO_REUSEADDR, as uvicorn and valkey do, so a closed
    connection's TIME_WAIT from a stopped stack does not count as busy). Any failure other than "in use" raises
    :class:`CannotListen` with the reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return True


def busy_ports(wanted: list[tuple[str, int, str]]) -> list[Busy]:
    """Each ``(host, port, use)`` of ``wanted`` that cannot be bound now, with its holder if known."""
    return [_holder(port, what) for host, port, what in wanted if not port_free(host, port)]


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _pid_holding(inodes: set[str]) -> int | None:
    """The process with a socket of ``inodes`` open (only this user's processes are readable)."""
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return int(entry.name)
        except OSError:
            continue
    return None


def _state_of(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    prefix = STATE_ENV.encode() + b"="
    return next((e[len(prefix) :].decode(errors="replace") for e in env if e.startswith(prefix)), "")


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, then ppid


def _up_state_of(pid: int) -> str:
    """The state directory of an `onlinerl up` process, from its command line (``--state``, default ``.onlinerl``,
    relative to its working directory); "" when ``pid`` is not one. Its children carry ``ONLINERL_STATE``; the CLI
    process itself (and so valkey, which it starts) does not in its start-up environment."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""
    if "up" not in argv or not any(Path(a).name == "onlinerl" or a.endswith("onlinerl.cli") for a in argv):
        return ""
    state = ".onlinerl"
    for i, a in enumerate(argv):
        if a == "--state" and i + 1 < len(argv):
            state = argv[i + 1]
        elif a.startswith("--state="):
            state = a.split("=", 1)[1]
    return str((Path(cwd) / state).resolve())


def _stack_state(pid: int) -> str:
    """The state directory of the local stack ``pid`` belongs to (itself or an ancestor), "" if none."""
    current: int | None = pid
    for _ in range(6):
        if current is None or current <= 1:
            return ""
        state = _state_of(current) or _up_state_of(current)
        if state:
            return state
        current = _parent_of(current)
    return ""


def _name_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _holder(port: int, what: str) -> Busy:
    inodes = _listening_inodes(port)
    pid = _pid_holding(inodes) if inodes else None
    if pid is None:
        return Busy(port, what)
    return Busy(port, what, pid, _name_of(pid), _stack_state(pid))


def holder_of(port: int) -> str:
    """Who listens on ``port``, in words; "" when that cannot be seen (another user's process, not Linux)."""
    b = _holder(port, "")
    if b.pid is None:
        return ""
    return f"pid {b.pid} ({b.name}{', `onlinerl up` state ' + b.state if b.state else ''})"


def describe(busy: list[Busy]) -> str:
    """One line for all busy ports: which, for what, held by whom (grouped by stack), and what to do."""
    parts: list[str] = []
    stacks: dict[str, list[Busy]] = {}
    for b in busy:
        if b.state:
            stacks.setdefault(b.state, []).append(b)
        elif b.pid is not None:
            parts.append(f"port {b.port} ({b.what}) is held by pid {b.pid} ({b.name})")
        else:
            parts.append(f"port {b.port} ({b.what}) is in use")
    for state, held in stacks.items():
        ports = ", ".join(f"{b.port} ({b.what}; its {b.name}, pid {b.pid})" for b in held)
        parts.insert(0, f"another `onlinerl up` (state {state}) holds port{'s' if len(held) > 1 else ''} {ports}")
    advice = "stop that stack (Ctrl-C where it runs) or" if stacks else "free them or"
    return (
        f"cannot start: {'; '.join(parts)}. {advice} give this one other ports (serving.port, feedback.port, "
        "trainer.metricsPort, serving.engineUrl in the config; --redis-port, --reloader-port, --rollout-port, "
        "--replica-base-port)"
    )
