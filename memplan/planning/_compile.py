"""torch.compile, measured: the best candidates' compiled step against their eager step.

Fake tensors cannot run Inductor, so a trace can only estimate the eager step; whether
compiling pays is measured on the device at hand, for the top ``compile_top`` feasible
candidates only (each pays a compilation). Per candidate: a probe of the compiled step under
the budget (its memory, and its first step beyond its second: the compile time), then a race
of the configuration eager against itself compiled, step against step in one process (separate
probes of one configuration scatter by 20-40% on a shared machine: ``._races``). The plan's
``compile`` says what was found: True (compiled faster by more than ``_FASTER`` and within the
budget: ``fit`` trains compiled), False (measured, not worth it), None (not evaluated: no
device to probe, a distributed plan, opted out, or no compiled measurement finished). The
compile time is reported in the notes, not counted in the step time: it is paid once per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from estimators import ConfigError, Estimate, Estimator, Task, TrainConfig, format_size, probe, race

from ._inputs import can_probe
from ._plan import PlanEntry, needed_bytes

__all__ = ["CompiledFigures", "CompileFn", "evaluate_compile", "measure_compiled", "COMPILED_NOTE"]

# Compiled must beat eager by more than this share (median ratio of a race) to be chosen:
# compiling costs its compile time at every start, and a race may carry a few percent of
# bias from sharing a process (README, races).
_FASTER = 0.05

# A compiled probe compiles the forward and the backward in its first step: minutes on a
# loaded CPU for a large model, far beyond an eager probe's default limit.
_COMPILE_TIMEOUT_S = 600.0

COMPILED_NOTE = "torch.compile: the compiled step, measured"
"""How a measured estimate's note says its figures are the compiled step's."""


@dataclass(frozen=True, kw_only=True)
class CompiledFigures:
    """One configuration compiled, measured: ``status`` ok (``estimate`` its memory probe,
    ``speedup`` the race's median of eager step / compiled step), oom (compiled does not fit;
    ``estimate`` when a peak was measured), or error/timeout (``message`` says why)."""

    status: str
    message: str = ""
    estimate: Estimate | None = None
    compile_s: float | None = None
    speedup: float | None = None
    rounds: int = 0


CompileFn = Callable[[Task, TrainConfig, int], CompiledFigures]
"""(task, configuration, budget) -> its compiled figures; tests replace the real one."""


def evaluate_compile(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int, limit: int,
                     probe_fn: object | None, compile_fn: CompileFn | None, gpu: str | None,
                     notes: list[str]) -> tuple[list[PlanEntry], bool | None]:
    """Measure the best ``top`` single-device candidates compiled; the entries (the compiled one
    first, with its compiled figures, when compiling won) and the plan's ``compile``.

    ``compile_fn`` replaces :func:`measure_compiled` (tests). A test that replaces the probes
    (``probe_fn``) without it gets no compiled measurement, as it gets no race without its own
    ``race_fn``. What was measured, and why nothing was, goes to ``notes``; a compile that
    fails is a note, never an error.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"compile_top must be a whole number >= 0 (0: never probe compiled), got {top!r}")
    why_not = _not_evaluated(task, estimator, entries, top, gpu, probe_fn is not None and compile_fn is None)
    if why_not is not None:
        notes.append(f"torch.compile not evaluated ({why_not})")
        return entries, None
    measure = compile_fn if compile_fn is not None else _real(estimator)
    tried = [(entry, _measure(measure, task, entry.config, limit)) for entry in entries[:top]]
    notes.extend(_describe(entry, figures, limit) for entry, figures in tried)
    if not any(f.status in ("ok", "oom") for _, f in tried):
        notes.append("torch.compile not evaluated (no compiled measurement finished); trained eager")
        return entries, None
    # A candidate's compiled figure: its own (measured or refitted) figure times the race's
    # speedup, so that it ranks against the others' figures on the same footing.
    scored = [(entry.samples_per_s * float(f.speedup), entry, f) for entry, f in tried
              if f.status == "ok" and f.estimate is not None and f.speedup and needed_bytes(f.estimate) <= limit
              and f.speedup > 1 + _FASTER]
    if not scored or max(s for s, _, _ in scored) <= entries[0].samples_per_s:
        notes.append(f"torch.compile: not faster than eager by more than {_FASTER:.0%} within the budget; "
                     "trained eager")
        return entries, False
    speed, entry, figures = max(scored, key=lambda s: s[0])
    chosen = replace(entry, measured=_compiled_estimate(entry, figures, speed), probe_status="ok")
    notes.append(f"torch.compile: {entry.config.describe()} compiled is the fastest measured; trained compiled")
    return [chosen, *(e for e in entries if e.config != entry.config)], True


