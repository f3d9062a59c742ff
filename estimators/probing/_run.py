"""The probe's child side: a few real steps of one configuration, measured.

Memory comes from the first two optimizer steps (the second holds the optimizer state and is
what every later step repeats): on CUDA ``max_memory_allocated``/``reserved``, on CPU the
profiler's allocation events (the CPU allocator has no peak counter). Time is the median of
``steps`` timed steps after ``warmup`` untimed ones. The step is the trainer's
(:func:`estimators.runtime._step.train_step`, through :class:`~estimators.runtime._planned.PlannedSteps`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.profiler import record_function

from .._config import TrainConfig
from ..estimator._estimate import Estimate
from ..runtime._build import build_for_training
from ..runtime._planned import PlannedSteps
from ..runtime._step import StepHooks
from ..task._task import Task
from ..tracing._profiler import allocated_bytes, event_tree
from ._measure import storage_bytes
from ._messages import Reply, Request

if TYPE_CHECKING:
    from torch.profiler import profile

    from ..runtime._guard import MemoryGuard

__all__ = ["run_probe", "serve_probe", "MEMORY_STEPS"]

MEMORY_STEPS = 2
"""Optimizer steps the memory is measured over: the first creates the optimizer state."""

_PHASE_PREFIX = "memplan_phase::"


class _ProfiledPhases(StepHooks):
    """Each phase of the step in a profiler range named after it: on CPU the peak's phase is
    read from the profile afterwards."""

    def __init__(self) -> None:
        self._open: record_function | None = None

    def phase(self, label: str, kind: str) -> None:
        self.close()
        self._open = record_function(_PHASE_PREFIX + label)
        self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


class _CudaPhases(StepHooks):
    """After each phase, did ``max_memory_allocated`` grow? The last phase that raised it holds the peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.best = -1
        self.peak_phase = ""
        self._current: str | None = None

    def phase(self, label: str, kind: str) -> None:
        self.close()
        self._current = label

    def close(self) -> None:
        if self._current is None:
            return
        now = int(torch.cuda.max_memory_allocated(self.device))
        if now > self.best:
            self.best, self.peak_phase = now, self._current
        self._current = None


class _ModelFacts(TypedDict):
    params: int
    trainable: int
    breakdown: dict[str, int]


def serve_probe(task: Task, msg: Request) -> Reply:
    """The probe server's handler of a probe request."""
    return run_probe(task, TrainConfig.from_dict(msg["config"]), device=msg["device"], steps=msg["steps"],
                     warmup=msg["warmup"], budget_bytes=msg["budget_bytes"])


