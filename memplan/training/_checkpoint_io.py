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

Those folders are data too. ``checkpoint.pt`` names one only in the form the trainer writes
(``checkpoint-dcp/step-<step>-<id>``, inside the output folder: :func:`sharded_folder`); DCP's
``.metadata`` (a pickle, which DCP itself unpickles without restriction) is read by an unpickler
that builds only DCP's own metadata classes, sizes, dtypes and layouts
(:func:`read_sharded_metadata`); and the non-tensor values in the shard files (the optimizer's
hyperparameters, pickled by ``torch.save``) load with ``weights_only=True``, as ``checkpoint.pt``
does. A crafted folder is refused in one line before anything in it is unpickled.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import pickle
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from estimators import ConfigError, TrainingError, format_size

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["save_checkpoint", "load_checkpoint", "load_latest_checkpoint", "previous_path", "DamagedCheckpointError",
           "OutOfSpaceError", "out_of_space",
           "SHARDED_DIR", "save_sharded", "load_sharded", "remove_stale_sharded", "sharded_folder",
           "read_sharded_metadata"]


class DamagedCheckpointError(ConfigError):
    """A checkpoint file that cannot be read (cut short, overwritten, not a checkpoint)."""


class OutOfSpaceError(TrainingError):
    """A file of the run could not be written: its disk (or quota) is full."""


def out_of_space(exc: BaseException, path: str | os.PathLike[str] | None) -> OutOfSpaceError | None:
    """The one-line error for a write of ``path`` (None: a file the error does not name) that
    failed for lack of space (a full disk, a used-up quota, the process's file-size limit), or
    None when ``exc`` is another failure. torch's own writer reports a full disk as a
    ``RuntimeError`` ("file write failed") without the OS's error number; the free space then tells."""
    target = Path(path) if path is not None else None
    folder = target.parent if target is not None else Path.cwd()
    code = exc.errno if isinstance(exc, OSError) else None
    if isinstance(exc, RuntimeError) and "write failed" in str(exc) and 0 <= _free_bytes(folder) < _NEARLY_FULL:
        code = errno.ENOSPC
    if code == errno.ENOSPC:
        free = _free_bytes(folder) if target is not None else -1
        why = "no space left on its disk" + (f" ({format_size(free)} free)" if free >= 0 else "")
        fix = "free some space (or write into a folder on another disk)"
    elif code == errno.EDQUOT:
        why, fix = "the disk quota is used up", "free some of the quota (or write into another folder)"
    elif code == errno.EFBIG:
        why, fix = "it would be larger than this process may write (ulimit -f)", "raise the limit"
    else:
        return None
    return OutOfSpaceError(f"could not write {target if target is not None else 'a file'}: {why}; {fix} and continue with --resume: "
                           "the checkpoints already written are whole")


_NEARLY_FULL = 16 * 2**20
"""Less than this free after a failed write: the disk was full (a write fails at the block it
cannot place, and the file system keeps a few blocks back)."""