def measure_compiled(task: Task, config: TrainConfig, limit: int, *, device: str) -> CompiledFigures:
    """The compiled step of ``config`` on ``device``: its memory (a probe of one step under the
    budget, whose first step beyond its second is the compile time), then its speed against the
    eager step (a race of the two in one process)."""
    compiled_task = task.with_step(replace(task.step, compile=True))
    memory = probe(compiled_task, config, device=device, budget_bytes=limit, steps=1, warmup=0,
                   timeout_s=_COMPILE_TIMEOUT_S)
    compile_s = memory.first_step_extra_s
    if memory.status != "ok" or memory.estimate is None:
        return CompiledFigures(status=memory.status, message=memory.message, estimate=memory.estimate,
                               compile_s=compile_s)
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        if 2 * memory.estimate.peak_bytes > free:
            return CompiledFigures(status="error", estimate=memory.estimate, compile_s=compile_s,
                                   message="eager and compiled do not fit on the device together, as a race needs")
    # On the CPU the trainer steps under the memory guard, whose dispatch mode keeps
    # torch.compile from capturing most of the model: the race runs under one too (both models
    # alive together, hence twice the budget), so that it times the step that will be trained.
    result = race(task, (config, config), device=device, compiled=(False, True), timeout_s=_COMPILE_TIMEOUT_S,
                  guard_bytes=2 * limit if not device.startswith("cuda") else None)
    if not result.ok:
        return CompiledFigures(status=result.status, estimate=memory.estimate, compile_s=compile_s,
                               message=f"the race of eager against compiled did not finish: {result.message}")
    return CompiledFigures(status="ok", estimate=memory.estimate, compile_s=compile_s,
                           speedup=float(result.ratio), rounds=len(result.step_times[0]))


def _real(estimator: Estimator) -> CompileFn:
    def measure(t: Task, c: TrainConfig, limit: int) -> CompiledFigures:
        return measure_compiled(t, c, limit, device=estimator.device)
    return measure


def _measure(measure: CompileFn, task: Task, config: TrainConfig, limit: int) -> CompiledFigures:
    try:
        return measure(task, config, limit)
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, an Inductor failure: a note, never a crash
        line = (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]
        return CompiledFigures(status="error", message=line)


def _not_evaluated(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int,
                   gpu: str | None, probes_replaced: bool) -> str | None:
    """Why compiling is not evaluated for this search, or None when it is."""
    if not can_probe(estimator, gpu):
        return "no device to probe"
    if top == 0:
        return "no compiled probes: compile_top or probe_top is 0"
    if probes_replaced:
        return "the probes are replaced, the compiled measurement is not"
    if task.step.compile:
        return "the step is compiled as asked: every probe measured the compiled step"
    if not entries or any(e.config.strategy != "single" or e.config.ranks > 1 for e in entries[:top]):
        return "a probe runs one process"
    return None


def _compiled_estimate(entry: PlanEntry, figures: CompiledFigures, speed: float) -> Estimate:
    """The compiled memory probe's figures, with the entry's time divided by the race's speedup."""
    assert figures.estimate is not None
    step = entry.config.global_batch / speed
    took = f"; compiling took ~{figures.compile_s:.1f} s, not counted" if figures.compile_s else ""
    return replace(figures.estimate, step_time_s=step, samples_per_s=speed, notes=(
        *figures.estimate.notes,
        f"{COMPILED_NOTE}: time = the eager figure / the median ratio of {figures.rounds} steps raced "
        f"eager against compiled in one process (x{figures.speedup:.2f}){took}"))


def _describe(entry: PlanEntry, f: CompiledFigures, limit: int) -> str:
    """One note: the candidate's compiled figures against its eager ones, or why there are none."""
    what = entry.config.describe()
    eager = entry.measured or entry.predicted
    if f.estimate is None or f.status not in ("ok", "oom"):
        return f"torch.compile of {what} failed when measured ({f.status}: {f.message}); its eager figures stand"
    parts = [f"torch.compile of {what}: peak {format_size(f.estimate.peak_bytes)} (eager {format_size(eager.peak_bytes)})"]
    if f.speedup:
        parts.append(f"eager/compiled step time {f.speedup:.2f} (median of {f.rounds} rounds raced in one process)")
    if f.compile_s is not None:
        parts.append(f"compile ~{f.compile_s:.1f} s")
    text = ", ".join(parts)
    if f.status == "oom" or needed_bytes(f.estimate) > limit:
        text += f"; does not fit the budget's {format_size(limit)}"
    return text
