"""The run's output folder: used by one run at a time, and never a fresh run over another's results.

Two runs writing into one folder interleave their metrics and overwrite each other's weights;
a fresh run started in a finished run's folder replaces its results (and makes its
``checkpoint.previous.pt`` the other run's). So a run *claims* its folder for as long as it
lives -- an advisory lock on ``OUT/.memplan.lock`` (``fcntl.lockf``), which the kernel lets go
of when the process ends however it ends, so that a killed run leaves no stale lock behind -- and a fresh
run refuses a folder that holds results unless told to replace them (``overwrite``).

The claim is the process's: claiming again in the same process (``fit`` claims before its
search, the trainer again when it starts) only counts. Ranks started by memplan's launcher
find the launcher's claim in their environment (:data:`HELD_ENV`) and leave it to it; ranks a
user started with ``torchrun`` claim on rank 0 only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from estimators import ConfigError

from ._checkpoint_io import SHARDED_DIR
from ._options import TrainOptions

__all__ = ["HELD_ENV", "claim_out_dir", "check_out_dir", "run_holds", "run_results", "remove_results"]

LOCK_NAME = ".memplan.lock"
HELD_ENV = "MEMPLAN_OUT_DIR_HELD"
"""Set for launched ranks to the folder their launcher holds (resolved path)."""

RESULT_NAMES = ("checkpoint.pt", "checkpoint.previous.pt", "model.pt", "best_model.pt", "metrics.jsonl",
                "summary.json", "report.html", SHARDED_DIR)
"""What a run leaves in its folder that a fresh run would overwrite (``plan.json`` is the
plan's, see :func:`run_results`)."""

_HELD: dict[Path, IO[str] | None] = {}
"""The folders this process holds, each with its open lock file (the outermost claim's)."""


def _key(out_dir: Path) -> Path:
    return Path(os.path.abspath(out_dir))


def run_results(out_dir: str | os.PathLike[str], *, plan: bool = False) -> list[str]:
    """The names of the results another run left in ``out_dir`` (``plan``: ``plan.json`` too,
    for a command that would search and write its own)."""
    root = Path(out_dir)
    names = RESULT_NAMES + (("plan.json",) if plan else ())
    return [name for name in names if (root / name).exists()]


def remove_results(out_dir: str | os.PathLike[str], *, plan: bool = False) -> list[str]:
    """Delete the results :func:`run_results` lists; returns their names."""
    root = Path(out_dir)
    found = run_results(root, plan=plan)
    for name in found:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for record in [*root.glob("oom-rank*.json"), *root.glob("failure-rank*.json")]:
        record.unlink(missing_ok=True)  # a crashed run's records would steer the new run's recovery
    return found


def check_out_dir(out_dir: str | os.PathLike[str], *, resume: bool, overwrite: bool, plan: bool = False,
                  flags: tuple[str, str] = ("--resume", "--overwrite")) -> list[str]:
    """Whether a run may start in ``out_dir``: a fresh run (neither ``resume`` nor ``overwrite``)
    refuses a folder holding another run's results; ``overwrite`` deletes them (returns their
    names); ``resume`` needs something to resume. ``plan``: the caller searches and writes its
    own ``plan.json``, so that one counts as a result, and as something to resume.
    ``flags`` names the two switches in the messages (``resume=True`` from Python)."""
    resume_flag, overwrite_flag = flags
    if resume and overwrite:
        raise ConfigError(f"{resume_flag} continues the run in {out_dir} and {overwrite_flag} replaces it; give one")
    found = run_results(out_dir, plan=plan)
    if overwrite:
        return remove_results(out_dir, plan=plan)
    if resume:
        resumable = [n for n in found if n.startswith("checkpoint") or n == "plan.json"]
        if not resumable:
            what = "checkpoint.pt or plan.json" if plan else "checkpoint.pt"
            raise ConfigError(
                f"{resume_flag}: {out_dir} holds no {what} to resume; drop {resume_flag} to start a fresh run there")
        return []
    if found:
        shown = ", ".join(found[:4]) + (", …" if len(found) > 4 else "")
        raise ConfigError(
            f"{out_dir} holds another run's results ({shown}); continue it with {resume_flag}, replace them "
            f"with {overwrite_flag}, or write into another folder")
    return []


@contextlib.contextmanager
def claim_out_dir(out_dir: str | os.PathLike[str], what: str = "the output folder") -> Iterator[None]:
    """Hold ``out_dir`` for the block: another process claiming it meanwhile gets a one-line
    :class:`ConfigError` naming the holder. Re-entrant within a process."""
    key = _key(Path(out_dir))
    if os.environ.get(HELD_ENV) == str(key):
        yield  # a rank of a launch: the launcher holds the folder for every rank
        return
    if key in _HELD:
        yield  # held by an outer claim of this process, which lets go of it
        return
    handle = _lock(key, what)
    _HELD[key] = handle
    try:
        yield
    finally:
        _HELD.pop(key, None)
        if handle is not None:
            handle.close()  # closing the file lets go of the lock


@contextlib.contextmanager
def run_holds(out_dir: str | os.PathLike[str], options: TrainOptions, *, holder: bool) -> Iterator[None]:
    """A run's hold on its folder (the trainer's rank 0, a launcher; ``holder`` False for the
    others): claimed, and -- unless it resumes, which a relaunch after an OOM does from whatever
    is there -- another run's results refused, or deleted with ``options.overwrite``."""
    if not holder:
        yield
        return
    with claim_out_dir(out_dir, "out_dir"):
        if not options.resume:
            check_out_dir(out_dir, resume=False, overwrite=options.overwrite, flags=("resume=True", "overwrite=True"))
        yield


def _lock(key: Path, what: str) -> IO[str] | None:
    """The open, locked lock file of ``key`` (None where the platform has no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; the folder is not guarded
        return None
    try:
        key.mkdir(parents=True, exist_ok=True)
        handle = open(key / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held until the claim ends
    except OSError as exc:
        raise ConfigError(f"{what} {key}: cannot write there ({exc.strerror}); choose a writable folder") from None
    try:
        # A POSIX record lock, not flock(): it belongs to this process alone, so that the
        # processes it forks (DataLoader workers that outlive a run) do not keep holding it.
        fcntl.lockf(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.seek(0)
        holder = _describe(handle.read())
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise ConfigError(
                f"{what} {key} is in use by another memplan run{holder}; wait for it to end, or write into "
                "another folder") from None
        raise ConfigError(f"{what} {key}: cannot lock {LOCK_NAME} ({exc.strerror}); write into a local folder") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    handle.flush()
    return handle


def _describe(text: str) -> str:
    """`` (pid 123 on host, since …)`` from the lock file's line, or nothing."""
    try:
        info = json.loads(text)
        return f" (pid {int(info['pid'])} on {info['host']}, since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return ""