def run_probe(task: Task, config: TrainConfig, *, device: str, steps: int, warmup: int,
              budget_bytes: int | None) -> Reply:
    """Measure ``config``; the reply the probe server sends back (``status``, ``estimate``, ...)."""
    from ..runtime._guard import MemoryGuard

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        if dev.index is not None:
            torch.cuda.set_device(dev)
        torch.cuda.empty_cache()
    guard = MemoryGuard(budget_bytes, device=dev.type) if budget_bytes is not None else None
    # On the CPU the model is built under the guard, as the trainer builds it: a compiled
    # forward of a model built outside the guard's dispatch mode and run under it failed its
    # backward (a BatchNorm buffer "modified by an inplace operation", torch 2.13), while the
    # same model built under the mode trains.
    with guard if (guard is not None and not cuda) else contextlib.nullcontext():
        built = build_for_training(task, config, dev, compile=task.step.compile)
    model = built.model
    facts = _model_facts(model)
    baseline = storage_bytes([*model.parameters(), *model.buffers()])
    run = PlannedSteps(task, config, built, device=dev)
    task.batch_template()  # the dataset is built outside the measured steps
    if guard is not None:
        guard.track(model)
    t_steps = time.monotonic()
    whole_run = guard if (guard is not None and cuda) else contextlib.nullcontext()
    with whole_run:
        peak, reserved, peak_phase, first_extra = _memory_steps(run, dev, guard)
        if not cuda:
            peak += baseline  # the profile counts what the steps allocate, not the model already there
        optimizer_bytes = storage_bytes(
            [v for s in run.parts.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        if peak_phase and not peak_phase.startswith("step 1 "):
            facts["breakdown"]["optimizer"] = optimizer_bytes  # alive all through steps >= 2

        def measured(step_time: float | None, more_notes: list[str]) -> Estimate:
            return _measured(config, dev, facts, peak=peak, reserved=reserved,
                             peak_phase=peak_phase, budget_bytes=budget_bytes, step_time=step_time,
                             more_notes=more_notes)

        if budget_bytes is not None and not cuda and peak > budget_bytes:
            from .._units import format_size
            return {
                "status": "oom", "steps_s": time.monotonic() - t_steps,
                "estimate": measured(None, ["not timed: over the budget"]).to_dict(), "first_step_extra_s": first_extra,
                "message": f"out of memory: the measured peak {format_size(peak)} (in {peak_phase}) "
                           f"exceeds the budget {format_size(budget_bytes)}; the excess is memory the guard does "
                           "not count (kernel scratch)",
            }
        times = _timed_steps(run, dev, first=MEMORY_STEPS + 1, warmup=warmup, steps=steps)
    estimate = measured(statistics.median(times), [
        f"time: median of {steps} steps after {warmup} warmup steps ({min(times):.4g}-{max(times):.4g} s)"])
    return {"status": "ok", "estimate": estimate.to_dict(), "message": "", "steps_s": time.monotonic() - t_steps,
            "first_step_extra_s": first_extra}


def _model_facts(model: torch.nn.Module) -> _ModelFacts:
    seen: set[int] = set()
    n_params = n_trainable = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n_params += p.numel()
            n_trainable += p.numel() if p.requires_grad else 0
    return {"params": n_params, "trainable": n_trainable,
            "breakdown": {"params": storage_bytes(model.parameters()), "buffers": storage_bytes(model.buffers())}}


def _memory_steps(run: PlannedSteps, dev: torch.device,
                  guard: MemoryGuard | None) -> tuple[int, int | None, str, float]:
    """The first optimizer steps' peak (on CPU: above the model's own bytes), reserved bytes
    (CUDA), the phase of the peak, and the first step's seconds beyond the second's (what runs
    once: a compiled forward's compilation, the optimizer state's creation)."""
    seconds: list[float] = []

    def timed(i: int, hooks: StepHooks) -> None:
        start = time.perf_counter()
        run(i, hooks)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds.append(time.perf_counter() - start)

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        tracker = _CudaPhases(dev)
        for i in range(1, MEMORY_STEPS + 1):
            timed(i, tracker)
        tracker.close()
        return (int(torch.cuda.max_memory_allocated(dev)), int(torch.cuda.max_memory_reserved(dev)),
                tracker.peak_phase, max(0.0, seconds[0] - seconds[-1]))
    from ..tracing._profiler import memory_profile

    phases = _ProfiledPhases()
    with memory_profile() as prof:
        with guard if guard is not None else contextlib.nullcontext():
            for i in range(1, MEMORY_STEPS + 1):
                timed(i, phases)
            phases.close()
    above, peak_phase = _cpu_peak(prof)
    return above, None, peak_phase, max(0.0, seconds[0] - seconds[-1])


def _timed_steps(run: PlannedSteps, dev: torch.device, *, first: int, warmup: int, steps: int) -> list[float]:
    index = first
    for _ in range(warmup):
        run(index)
        index += 1
    times: list[float] = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        run(index)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)
        index += 1
    return times


def _measured(config: TrainConfig, dev: torch.device, facts: _ModelFacts, *, peak: int, reserved: int | None,
              peak_phase: str, budget_bytes: int | None, step_time: float | None,
              more_notes: list[str]) -> Estimate:
    cuda = dev.type == "cuda"
    notes = [
        f"probe: memory over optimizer steps 1-{MEMORY_STEPS}"
        + (" (max_memory_allocated/reserved)" if cuda else " (torch.profiler, CPU allocator)"),
        "breakdown: parameters, buffers and optimizer state only; the rest of the peak is "
        "activations, gradients, batch and temporaries",
    ]
    if budget_bytes is not None:
        notes.append(f"ran under a memory budget of {budget_bytes} bytes")
    return Estimate(
        config=config, device=dev.type, gpu=_gpu_name(dev) if cuda else None, peak_allocated_bytes=int(peak),
        peak_reserved_bytes=reserved, breakdown=dict(facts["breakdown"]), peak_phase=peak_phase,
        context_bytes=0, workspace_bytes=0, method="measured", modelled=False,
        params=facts["params"], trainable_params=facts["trainable"], step_time_s=step_time,
        samples_per_s=config.global_batch / step_time if step_time else None,
        notes=tuple(notes + more_notes),
    )


def _cpu_peak(prof: profile) -> tuple[int, str]:
    """Highest running sum of the profiler's allocation events, and the phase it falls in."""
    events: list[tuple[int, int, str]] = []
    stack = [(n, "") for n in event_tree(prof)]
    while stack:
        node, phase = stack.pop()
        size = allocated_bytes(node)
        if size is not None:
            events.append((node.start_time_ns, size, phase))
        elif node.name.startswith(_PHASE_PREFIX):
            phase = node.name[len(_PHASE_PREFIX):]
        stack.extend((child, phase) for child in node.children)
    events.sort(key=lambda e: e[0])
    running = peak = 0
    peak_phase = ""
    for _, size, phase in events:
        running += size
        if running > peak:
            peak, peak_phase = running, phase
    return peak, peak_phase


def _gpu_name(dev: torch.device) -> str:
    try:
        from ..hardware._gpus import detect_local_gpu
        spec = detect_local_gpu()
        if spec is not None:
            return spec.name
    except Exception:  # noqa: BLE001 - the raw name will do
        pass
    return torch.cuda.get_device_name(dev)
