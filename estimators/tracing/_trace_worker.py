"""A second process that traces fake steps while this one traces another.

Batch scaling needs two traces of every precision and checkpointing a search visits (three
for the first), and a fake trace is single-threaded Python: on a large model each takes
seconds, and a second core sits idle. The estimator hands one anchor of a pair to this
worker and traces the other itself; when a search says up front which configurations it
will ask (``Estimator.expect``), the worker gets a queue of fake traces while this process
runs the real CPU runs and its share of the traces.

The worker is forked, so it inherits the task (a model file's functions, an in-memory
module) without pickling it, and the warm dispatch caches; it runs fake tensors only, on one
intra-op thread (as DataLoader workers do after a fork). Only a :class:`Trace` or an
exception comes back. Where ``fork`` is not available the estimator traces alone.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TypeAlias

import torch

from .._config import TrainConfig
from ..task._task import Task
from ._compose import CutCache, trace_composed
from ._depth import DepthCut
from ._trace import Trace, trace_step

__all__ = ["TraceWorker", "worker_available", "close_all"]

_Request: TypeAlias = "tuple[int, TrainConfig, int, str, tuple[int, int] | None, bool, DepthCut | None] | None"
"""(ticket, configuration, batch size, target, capability, compose the block stack, a cut to
trace instead) to trace; None stops the worker."""

_Reply: TypeAlias = "tuple[int, str, str | BaseException]"
"""(ticket, "file", the path the trace was pickled to) or (ticket, "error", the exception)."""


def worker_available() -> bool:
    """Forking is safe for fake tracing on Linux (macOS forks without its system frameworks)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


_LIVE: weakref.WeakSet[TraceWorker] = weakref.WeakSet()


class WorkerDied(RuntimeError):
    """The worker process exited; the caller traces alone from now on."""


def close_all() -> None:
    """Stop every trace worker this process started and still holds (an estimator that is
    never closed keeps its worker until it is collected; tests that count processes, and a
    process about to fork others, want none)."""
    for worker in list(_LIVE):
        worker.close()


class TraceWorker:
    """One forked process answering ``trace_step`` requests for one task, in order.

    Requests may queue: the worker traces them one after another and writes each trace to a
    file (a trace is hundreds of kilobytes, more than a pipe holds: sent through the pipe,
    the worker would wait for this process to read it before starting the next one).
    """

    def __init__(self, task: Task) -> None:
        ctx = multiprocessing.get_context("fork")
        self._dir = tempfile.mkdtemp(prefix="memplan-trace-")
        self._conn: Connection[_Request, _Reply]
        child: Connection[_Reply, _Request]
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(task, child, self._dir), name="memplan-trace", daemon=True)
        self._proc.start()
        child.close()
        self._next_ticket = 0
        self._queued: list[int] = []
        _LIVE.add(self)
        # A worker collected unclosed (its estimator dropped mid-way) must not leave its process
        # behind: the weak set forgets it, so close_all() could not reach it any more.
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn, self._dir)

    def submit(self, config: TrainConfig, batch_size: int, target: str,
               capability: tuple[int, int] | None = None, compose: bool = False, cut: DepthCut | None = None) -> int:
        """Queue a trace (``compose``: of the block stack composed where it can be, see
        ``_compose.trace_composed``; ``cut``: of the model cut short, ``_depth``); returns its
        ticket (results come back in ticket order)."""
        ticket = self._next_ticket
        try:
            self._conn.send((ticket, config, batch_size, target, capability, compose, cut))
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerDied(str(exc)) from exc
        self._next_ticket += 1
        self._queued.append(ticket)
        return ticket

    def ready(self) -> bool:
        """Has the oldest queued trace come back (or the worker died)?"""
        try:
            return bool(self._queued) and self._conn.poll(0)
        except (EOFError, OSError):
            return True

    def next_result(self, timeout_s: float) -> tuple[int, Trace | BaseException]:
        """The oldest queued request's ticket and its trace, or the exception it raised.
        :class:`WorkerDied` when the worker exited, or sent nothing within ``timeout_s``
        (a worker stuck after the fork is killed)."""
        if not self._queued:
            raise RuntimeError("no trace was requested")
        try:
            if not self._conn.poll(timeout_s):
                self._proc.kill()
                raise WorkerDied(f"no trace from the worker within {timeout_s:.0f} s")
            ticket, kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"trace worker exited ({self._proc.exitcode})") from exc
        self._queued.remove(ticket)
        if isinstance(payload, BaseException):
            return ticket, payload
        assert kind == "file"
        try:
            with open(payload, "rb") as f:
                trace: Trace = pickle.load(f)
        finally:
            os.unlink(payload)
        return ticket, trace

    def result(self, timeout_s: float) -> Trace:
        """The oldest queued trace; its exception re-raised."""
        _ticket, payload = self.next_result(timeout_s)
        if isinstance(payload, BaseException):
            raise payload
        return payload

    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self) -> None:
        self._finalizer()  # stops the process once; a later call (or collection) does nothing
        self._queued.clear()
        _LIVE.discard(self)


def _stop(proc: BaseProcess, conn: Connection[_Request, _Reply], directory: str) -> None:
    """Ask the worker to exit (killed if it does not within 5 s), then drop its files."""
    try:
        conn.send(None)
    except (BrokenPipeError, EOFError, OSError):
        pass
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    conn.close()
    shutil.rmtree(directory, ignore_errors=True)


def _serve(task: Task, conn: Connection[_Reply, _Request], directory: str) -> None:
    torch.set_num_threads(1)
    cuts: CutCache = {}  # cut traces, shared by the compositions this worker makes
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if request is None:
            return
        ticket, config, batch_size, target, capability, compose, cut = request
        try:
            if cut is not None:
                trace = trace_step(task, config, batch_size=batch_size, target=target, capability=capability, cut=cut)
            elif compose:
                trace = trace_composed(task, config, batch_size=batch_size, target=target, capability=capability,
                                       cache=cuts)
            else:
                trace = trace_step(task, config, batch_size=batch_size, target=target, capability=capability)
            path = os.path.join(directory, f"{ticket}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(path + ".tmp", path)
            message: _Reply = (ticket, "file", path)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            message = (ticket, "error", exc)
        try:
            conn.send(message)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send((ticket, "error", RuntimeError(f"{type(message[2]).__name__}: {message[2]}")))
        except (BrokenPipeError, OSError):
            return
