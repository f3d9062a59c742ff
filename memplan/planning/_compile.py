"""torch.compile, measured: the best candidates probed compiled against their eager figures.

Fake tensors cannot run Inductor, so a trace can only estimate the eager step; whether
compiling pays (a faster step, less or more memory) is measured by probes on the device at
hand, for the top ``compile_top`` feasible candidates only (each compiled probe pays the
compilation). The plan's ``compile`` says what was found: True (compiled measured faster and
within the budget: ``fit`` trains compiled), False (measured, not worth it), None (not
evaluated: no device to probe, a distributed plan, opted out, or every compiled probe failed).
The compile time (the compiled probe's first step beyond its second) is reported in the notes,
not counted in the step time: it is paid once per run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from estimators import ConfigError, Estimate, Estimator, Task, TrainConfig, format_size, probe

from ._inputs import can_probe
from ._plan import PlanEntry, needed_bytes
from ._races import ProbeFn

__all__ = ["evaluate_compile", "COMPILED_NOTE"]

# Compiled must beat eager by more than this share to be chosen: separate probes of one
# configuration scatter by a few percent even on a quiet machine, and compiling costs its
# compile time at every start, so a gain within that scatter is not worth it.
_FASTER = 0.05

# A compiled probe compiles the forward and the backward in its first step: minutes on a
# loaded CPU for a large model, far beyond an eager probe's default limit.
_COMPILE_TIMEOUT_S = 600.0

COMPILED_NOTE = "torch.compile: the compiled step, measured"
"""How a measured estimate's note says its figures are the compiled step's."""


@dataclass(frozen=True)
class _Tried:
    """One candidate's compiled probe, against its eager figure."""

    entry: PlanEntry
    eager: Estimate
    compiled: Estimate | None
    compile_s: float | None
    problem: str | None  # why there is no compiled figure to use
    oom: bool = False
    """Compiled ran out of memory or measured over the budget: measured not to fit."""


