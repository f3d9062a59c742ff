"""Probes: a few real training steps of one configuration, in a separate process.

A probe answers what the static estimator can only predict: the configuration is built for
real on the target device and trained for a few optimizer steps, exactly as the trainer
steps (forward and loss under the precision's autocast, loss divided by the accumulation
steps, backward — scaled under fp16 —, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
all ``grad_accum_steps`` micro-batches of every optimizer step, real batches from the task).

What is measured:

* memory over the first two optimizer steps (the first creates the optimizer state, the
  second is the steady state). On cpu the reference is the CPU allocator's own accounting,
  as in ``estimators.probing._measure.measure_cpu_peak``: ``torch.profiler`` with
  ``profile_memory=True`` sees every allocation and free, tensors and kernel scratch alike;
  the peak is the parameters and buffers plus the highest running sum of those events. On
  cuda: ``max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``.
  The phase in which the peak falls (``"step 2 backward"``…) is reported too;
* time: the median wall time of one optimizer step (batch creation included, as in
  the trainer's loop without DataLoader workers) over ``steps`` un-profiled steps after
  ``warmup`` more, with ``torch.cuda.synchronize()`` around each on cuda. The child uses the
  caller's ``torch.get_num_threads()``, so a probe times what the calling process would see
  (on a busy 2-core machine, 2 threads instead of 1 made a small CNN's step 40x slower).

With ``budget_bytes`` the memory steps run under :class:`~estimators.runtime._guard.MemoryGuard`
(on cuda every step does: ``set_per_process_memory_fraction`` costs nothing); on cpu a
measured peak above the budget (kernel scratch the guard does not see) is an OOM as well.

Isolation. Every probe runs in a child process of its own, with its own process group. On
Linux the child is forked from a *probe server*: a clean interpreter (started with
``subprocess``, never forked from the caller) that has imported torch, ``torch._dynamo`` (which
the first optimizer pulls in) and estimators once, runs no tensor code and never touches
CUDA. Elsewhere, or with ``MEMPLAN_PROBE_START=spawn``, each child is a fresh interpreter.
``multiprocessing`` is not used: its spawned children re-import the caller's ``__main__``
script, which a user's script may not guard. The child reports plain dicts over a socket;
its stdout/stderr go to a temporary file whose tail explains crashes. Outcomes:

* ``ok``;
* ``oom``: ``torch.OutOfMemoryError`` (the guard's, CUDA's), the CPU allocator's "can't
  allocate memory", cuBLAS/cuDNN allocation failures (see :func:`is_oom_error`), a cpu peak
  over the budget, or a child killed by a SIGKILL the parent did not send (the kernel's OOM
  killer);
* ``error``: any other exception, as one line (with the model file's line number), or a
  child dying by another signal (a segfault: the log's last lines are quoted);
* ``timeout``: ``timeout_s`` exceeded (process start included): the child's whole process
  group is killed, grandchildren too.

The parent never holds the child's memory, and every child is killed if need be and reaped
before :func:`probe` returns; only the server outlives a probe (stopped at exit or by
:func:`shutdown`; it exits by itself when its parent does). The same children run races
(``estimators.probing._race``: two configurations timed step against step), with the same outcomes.

Cost (the ``overhead_s`` of a result: wall time less the steps themselves). Measured on this
2-core machine while other jobs kept the load average at 3.5-6.5 (``import torch`` took 5-8 s
instead of an idle machine's 1.5-2 s): the first probe of a process pays the server's start,
10.6-11 s there (``import torch`` and ``import torch._dynamo``, ~5 s each under that load);
every later probe 0.07-0.26 s (fork, task load, model build, result). A fresh interpreter
per probe (the spawn fallback) pays the whole start every time: 10-12.5 s under the same
load. So call :func:`prestart` (or :meth:`Prober.start`) when a search begins: the server
starts while the static estimates run, and each probe then stays far under the 3 s goal.
A probe runs 2 profiled steps, then ``warmup`` and ``steps`` un-profiled ones.

Example:
    >>> from estimators import TrainConfig
    >>> result = probe("examples/digits.py", TrainConfig(micro_batch_size=64))  # doctest: +SKIP
    >>> result.status, result.estimate.peak_allocated_bytes                    # doctest: +SKIP
    ('ok', 4340332)
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._config import TrainConfig
from .._errors import ConfigError, ProbeError
from ..estimator._estimate import Estimate
from ..runtime._oom import is_oom_error
from ..task._task import Task
from ._messages import ProbeStatus, Reply, Request, TaskPayload
from ._server import Child, ChildGone, Timeout, log_tail, prestart, server_log, shutdown

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ProbeResult", "Prober", "probe", "prestart", "shutdown", "is_oom_error"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


# --------------------------------------------------------------------------- results

@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """The outcome of one probe.

    ``estimate`` is an :class:`~estimators.Estimate` with ``method="measured"`` for status
    ``ok``, and for an ``oom`` found by measuring (a cpu peak over the budget: then it has no
    step time); else None. ``message`` explains any status but ``ok`` in one line.
    ``overhead_s`` is the probe's wall time less the training steps' own time (process
    start, imports, task load, model build, result transfer); ``wall_s`` the whole call.
    """

    status: ProbeStatus
    estimate: Estimate | None = None
    message: str = ""
    overhead_s: float = 0.0
    wall_s: float = 0.0
    raised: bool = False
    """Status ``error`` because the configuration's own step (or the task) raised, not because
    the probe's process died, hung or could not start: the configuration cannot run."""
    first_step_extra_s: float | None = None
    """The first optimizer step's seconds beyond the second's: what runs once (a compiled
    forward's compilation, the optimizer state's creation); None when not measured."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, object]:
        return {
            "status": self.status,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
            "message": self.message,
            "overhead_s": self.overhead_s,
            "wall_s": self.wall_s,
            "raised": self.raised,
            "first_step_extra_s": self.first_step_extra_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        """The result ``to_dict`` wrote, as read back from JSON."""
        est = data.get("estimate")
        return cls(
            status=data["status"],
            estimate=Estimate.from_dict(est) if est is not None else None,
            message=data.get("message", ""),
            overhead_s=float(data.get("overhead_s", 0.0)),
            wall_s=float(data.get("wall_s", 0.0)),
            raised=bool(data.get("raised", False)),
            first_step_extra_s=data.get("first_step_extra_s"),
        )


# --------------------------------------------------------------------------- the parent side

def _task_payload(task_ref: Task | str | os.PathLike[str]) -> TaskPayload:
    """How the child gets the task: a model-file path, or the pickled in-memory Task."""
    if isinstance(task_ref, (str, os.PathLike)):
        path = Path(task_ref)
        if not path.is_file():
            raise ConfigError(
                f"model file {str(task_ref)!r} not found; pass the path of a .py file that defines model()")
        return {"path": str(path.resolve()), "settings": None, "name": path.name}
    if not isinstance(task_ref, Task):
        raise ConfigError(f"probe() needs a model-file path or a Task, got {type(task_ref).__name__}")
    if task_ref.source_path is not None:
        try:
            settings = pickle.loads(pickle.dumps(dict(task_ref.settings)))
        except Exception:  # noqa: BLE001 - unpicklable settings: the file's own are used
            settings = None
        # The item shapes found here travel along: the child does not scan the data again.
        return {"path": task_ref.source_path, "settings": settings, "name": task_ref.name,
                "shape_policy": task_ref.shape_policy, "shapes": task_ref._cache.get("shapes"),
                "step": task_ref.step}
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - cloudpickle comes with optuna
        raise ProbeError(
            f"{task_ref.name}: probing an in-memory Task needs cloudpickle (pip install cloudpickle), "
            "or write the model to a model file and probe that"
        ) from exc
    try:
        blob = cloudpickle.dumps(task_ref)
    except Exception as exc:  # noqa: BLE001
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise ProbeError(
            f"{task_ref.name}: the in-memory task cannot be sent to a probe process "
            f"({type(exc).__name__}: {text}); write the model to a model file "
            "(model(), train_data(), …) and probe that file"
        ) from None
    return {"blob": blob, "name": task_ref.name}

class Prober:
    """Probes of one task on one device.

    Every probe runs in a fresh child process — forked from a warm probe server that has
    imported torch already (Linux), or a fresh interpreter elsewhere — so probes cannot
    influence each other, and an OOM or a crash costs nothing but that child. :meth:`start`
    starts the server in the background; the first probe waits for it if needed.

    Example:
        >>> prober = Prober("examples/digits.py")                  # doctest: +SKIP
        >>> prober.start()       # the server imports torch meanwhile  # doctest: +SKIP
        >>> [prober.probe(TrainConfig(micro_batch_size=b)).status for b in (32, 64)]  # doctest: +SKIP
        ['ok', 'ok']
    """

    def __init__(self, task: Task | str | os.PathLike[str], *, device: str = "cpu") -> None:
        import torch

        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"probes run on cpu or cuda, not {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("probe on cuda but no GPU is visible here; probe on cpu or plan with --gpu NAME")
        self.device = str(dev)
        self._payload = _task_payload(task)

    def start(self) -> None:
        """Start the probe server now (returns at once)."""
        prestart()

    def close(self) -> None:
        """Nothing to release per prober: children end with their probe and the shared
        server with the process (or :func:`shutdown`)."""

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def probe(self, config: TrainConfig, *, steps: int = 5, warmup: int = 2,
              budget_bytes: int | None = None, timeout_s: float = 120) -> ProbeResult:
        """Run ``config`` for real in a child process; see :func:`probe`."""
        _check_args(config, steps, warmup, budget_bytes, timeout_s)
        request = self.request(kind="probe", config=config.to_dict(), steps=steps, warmup=warmup,
                                budget_bytes=budget_bytes)
        status, message, reply, wall = self.exchange(request, timeout_s, config.describe())
        est = reply.get("estimate") if reply else None
        steps_s = float(reply.get("steps_s", 0.0)) if reply else 0.0
        return ProbeResult(status=status, estimate=Estimate.from_dict(est) if est else None,
                           message=message, overhead_s=max(0.0, wall - steps_s), wall_s=wall,
                           raised=bool(reply.get("raised")) if reply and status == "error" else False,
                           first_step_extra_s=reply.get("first_step_extra_s") if reply else None)

    def request(self, **fields: Unpack[Request]) -> Request:
        import torch

        request: Request = {
            "task": self._payload, "device": self.device, "sys_path": list(sys.path),
            # The caller's intra-op threads: a probe times what this process would see.
            "num_threads": torch.get_num_threads(),
            # The server forks children with the environment and directory it started with;
            # the child takes the caller's current ones.
            "env": dict(os.environ), "cwd": os.getcwd(), **fields,
        }
        return request

    def exchange(self, request: Request, timeout_s: float,
                  what: str) -> tuple[ProbeStatus, str, Reply | None, float]:
        """Send ``request`` to a fresh child; its status, message, reply (None when the child
        failed to answer) and the call's wall time."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s

        def out(status: ProbeStatus, message: str,
                reply: Reply | None = None) -> tuple[ProbeStatus, str, Reply | None, float]:
            return status, message, reply, time.monotonic() - t0

        timeout_message = f"the probe of {what} did not finish within {timeout_s:g} s; the probe process was killed"
        try:
            child = Child(deadline)
        except Timeout:  # the probe server is still starting
            return out("timeout", timeout_message)
        except ChildGone:
            log = server_log()
            tail = log_tail(log) if log is not None else ""
            shutdown()
            return out("error", "the probe server died" + (f"; its last output: {tail}" if tail else ""))
        failed: tuple[ProbeStatus, str] | None = None
        reply: Reply | None = None
        try:
            reply = child.request(request, deadline)
        except Timeout:
            child.kill()
            failed = ("timeout", timeout_message)
        except ChildGone:
            failed = self._crashed(child, what)
        finally:
            child.close()  # counted in the probe's time: the caller waits for it too
        if failed is not None:
            return out(*failed)
        assert reply is not None
        return out(reply["status"], reply.get("message", ""), reply)

    @staticmethod
    def _crashed(child: Child, what: str) -> tuple[ProbeStatus, str]:
        code = child.wait(5.0)
        tail = log_tail(child.log)
        if code is not None and code < 0:
            signum = -code
            name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
            if signum == signal.SIGKILL and not child.killed:
                return "oom", (f"the probe process of {what} was killed (SIGKILL), most likely by the "
                               "kernel's OOM killer: the machine ran out of memory")
            message = f"the probe process of {what} died by {name}"
        else:
            message = f"the probe process of {what} exited unexpectedly (exit code {code})"
        return "error", message + (f"; its last output: {tail}" if tail else "")


