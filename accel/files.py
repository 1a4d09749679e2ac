"""accel's files on disk: the user cache folder, and writes that never leave a file half-written.

Everything accel derives once and keeps (converted checkpoints, joined GGUF files, cost tables,
training data) lives under :func:`cache_dir`. Every such file is written through
:func:`atomic_path`: into a temporary file beside it, renamed over the destination only once
complete, so an interrupt leaves the old file or none, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["cache_dir", "atomic_path", "write_text_atomic"]


def cache_dir() -> Path:
    """The accel user cache folder: ``$ACCEL_CACHE`` if set, else ``~/.cache/accel``."""
    env = os.environ.get("ACCEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "accel"


@contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``dest`` to write; renamed onto ``dest`` (mode 0644) when the
    block ends normally, removed when it raises. Creates ``dest``'s folder."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(dest: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) at ``dest`` through :func:`atomic_path`."""
    with atomic_path(dest) as tmp:
        tmp.write_text(text, encoding="utf-8")