def _free_bytes(folder: Path) -> int:
    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return -1


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
    except BaseException as exc:
        # Whatever went wrong (disk full, KeyboardInterrupt), the old checkpoint is untouched;
        # only the temporary file is ours to clean up.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        full = out_of_space(exc, target)
        if full is not None:
            raise full from None
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
        raise DamagedCheckpointError(
            f"{p} is damaged or not a memplan checkpoint ({type(exc).__name__}: {_first_line(exc)})"
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
    flatten: bool = False,
) -> None:
    """Every rank writes its shards of the model, the optimizer state and ``extra`` (dicts of
    tensors, e.g. EMA weights) into the folder ``path`` with ``torch.distributed.checkpoint``
    (a collective: all ranks call it). Keys are parameter names, so the folder loads into any
    layout: another world size, or a plain module in one process (:func:`load_sharded`).
    ``flatten``: the optimizer's parameter groups are kept per parameter (a pipeline's ranks
    each hold other parameters: one list of groups for all of them would be one rank's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
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
    loads in this process alone. Nothing in the folder runs: its ``.metadata`` is read by
    :func:`read_sharded_metadata`, its non-tensor values with ``weights_only=True``; a folder
    that does not load raises :class:`DamagedCheckpointError` in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    target = Path(path)
    if not target.is_dir():
        raise FileNotFoundError(f"sharded checkpoint folder {target} is missing")
    metadata = read_sharded_metadata(target)  # before DCP reads anything
    reader_type, planner_type = _safe_dcp_types()
    # Written with the groups per parameter (save_sharded's flatten) or as one list, whose
    # groups name their parameters (``optimizer.param_groups.0.params``).
    keys = metadata.state_dict_metadata
    grouped = any(k.startswith("optimizer.param_groups.") for k in keys)
    listed = any(re.fullmatch(r"optimizer\.param_groups\.\d+\.params", k) for k in keys)
    options = StateDictOptions(flatten_optimizer_state_dict=grouped and not listed)
    # get_state_dict creates the optimizer's state (with a zero learning rate) so that DCP has
    # tensors of the right shapes to load into.
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state, **(extra or {})}
    try:
        with warnings.catch_warnings():
            # Loading without a process group is the point here (an FSDP run resumed in one process).
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader_type(target, metadata), planner=planner_type())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's are BaseExceptions, one per rank
        cause = _first_failure(exc)
        if isinstance(cause, DamagedCheckpointError):
            raise DamagedCheckpointError(f"{target}: {cause}") from None
        if isinstance(cause, torch.OutOfMemoryError) or not isinstance(cause, Exception):
            raise  # not the checkpoint's doing: as DCP raised it
        raise DamagedCheckpointError(
            f"the sharded checkpoint {target} could not be loaded ({type(cause).__name__}: {_first_line(cause)}); "
            "resume with the model and optimizer that wrote it, or train into another --out"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


_SHARDED_NAME = re.compile(r"step-[0-9]{8,}-[0-9a-f]{8}")
"""The name :meth:`CheckpointManager._save_sharded` gives a sharded checkpoint's folder:
``step-<step, 8 digits or more>-<4 random bytes in hex>``."""


def sharded_folder(out_dir: str | os.PathLike[str], entry: object, *, checkpoint: str | os.PathLike[str]) -> Path:
    """The folder that ``checkpoint``'s ``dcp`` entry names, once it is known to be the run's
    own: ``checkpoint-dcp/step-<step>-<id>`` (the form the trainer writes; no other path,
    absolute or relative) inside ``out_dir``, a folder there and not a link to one elsewhere.
    Anything else raises :class:`DamagedCheckpointError` in one line."""
    root = Path(out_dir) / SHARDED_DIR
    prefix = f"{SHARDED_DIR}/"
    name = entry[len(prefix):] if isinstance(entry, str) and entry.startswith(prefix) else None
    if name is None or not _SHARDED_NAME.fullmatch(name):
        raise DamagedCheckpointError(
            f"{checkpoint} names {entry!r} as its sharded checkpoint folder; a resume reads only the run's own, "
            f"{SHARDED_DIR}/step-<step>-<id> inside the output folder (the checkpoint was altered or is not "
            "memplan's): train into another --out, or delete the checkpoint files to start over")
    folder = root / name
    if folder.is_symlink() or (folder.is_dir() and folder.resolve().parent != root.resolve()):
        raise DamagedCheckpointError(
            f"{checkpoint} names the sharded checkpoint folder {folder}, which is a link (to {folder.resolve()}); "
            "a resume reads only the run's own folder: put the folder itself there, or train into another --out")
    if not folder.is_dir():
        raise DamagedCheckpointError(
            f"{checkpoint} names the sharded checkpoint folder {folder}, which is missing (copied without it?); "
            "copy the folder too, or train into another --out")
    return folder


# What DCP's .metadata holds (torch 2.13, FileSystemWriter.finish: pickle.dump(Metadata)), as
# recorded from the checkpoints of FSDP2 runs and of torch.distributed.checkpoint.save in one
# process; every one builds plain data: dataclasses (restored by attribute), a tuple subclass, an
# enum member by value, a layout by name, a path from strings.
_METADATA_GLOBALS = frozenset({
    # The metadata itself and its parts (dataclasses).
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    # TensorProperties' memory format, pickled as this enum's member (torch.memory_format is not picklable).
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # Where each item lies in the shard files (a dataclass of the file name, offset and length).
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Sizes and offsets (a tuple subclass); a tensor's layout, rebuilt from its name ("torch.strided").
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    # StorageMeta.checkpoint_id: the folder it was saved to (a Windows run writes a WindowsPath).
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
})


@functools.cache
def _dtype_names() -> frozenset[str]:
    """The names dtypes pickle as (``torch.float32``: the global ``float32`` of ``torch``);
    from the module's namespace, so that no lookup of another name runs torch's lazy imports."""
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of; any other global (a function to call, a
    class to build) is refused before it is looked up. No persistent ids (``persistent_load``
    is not defined: pickle refuses them)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _dtype_names()):
            return super().find_class(module, name)
        raise _RefusedGlobal(module, name)


def read_sharded_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """The ``.metadata`` of a sharded checkpoint folder, unpickled without running anything
    (only DCP's metadata classes, sizes, dtypes, layouts and paths are built), checked to be
    DCP metadata whose shard files lie in the folder itself. Anything else raises
    :class:`DamagedCheckpointError` in one line."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / ".metadata"
    fix = "the checkpoint was altered or is not memplan's: train into another --out, or delete it to start over"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path} is missing: the sharded checkpoint was cut short; {fix}") from None
    except _RefusedGlobal as exc:
        raise DamagedCheckpointError(
            f"{path} holds {exc.qualified}, which DCP's metadata never does (it could run code), refused "
            f"unread; {fix}") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or overwritten pickle, whatever the error
        raise DamagedCheckpointError(
            f"{path} is damaged ({type(exc).__name__}: {_first_line(exc)}); {fix}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise DamagedCheckpointError(
            f"{path} is not a sharded checkpoint's metadata (it holds a {type(metadata).__name__}); {fix}")
    for info in (metadata.storage_data or {}).values():
        file = getattr(info, "relative_path", None) if isinstance(info, _StorageInfo) else None
        if not isinstance(file, str) or not file or file in (".", "..") or "/" in file or "\\" in file:
            raise DamagedCheckpointError(
                f"{path} places shards at {file!r}, outside its folder; {fix}")
    return metadata


