"""Atomic checkpoint files: a crash or a kill mid-write never leaves a half-written checkpoint.

A checkpoint is written to a temporary file in the *same* directory (so that the final rename
stays on one file system and is atomic), flushed and fsync'ed (so that the bytes are on disk
before the name points at them), then moved over the old file with ``os.replace``. Readers see
either the old checkpoint or the new one, never a mix. The directory is fsync'ed too, so the
rename itself survives a power loss on file systems that need it (ext4 without ``auto_da_alloc``).

Checkpoints hold only tensors, numbers, strings, lists, tuples and dicts, so that
``torch.load(path)`` with its safe default (``weights_only=True``) reads them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``obj`` with ``torch.save`` to ``path`` atomically; returns the path.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> p = save_checkpoint({"step": 3, "w": torch.ones(2)}, f"{d}/checkpoint.pt")
        >>> load_checkpoint(p)["step"]
        3
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        # Whatever went wrong (disk full, KeyboardInterrupt), the old checkpoint is untouched;
        # only the temporary file is ours to clean up.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)
    return target


def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device | None = "cpu") -> Any:
    """Read a checkpoint written by :func:`save_checkpoint` (safe loading: tensors and plain data)."""
    return torch.load(Path(path), map_location=map_location, weights_only=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
