"""Files that hold secrets (passwords, API keys, URLs with a password) are mode 0600 from the moment they exist.

Writing a file and then ``chmod``-ing it leaves a window in which it is readable under the umask (usually 0644):
any local user can read the password then, or hold the file open and read it later. Here the content goes into a
new temporary file in the same folder, created with ``O_CREAT | O_EXCL`` and mode 0600 (and ``fchmod`` 0600 before
the first byte, whatever the umask), which then atomically replaces the target (``os.replace``). A reader sees the
old file or the new one, never a partial or a readable one. The one helper every writer of secrets uses
(valkey.py, auth.py, loop/stack.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

SECRET_MODE = 0o600


def write_secret(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (mode 0600, atomically replacing any existing file); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), SECRET_MODE)
    try:
        os.fchmod(fd, SECRET_MODE)  # a umask can only remove bits; this also restores the owner's if it did
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1  # owned by f now
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return path
