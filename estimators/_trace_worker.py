"""A second process that traces fake steps while this one traces another.

Batch scaling needs two traces of every precision and checkpointing a search visits (three
for the first), and a fake trace is single-threaded Python: on a large model each takes
seconds, and a second core sits idle. The estimator hands one anchor of a pair to this
worker and traces the other itself.

The worker is forked, so it inherits the task (a model file's functions, an in-memory
module) without pickling it, and the warm dispatch caches; it runs fake tensors only, on one
intra-op thread (as DataLoader workers do after a fork). Only a :class:`Trace` or an
exception comes back. Where ``fork`` is not available the estimator traces alone.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
from typing import Any

import torch

from ._config import TrainConfig
from ._task import Task
from ._trace import Trace, trace_step

__all__ = ["TraceWorker", "worker_available"]


def worker_available() -> bool:
    """Forking is safe for fake tracing on Linux (macOS forks without its system frameworks)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class WorkerDied(RuntimeError):
    """The worker process exited; the caller traces alone from now on."""


class TraceWorker:
    """One forked process answering ``trace_step`` requests for one task, one at a time."""

    def __init__(self, task: Task) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(task, child), name="memplan-trace", daemon=True)
        self._proc.start()
        child.close()
        self._busy = False

    def submit(self, config: TrainConfig, batch_size: int, target: str) -> None:
        if self._busy:
            raise RuntimeError("the trace worker runs one request at a time")
        try:
            self._conn.send((config, batch_size, target))
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerDied(str(exc)) from exc
        self._busy = True

    def result(self, timeout_s: float) -> Trace:
        """The submitted trace; its exception re-raised, or :class:`WorkerDied` (also when
        nothing came within ``timeout_s``: a worker stuck after the fork is killed)."""
        try:
            if not self._conn.poll(timeout_s):
                self._proc.kill()
                raise WorkerDied(f"no trace from the worker within {timeout_s:.0f} s")
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"trace worker exited ({self._proc.exitcode})") from exc
        finally:
            self._busy = False
        if isinstance(message, BaseException):
            raise message
        return message

    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, EOFError, OSError):
            pass
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()


def _serve(task: Task, conn: Any) -> None:
    torch.set_num_threads(1)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if request is None:
            return
        config, batch_size, target = request
        try:
            out: Any = trace_step(task, config, batch_size=batch_size, target=target)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            out = exc
        try:
            conn.send(out)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(RuntimeError(f"{type(out).__name__}: {out}"))
        except (BrokenPipeError, OSError):
            return