def evaluate_compile(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int, limit: int,
                     probe_fn: ProbeFn | None, compile_fn: ProbeFn | None, gpu: str | None,
                     notes: list[str]) -> tuple[list[PlanEntry], bool | None]:
    """Probe the best ``top`` single-device candidates compiled; the entries (the compiled one
    first, with its compiled figures, when compiling won) and the plan's ``compile``.

    ``compile_fn`` replaces the real probe (tests): it is given the task with ``step.compile``
    set for the compiled probes, and the plain task where an eager figure is missing. A test
    that replaces the probes (``probe_fn``) without it gets no compiled probe, as it gets no race
    without its own ``race_fn``. What was measured, and why nothing was, goes to ``notes``; a
    compile that fails is a note, never an error.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"compile_top must be a whole number >= 0 (0: never probe compiled), got {top!r}")
    why_not = _not_evaluated(task, estimator, entries, top, gpu, probe_fn is not None and compile_fn is None)
    if why_not is not None:
        notes.append(f"torch.compile not evaluated ({why_not})")
        return entries, None
    compiled_task = task.with_step(replace(task.step, compile=True))
    run = compile_fn if compile_fn is not None else _real_probe(estimator)
    tried = [_try(task, compiled_task, entry, limit, run) for entry in entries[:top]]
    tried = [t for t in tried if t is not None]
    for t in tried:
        notes.append(_describe(t, limit))
    eager_now = {t.entry.config: t.entry for t in tried}
    entries = [eager_now.get(e.config, e) for e in entries]
    if not any(t.compiled is not None or t.oom for t in tried):
        notes.append("torch.compile not evaluated (no compiled probe finished); trained eager")
        return entries, None
    # The bar: the best eager figure, the plan's first entry's or a candidate's own.
    best_eager = max([entries[0].samples_per_s, *(float(t.eager.samples_per_s or 0.0) for t in tried)])
    fits = [t for t in tried if t.compiled is not None and not t.oom and needed_bytes(t.compiled) <= limit]
    winner = max(fits, key=lambda t: float(t.compiled.samples_per_s or 0.0), default=None)
    if winner is None or float(winner.compiled.samples_per_s or 0.0) <= best_eager * (1 + _FASTER):
        notes.append(f"torch.compile: not faster than eager by more than {_FASTER:.0%} within the budget; "
                     "trained eager")
        return entries, False
    chosen = replace(winner.entry, measured=winner.compiled, probe_status="ok")
    notes.append(f"torch.compile: {winner.entry.config.describe()} compiled is the fastest measured; trained compiled")
    return [chosen, *(e for e in entries if e.config != winner.entry.config)], True


def _not_evaluated(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int,
                   gpu: str | None, probes_replaced: bool) -> str | None:
    """Why compiling is not evaluated for this search, or None when it is."""
    if not can_probe(estimator, gpu):
        return "no device to probe"
    if top == 0:
        return "no compiled probes: compile_top or probe_top is 0"
    if probes_replaced:
        return "the probes are replaced, the compiled probe is not"
    if task.step.compile:
        return "the step is compiled as asked: every probe measured the compiled step"
    if not entries or any(e.config.strategy != "single" for e in entries[:top]):
        return "a probe runs one process"
    return None


def _real_probe(estimator: Estimator) -> ProbeFn:
    def run(t: Task, c: TrainConfig, budget: int) -> Any:
        return probe(t, c, device=estimator.device, budget_bytes=budget, timeout_s=_COMPILE_TIMEOUT_S)
    return run


def _try(task: Task, compiled_task: Task, entry: PlanEntry, limit: int, run: ProbeFn) -> _Tried | None:
    """The compiled probe of ``entry``, with its eager figure (probed now when it has none);
    None when there is no eager figure to hold a compiled one against."""
    eager = entry.measured if entry.measured is not None and entry.measured.step_time_s else None
    if eager is None:
        result, _ = _run(run, task, entry.config, limit)
        eager = getattr(result, "estimate", None) if getattr(result, "status", "error") == "ok" else None
        if eager is None or not eager.step_time_s:
            return None
        entry = replace(entry, measured=eager, probe_status="ok")  # measured now: kept
    result, raised = _run(run, compiled_task, entry.config, limit)
    if raised is not None:
        return _Tried(entry, eager, None, None, raised)
    status = getattr(result, "status", "error")
    measured = getattr(result, "estimate", None)
    compile_s = getattr(result, "first_step_extra_s", None)
    if status == "ok" and measured is not None and measured.step_time_s:
        note = COMPILED_NOTE + (f" (compiling took ~{compile_s:.1f} s, not counted)" if compile_s else "")
        return _Tried(entry, eager, replace(measured, notes=(*measured.notes, note)), compile_s, None)
    if status == "oom":
        # Measured over the budget (or out of memory): compiled does not fit.
        return _Tried(entry, eager, measured, compile_s, f"out of memory: {getattr(result, 'message', '')}", oom=True)
    return _Tried(entry, eager, None, compile_s, f"{status}: {getattr(result, 'message', '')}".rstrip(": "))


def _run(run: ProbeFn, task: Task, config: TrainConfig, limit: int) -> tuple[Any, str | None]:
    """A probe's result, or the line of what it raised: a compile that fails is a note, never a crash."""
    try:
        return run(task, config, limit), None
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, an Inductor failure: reported, not raised
        return None, (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]


def _describe(t: _Tried, limit: int) -> str:
    """One note: the candidate's compiled figures against its eager ones, or why there are none."""
    what = t.entry.config.describe()
    if t.compiled is None:
        verdict = "does not fit" if t.oom else "failed when probed"
        return f"torch.compile of {what} {verdict} ({t.problem}); its eager figures stand"
    eager_speed = float(t.eager.samples_per_s or 0.0)
    speed = float(t.compiled.samples_per_s or 0.0)
    parts = [f"torch.compile of {what}: peak {format_size(t.compiled.peak_bytes)} "
             f"(eager {format_size(t.eager.peak_bytes)})"]
    if speed:
        parts.append(f"{speed:,.1f} samples/s (eager {eager_speed:,.1f}, x{speed / eager_speed:.2f})"
                     if eager_speed else f"{speed:,.1f} samples/s")
    if t.compile_s is not None:
        parts.append(f"compile ~{t.compile_s:.1f} s")
    text = ", ".join(parts)
    if t.oom or needed_bytes(t.compiled) > limit:
        text += f"; over the budget's {format_size(limit)}"
    return text
