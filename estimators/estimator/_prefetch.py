"""Tracing on both cores: a worker process and this one share the fake traces to be made.

Two ways in, both used by :class:`~estimators.estimator._traces.TraceSource` (this module is its
mixin, kept apart so that the single-process path reads on its own):

* a *prefetch* (``Estimator.expect(..., prefetch=True)``): every trace a search will need is
  queued; the worker takes them from the queue's front, kept two ahead, and this process runs
  its own share (the real CPU runs: batch 1, kernel workspaces) and then takes fake traces
  from the queue's end whenever it waits for the worker;
* *parallel anchors* (``trace_in_parallel``): without a prefetch, the last missing anchor of a
  slow model is traced in the worker while this process traces the others.

A worker that dies or fails leaves the work to this process; a trace that failed in the
worker is traced here again, which raises its error properly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._config import TrainConfig
from ..memory._workspace import WORKSPACE_ANCHORS
from ..tracing._compose import CutTracer, stack_facts
from ..tracing._depth import DepthCut
from ..tracing._trace import Trace
from ..tracing._trace_worker import TraceWorker, WorkerDied, worker_available

if TYPE_CHECKING:
    import threading

    from ..memory._prepare import Prepared
    from ..memory._workspace_cache import WorkspaceFits
    from ..task._task import Task
    from ._traces import ShapeKey, TraceKey

__all__ = ["PARALLEL_CUT_PARAMS", "PARALLEL_TRACE_S", "Prefetching"]

PARALLEL_TRACE_S = 1.0
"""Fake traces taking at least this long share batch-scaling anchors with a worker process
(and a composed trace's two cuts, ``_cut_tracer``)."""

PARALLEL_CUT_PARAMS = 500_000_000
"""Before any trace of a model says how long they take: models this large trace a composed
trace's two cuts on both cores."""


class Prefetching:
    """The worker half of a ``TraceSource``: the worker, its queue and what it sent back.

    The host class provides ``task``, ``device``, ``compose_blocks``, ``_lock``, ``_data_dependent``,
    ``_fake_traced``, ``_last_fake_trace_s``, ``workspace_fits`` and the methods
    ``prepared``, ``have``, ``shape_key``, ``_capability``, ``_raw_trace``, ``_keep_derived``
    and ``_prepare``.
    """

    def _init_prefetch(self) -> None:
        self._worker: TraceWorker | None = None
        self._worker_failed = False
        # A prefetch: traces queued in the worker (key -> ticket), those it sent back and
        # not yet prepared, and this process's share, run while it waits.
        self._pending: dict[TraceKey, int] = {}
        self._queue: list[tuple[TraceKey, TrainConfig, int]] = []  # fake traces not yet handed out
        self._fetched: dict[TraceKey, Trace] = {}
        self._ahead: list[tuple[str, TrainConfig, int]] = []
        self._anchor_in_flight = False  # the worker traces a batch-scaling anchor (trace_in_parallel)

    def can_prefetch(self) -> bool:
        """Is a worker process worth starting for a prefetch (two cores, fake traces)?"""
        return not (self._data_dependent or self._worker_failed or not worker_available()
                    or (os.cpu_count() or 1) < 2)

    def prefetch(self, fake: dict[TraceKey, tuple[TrainConfig, int]],
                 local: list[tuple[str, TrainConfig, int]]) -> None:
        """Queue the ``fake`` traces (key -> (configuration, batch)) for both processes and
        keep ``local`` (this process's real runs: ``trace``, ``workspace`` and ``borrow``
        items) for when it waits; nothing starts for fewer than two fake traces."""
        if len(fake) < 2:
            return
        try:
            if self._worker is None or not self._worker.alive():
                self._worker = TraceWorker(self.task)
        except Exception:  # noqa: BLE001 - no worker: trace alone
            self._drop_worker()
            return
        self._queue = [(key, config, a) for key, (config, a) in fake.items()]
        # Workspace fits and their checks first: the small real runs halve once the worker's first trace is back.
        self._ahead = sorted(local, key=lambda item: item[0] == "trace")
        self._top_up()

    def _top_up(self) -> None:
        """Keep the worker two traces ahead; the rest of the queue waits for whichever
        process is free first (this one takes from its end)."""
        while self._queue and self._worker is not None and len(self._pending) < 2:
            key, config, a = self._queue.pop(0)
            try:
                self._pending[key] = self._worker.submit(config, a, self.device, self._capability(), self.compose_blocks)
            except Exception:  # noqa: BLE001 - the worker is gone: this process traces alone
                self._drop_worker()

    def _collect(self, done: Callable[[], bool]) -> None:
        """Take the worker's traces until ``done()``, doing this process's share meanwhile:
        its real runs, then fake traces from the end of the queue."""
        while self._pending and not done():
            worker = self._worker
            if worker is None:
                self._pending.clear()
                return
            if not worker.ready():
                # A small real run halves once a fake trace has come back (see _raw_trace):
                # the first is worth a short wait.
                wait = self._ahead and self._ahead[0][0] == "trace" and self.device == "cpu" and not self._fake_traced
                if self._ahead and not wait:
                    self._run_ahead()
                    continue
                if self._queue and not self._ahead:
                    # Kept as the worker's traces are (prepared when asked), so that an
                    # estimate does not depend on which process traced what.
                    key, config, b = self._queue.pop()
                    try:
                        self._fetched[key] = self._keep_derived(self._raw_trace(config, b))
                    except Exception:  # noqa: BLE001 - raised again, properly, when it is asked
                        pass
                    continue
            if not self._receive():
                return

    def _run_ahead(self) -> None:
        """Run this process's next real run of the prefetch."""
        kind, config, b = self._ahead.pop(0)
        try:
            if kind == "workspace":
                self.workspace_fits.fit(config)
            elif kind == "borrow":
                self.workspace_fits.borrow_holds(config)
            else:
                self.prepared(config, b)
        except Exception:  # noqa: BLE001 - raised again, properly, when it is asked
            pass

    def _receive(self) -> bool:
        """Take the worker's next trace, waiting for it, and hand it the next one; False
        when the worker is gone (this process then traces alone)."""
        assert self._worker is not None
        try:
            ticket, payload = self._worker.next_result(timeout_s=max(120.0, 20 * self._last_fake_trace_s))
        except WorkerDied:
            self._drop_worker()
            return False
        arrived = next((k for k, t in self._pending.items() if t == ticket), None)
        if arrived is not None:
            del self._pending[arrived]
            if isinstance(payload, Trace) and payload.method == "traced":
                self._fetched[arrived] = self._keep_derived(payload)
                self._fake_traced = True
            # A failure in the worker is traced again here, which raises it properly.
        self._top_up()
        return True

    def _pump(self) -> None:
        """Take whatever the worker has finished, without waiting, so that it is never idle
        while this process traces what the search asks."""
        while self._pending and self._worker is not None and self._worker.ready():
            if not self._receive():
                return

    def _await(self, key: TraceKey, batch: int) -> None:
        """Before ``key`` is traced here: take it off the shared queue, or wait for the worker
        that has it; a small real run first waits for a fake trace to come back."""
        self._pump()
        # Asked before the worker took it: traced here (and off the shared queue).
        self._queue = [item for item in self._queue if item[0] != key]
        if key in self._pending:
            self._collect(lambda: key not in self._pending)
        elif self.device == "cpu" and batch < WORKSPACE_ANCHORS[0] and not self._fake_traced:
            # A small real run halves once a fake trace has come back (_raw_trace).
            self._collect(lambda: self._fake_traced)

    def trace_in_parallel(self, config: TrainConfig, batches: Sequence[int]) -> None:
        """Trace the last missing batch size in the worker process while this one traces
        the others, when traces of this model take long enough to be worth a second core."""
        if self._pending or self._queue:
            return  # a prefetch is in flight: its queue has the anchors, or this process traces them
        shape_key = self.shape_key(config)
        missing = [b for b in batches if not self.have((shape_key, b))]
        if len(missing) >= 2 and self._last_fake_trace_s == 0.0 and not self._data_dependent:
            # The model's first trace says how long its traces take.
            self.prepared(config, missing.pop(0))
        if (len(missing) < 2 or self._data_dependent or self._worker_failed
                or self._last_fake_trace_s < PARALLEL_TRACE_S or not worker_available()
                or (os.cpu_count() or 1) < 2):
            return
        remote = missing[-1]
        try:
            if self._worker is None or not self._worker.alive():
                self._worker = TraceWorker(self.task)
            self._worker.submit(config, remote, self.device, self._capability(), self.compose_blocks)
        except Exception:  # noqa: BLE001 - no worker: trace alone
            self._drop_worker()
            return
        self._anchor_in_flight = True
        try:
            for b in missing[:-1]:
                self.prepared(config, b)
        finally:
            self._anchor_in_flight = False
            self._take_parallel(shape_key, remote)

    def _cut_tracer(self, config: TrainConfig, batch: int, trace_step: Callable[..., Trace]) -> CutTracer | None:
        """How the two cuts of a composed trace are traced: the shallow one in the worker while
        this process traces the deep one, for a model whose traces take long enough (its last
        fake trace, or before any, its size), when no prefetch is in flight; else None (here,
        one after the other)."""
        large = (self._last_fake_trace_s >= PARALLEL_TRACE_S if self._last_fake_trace_s
                 else stack_facts(self.task).params >= PARALLEL_CUT_PARAMS)
        if (not large or self._pending or self._queue or self._anchor_in_flight or self._worker_failed
                or not worker_available() or (os.cpu_count() or 1) < 2):
            return None

        def trace(deep: DepthCut, shallow: DepthCut) -> tuple[Trace, Trace]:
            def here(cut: DepthCut) -> Trace:
                return trace_step(self.task, config, batch_size=batch, target=self.device,
                                  capability=self._capability(), cut=cut)

            try:
                if self._worker is None or not self._worker.alive():
                    self._worker = TraceWorker(self.task)
                self._worker.submit(config, batch, self.device, self._capability(), False, shallow)
            except Exception:  # noqa: BLE001 - no worker: both cuts here
                self._drop_worker()
                return here(deep), here(shallow)
            shallow_trace: Trace | None = None
            try:
                deep_trace = here(deep)
            finally:
                # Taken even when the deep cut failed: the worker answers in order.
                try:
                    shallow_trace = self._worker.result(timeout_s=max(120.0, 20 * self._last_fake_trace_s))
                except WorkerDied:
                    self._drop_worker()
                except Exception:  # noqa: BLE001 - traced here again, which raises it properly
                    pass
            if (shallow_trace is None or shallow_trace.tagged is None or shallow_trace.batch_size != batch
                    or shallow_trace.config != config):
                shallow_trace = here(shallow)
            return deep_trace, shallow_trace

        return trace

    def _take_parallel(self, shape_key: ShapeKey, remote: int) -> None:
        """Keep the worker's trace of ``remote`` (if it made one) with this process's."""
        assert self._worker is not None
        try:
            # Its trace takes about as long as ours: far longer means it is stuck.
            trace = self._worker.result(timeout_s=max(120.0, 20 * self._last_fake_trace_s))
        except WorkerDied:
            self._drop_worker()
            trace = None
        except Exception:  # noqa: BLE001 - traced here again, which raises it properly
            trace = None
        if trace is not None and trace.method == "traced":
            self._prepared.setdefault((shape_key, remote), self._prepare(self._keep_derived(trace)))

    def _drop_worker(self) -> None:
        self._worker_failed = True
        self.close()

    def close(self) -> None:
        """Stop the trace worker, if one runs (a later trace starts it again when needed)."""
        with self._lock:
            worker, self._worker = self._worker, None
            self._pending.clear()
            self._queue.clear()
            self._ahead.clear()
            if worker is not None:
                worker.close()

    # Provided by the host (see the class docstring); declared for readers and type checkers.
    if TYPE_CHECKING:
        task: Task
        device: str
        _lock: threading.RLock
        _data_dependent: bool
        _fake_traced: bool
        _last_fake_trace_s: float
        compose_blocks: bool
        _prepared: dict[TraceKey, Prepared]
        workspace_fits: WorkspaceFits

        def prepared(self, config: TrainConfig, batch: int) -> Prepared: ...
        def have(self, key: TraceKey) -> bool: ...
        def shape_key(self, config: TrainConfig) -> ShapeKey: ...
        def _capability(self) -> tuple[int, int] | None: ...
        def _raw_trace(self, config: TrainConfig, batch: int) -> Trace: ...
        def _keep_derived(self, trace: Trace) -> Trace: ...
        def _prepare(self, trace: Trace) -> Prepared: ...

