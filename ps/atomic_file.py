"""Write a file whole or not at all: a temporary file beside it, then a rename (readers never see it torn)."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def write_atomically(path: str, write: Callable[[BinaryIO], None], *, durable: bool = False) -> None:
    """Call ``write(f)`` on a temporary file in ``path``'s directory, then rename it to ``path``.

    ``durable``: fsync the file and the directory, so the rename survives a crash. On any error the temporary
    file is removed and the error raised."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        try:  # make the rename durable
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