@functools.cache
def _safe_dcp_types() -> tuple[type, type]:
    """DCP's file-system reader and default load planner, made safe (built on first use: DCP is
    imported only by runs that need it): the reader hands DCP the metadata read by
    :func:`read_sharded_metadata` instead of unpickling ``.metadata`` itself; the planner loads
    the non-tensor values with ``weights_only=True`` (DCP's own uses ``weights_only=False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class CheckedReader(FileSystemReader):
        def __init__(self, path: Path, metadata: Metadata) -> None:
            super().__init__(path)
            self._checked = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if kwargs.get("rank") is not None:  # rank-local metadata: memplan never writes it
                raise FileNotFoundError(f"{self.path}: a sharded checkpoint of memplan has one .metadata")
            metadata = self._checked
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class PlainDataPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                data = torch.load(value, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - refused or damaged: one line either way
                found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
                what = f"holds the global {found.group(1)}, refused unread (it could run code)" if found else \
                    f"is damaged ({type(exc).__name__}: {_first_line(exc)})"
                raise DamagedCheckpointError(
                    f"its value {read_item.dest_index.fqn!r} {what}; the checkpoint was altered "
                    "or is not memplan's: train into another --out, or delete it to start over") from None
            # DCP's own load_bytes puts the value in place (nested keys and all); it unpickles
            # what it is given with weights_only=False, so it gets the checked value again.
            checked = io.BytesIO()
            torch.save(data, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return CheckedReader, PlainDataPlanner


def _first_failure(exc: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (each rank's, wrapped): the first rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


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
