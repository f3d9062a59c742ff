"""Atomic checkpoint files: a crash or a kill mid-write never leaves a half-written checkpoint.

A checkpoint is written to a temporary file in the *same* directory (so that the final rename
stays on one file system and is atomic), flushed and fsync'ed (so that the bytes are on disk
before the name points at them), then moved over the old file with ``os.replace``. Readers see
either the old checkpoint or the new one, never a mix. The directory is fsync'ed too, so the
rename itself survives a power loss on file systems that need it (ext4 without ``auto_da_alloc``).

Checkpoints hold only tensors, numbers, strings, lists, tuples and dicts, so that
``torch.load(path)`` with its safe default (``weights_only=True``) reads them: a checkpoint is
data, loaded without executing anything.

The trainer's ``checkpoint.pt`` keeps the one before it beside it
(``checkpoint.previous.pt``, moved aside by a rename just before the new one takes the name):
a checkpoint damaged after it was written (a disk fault, a copy cut short) then costs one
checkpoint interval, not the run (:func:`load_latest_checkpoint`).

FSDP2 runs keep their sharded tensors in a ``torch.distributed.checkpoint`` folder instead
(:func:`save_sharded`): every rank writes its shards into a temporary folder, which is renamed
when all are done; the small ``checkpoint.pt`` written after it names the folder, so the rename
of ``checkpoint.pt`` stays the one moment a new checkpoint becomes the current one. On several
machines the output folder must be on a file system that all of them share.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from estimators import ConfigError

__all__ = ["save_checkpoint", "load_checkpoint", "load_latest_checkpoint", "previous_path", "DamagedCheckpointError",
           "SHARDED_DIR", "save_sharded", "load_sharded", "remove_stale_sharded"]


class DamagedCheckpointError(ConfigError):
    """A checkpoint file that cannot be read (cut short, overwritten, not a checkpoint)."""


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint before ``path`` is kept: ``checkpoint.pt`` -> ``checkpoint.previous.pt``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.previous{p.suffix}")


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *, keep_previous: bool = False) -> Path:
    """Write ``obj`` with ``torch.save`` to ``path`` atomically; returns the path.
    ``keep_previous``: the file it replaces is kept at :func:`previous_path`.

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
        if keep_previous and target.exists():
            # A crash between the two renames leaves the previous one alone, which
            # load_latest_checkpoint reads.
            os.replace(target, previous_path(target))
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
    """Read a checkpoint written by :func:`save_checkpoint` (safe loading: tensors and plain
    data). A file that cannot be read raises :class:`DamagedCheckpointError` in one line."""
    p = Path(path)
    try:
        return torch.load(p, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - zip, pickle and unpickler errors alike
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DamagedCheckpointError(
            f"{p} is damaged or not a memplan checkpoint ({type(exc).__name__}: {first})"
        ) from None


def load_latest_checkpoint(
    path: str | os.PathLike[str], *, map_location: str | torch.device | None = "cpu"
) -> tuple[Any, Path, str | None]:
    """The newest readable checkpoint of ``path`` and its kept predecessor: (contents, the file
    read, why the newest was passed over or None). Raises :class:`DamagedCheckpointError`
    when neither can be read, ``FileNotFoundError`` when neither exists."""
    latest, previous = Path(path), previous_path(path)
    try:
        return load_checkpoint(latest, map_location=map_location), latest, None
    except FileNotFoundError:
        if not previous.exists():
            raise
        why = f"{latest} is missing"
    except DamagedCheckpointError as exc:
        if not previous.exists():
            raise DamagedCheckpointError(
                f"{exc}; no earlier checkpoint is kept beside it: delete it to start over, or train into another --out"
            ) from None
        why = str(exc)
    try:
        return load_checkpoint(previous, map_location=map_location), previous, why
    except DamagedCheckpointError as exc:
        raise DamagedCheckpointError(
            f"{why}, and so is the one before it: {exc}; delete both to start over, or train into another --out"
        ) from None


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


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints (FSDP2): torch.distributed.checkpoint
# ----------------------------------------------------------------------------------------------

SHARDED_DIR = "checkpoint-dcp"
"""The folder beside ``checkpoint.pt`` that holds FSDP2 runs' sharded tensors, one subfolder per
checkpoint; ``checkpoint.pt`` names the current one."""


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Every rank writes its shards of the model, the optimizer state and ``extra`` (dicts of
    tensors, e.g. EMA weights) into the folder ``path`` with ``torch.distributed.checkpoint``
    (a collective: all ranks call it). Keys are parameter names, so the folder loads into any
    layout: another world size, or a plain module in one process (:func:`load_sharded`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state, **(extra or {})}, checkpoint_id=Path(path))


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Load a folder written by :func:`save_sharded` into ``model`` and ``optimizer`` (and, in
    place, the tensors of ``extra``), resharded to their layout. Without a process group it
    loads in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    target = Path(path)
    if not target.is_dir():
        raise FileNotFoundError(f"sharded checkpoint folder {target} is missing")
    # get_state_dict creates the optimizer's state (with a zero learning rate) so that DCP has
    # tensors of the right shapes to load into.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, **(extra or {})}
    with warnings.catch_warnings():
        # Loading without a process group is the point here (an FSDP run resumed in one process).
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=target)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def remove_stale_sharded(root: str | os.PathLike[str], *, keep: str | set[str]) -> None:
    """Delete the sharded checkpoints in ``root`` other than ``keep`` (and left-over temporary
    folders), once ``checkpoint.pt`` points at ``keep`` (a set: the folders of the current and
    the kept previous checkpoint)."""
    import shutil

    folder = Path(root)
    if not folder.is_dir():
        return
    kept = {keep} if isinstance(keep, str) else set(keep)
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name not in kept:
            shutil.rmtree(entry, ignore_errors=True)
