"""Kernel workspaces of a CPU target, measured once per setting and looked up per trace.

Fake tensors allocate no kernel scratch (oneDNN reorders, sort buffers): small real runs
measure it, and a fit of those runs (``_workspace.measure_fit``) carries it to any batch.
:class:`WorkspaceFits` keeps the fits of one task and says, for a trace, each op's workspace.
"""

from __future__ import annotations

import threading
from typing import Any

from .._config import TrainConfig
from ..task._task import Task
from ..tracing._trace import Trace
from ._workspace import (
    Source,
    WorkspaceFit,
    aligned_sources,
    borrow_holds,
    borrowed_sources,
    fit_key,
    measure_fit,
    reference_config,
    workspaces_at,
)

__all__ = ["DIVERGED", "WorkspaceFits", "WorkspaceModel"]

DIVERGED = "fake trace diverged from the real kernels"

WorkspaceModel = tuple[WorkspaceFit, list[Source | None]]
"""A fit and, per op of a trace, its place there (see ``_workspace.workspaces_at``)."""


class WorkspaceFits:
    """The workspace fits of one task, each measured once (thread-safe under ``lock``)."""

    def __init__(self, task: Task, lock: threading.RLock) -> None:
        self.task = task
        self._lock = lock
        self._workspace_fits: dict[tuple[Any, ...], WorkspaceFit | None] = {}
        self._borrow_checks: dict[tuple[Any, ...], bool] = {}  # a borrowed fit's key -> does it hold?

    def _planned_key(self, config: TrainConfig) -> tuple[Any, ...] | None:
        planned = self.task.planned(config.micro_batch_size)
        return planned.key() if planned is not None else None

    def fit_key(self, config: TrainConfig) -> tuple[Any, ...]:
        """Workspaces are fitted at the planned batch's padded size: kernels' scratch follows it."""
        return (*fit_key(config), self._planned_key(config))

    def workspaces(self, trace: Trace) -> tuple[list[int] | None, str | None, WorkspaceModel | None]:
        """Per-op CPU workspace bytes for ``trace``: measured directly when the trace was a
        real, profiled run, else carried over from a fit of real runs (see ``_workspace``),
        with the fit and each op's place in it.
        A checkpointed configuration borrows the fit of the same one without checkpointing
        when its ops are all found there and one real run of it confirms the borrowed figures
        (``borrow_holds``), and is measured on its own otherwise."""
        if trace.op_workspace is not None:
            return trace.op_workspace, None, None
        reference = reference_config(trace.config)
        if reference is not None and (*self.fit_key(trace.config), None) not in self._workspace_fits:
            borrowed = self.fit(reference)
            sources = borrowed_sources(trace, borrowed) if borrowed is not None else None
            if borrowed is not None and sources is not None and self.borrow_holds(trace.config):
                return workspaces_at(borrowed, sources, trace.batch_size), None, (borrowed, sources)
        fit = self.fit(trace.config, stage=trace.stage)
        if fit is None:
            return None, "kernel workspaces not measured (small-batch CPU runs failed)", None
        sources = aligned_sources(trace, fit)
        if sources is None:
            # Fake tensors took other kernels than the CPU runs: this model is measured for real.
            return None, DIVERGED, None
        return workspaces_at(fit, sources, trace.batch_size), None, (fit, sources)

    def fit(self, config: TrainConfig, *, stage: int | None = None) -> WorkspaceFit | None:
        """The fit of ``config``'s kernels (a pipeline's: of the stage of rank ``stage``)."""
        key = (*self.fit_key(config), stage)
        with self._lock:
            if key not in self._workspace_fits:
                self._workspace_fits[key] = measure_fit(self.task, config, stage=stage)
            return self._workspace_fits[key]

    def borrow_holds(self, config: TrainConfig) -> bool:
        """Does the fit of ``reference_config(config)`` hold for ``config``? Checked by one
        small real run (``borrow_holds``) per fit borrowed: a recomputed block runs its own
        forward again, on the same kernels or not whichever blocks are checkpointed. A fit
        that fails its check is not borrowed again: each setting measures its own."""
        reference = reference_config(config)
        if reference is None:
            return False
        key = (*fit_key(reference), config.checkpoint_policy)
        with self._lock:
            if key not in self._borrow_checks:
                fit = self.fit(reference)
                self._borrow_checks[key] = fit is not None and borrow_holds(self.task, config, fit)
            return self._borrow_checks[key]
