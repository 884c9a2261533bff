"""Files written whole (a reader sees the old file or the new one, never half of one) or
appended to; either way a link planted where the file goes is replaced, never followed."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` with ``write(file)``: into a new file of a fresh random name beside it
    (``O_EXCL``: a planted link or file of that name is never followed or reused), then
    renamed over ``path`` (a rename replaces a link at ``path`` itself, not what it points
    to). The mode is that of any new file (0666 less the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, value: Any) -> None:
    """``value`` as indented JSON, written atomically (see :func:`write_atomically`)."""
    write_atomically(path, lambda f: f.write(json.dumps(value, indent=2).encode()))


def open_appending(path: Path, mode: int = 0o666) -> int:
    """A descriptor of ``path`` for reading and appending, created if missing (``mode`` less
    the umask). ``O_NOFOLLOW``: a link planted at ``path`` is removed and a new file made in
    its place, never the link's target appended to (one planted again meanwhile: OSError)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
    try:
        return os.open(path, flags, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    os.unlink(path)
    return os.open(path, flags | os.O_EXCL, mode)
