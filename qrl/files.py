"""Files written whole: a reader sees the old file or the new one, never half of one, and a
link planted where the file goes is replaced, never followed."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` with ``write(file)``: into a new file of a fresh name beside it
    (created exclusively, so no planted link or file of that name is followed or reused),
    then renamed over ``path`` (a rename replaces a link at ``path`` itself, not what it
    points to). The file is its owner's only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
