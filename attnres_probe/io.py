"""File writing and hashing shared by checkpoints, traces, training state, reports and the study.

Only the standard library: a module that writes a file does not pay for torch to do it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "sha256_file"]


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it onto ``path``.

    The rename is atomic, so readers see the old file or the new one, never half of one; if
    ``write`` fails (or is interrupted), ``path`` is untouched and the temporary file removed.

    Args:
        path: the file to create or replace; its folder must exist.
        write: writes the whole content to the path it is given.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