def _check_args(config: TrainConfig, steps: int, warmup: int, budget_bytes: int | None, timeout_s: float) -> None:
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"probe() needs a TrainConfig, got {type(config).__name__}")
    if config.strategy != "single":
        raise ConfigError(f"probes run one process (strategy single); got strategy {config.strategy!r}")
    if config.tp > 1:
        raise ConfigError(f"probes run one process, and tp {config.tp} needs {config.tp}; estimate it "
                          "(memplan estimate --tp) or train it (memplan train --nproc)")
    if config.pp > 1:
        raise ConfigError(f"probes run one process, and pp {config.pp} needs {config.pp}; estimate it "
                          "(memplan estimate --pp)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a whole number >= 1, got {steps!r}")
    if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ConfigError(f"budget_bytes must be a whole number of bytes, got {budget_bytes!r}")
    check_warmup_and_timeout(warmup, timeout_s)


def check_warmup_and_timeout(warmup: int, timeout_s: float) -> None:
    """The arguments probes and races share."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")


def probe(
    task_ref: Task | str | os.PathLike[str],
    config: TrainConfig,
    *,
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    budget_bytes: int | None = None,
    timeout_s: float = 120,
) -> ProbeResult:
    """Train ``config`` for a few real steps in a child process and measure it.

    Args:
        task_ref: A model-file path, a :class:`~estimators.Task` loaded from one (its
            ``source_path`` is used, with the task's ``settings``), or an in-memory Task
            (sent with cloudpickle; :class:`~estimators.ProbeError` if it cannot be).
        config: The configuration (strategy ``single``).
        device: ``cpu`` or ``cuda`` (``cuda:1`` …).
        steps: Timed optimizer steps (the median is reported).
        warmup: Un-timed steps between the two memory steps and the timed ones.
        budget_bytes: Enforce this budget (:class:`~estimators.runtime._guard.MemoryGuard`).
        timeout_s: Wall-clock limit of the whole probe, process start included.

    Returns:
        A :class:`ProbeResult`; what happens in the child never raises here.

    Example:
        >>> r = probe("examples/digits.py", TrainConfig(micro_batch_size=64), steps=3)  # doctest: +SKIP
        >>> r.status, r.estimate.step_time_s > 0                                        # doctest: +SKIP
        ('ok', True)
    """
    return Prober(task_ref, device=device).probe(
        config, steps=steps, warmup=warmup, budget_bytes=budget_bytes, timeout_s=timeout_s)
