"""Where a command will write, checked before it does any work.

A search can take minutes; an output path that cannot be written (a directory given for a
file, a folder under a file, a read-only place) is found at the start, as one line that names
the flag and the fix, not as a traceback when the result is ready.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from estimators import ConfigError

__all__ = ["writable_file", "writable_dir"]


def _nearest_existing(p: Path) -> Path:
    for candidate in (p, *p.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_can_create_in(folder: Path, flag: str, target: Path) -> None:
    """A file can be made in ``folder`` (tried for real: permissions, a read-only filesystem,
    a full disk all show the same way)."""
    if not folder.is_dir():
        raise ConfigError(f"{flag} {target}: {folder} is a file, not a folder; choose a path under a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".memplan-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {target}: cannot write in {folder} ({exc.strerror}); choose another path") from None


def writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a file this process can write (its folders are made when missing)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a folder; give a file name, e.g. {p / 'plan.json'}")
    _check_can_create_in(_nearest_existing(p.parent), flag, p)
    return p


def writable_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a folder this process can write in (made later, when missing)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file; give a folder")
    _check_can_create_in(_nearest_existing(p), flag, p)
    return p
