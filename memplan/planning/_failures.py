"""Configurations a search could not trace: kept with their reasons, told apart from a broken model.

A configuration can fail where its neighbours work: a batch-norm layer refuses a micro-batch
of one, a kernel has no bf16 version, a strategy needs a block stack the model lacks. Such a
configuration is a completed, infeasible trial with its reason, listed in the plan, and the
search goes on. A failure every configuration shares (a model file that cannot run a step at
all, a loss that is not a scalar) must still stop the search at once with its own message:
when the first configuration fails before any has worked, one *contrasting* configuration —
different along every axis the space has — is estimated too. If it fails for the same reason
(numbers aside: "batch size 1" and "batch size 2" are one reason), the failure is the model's;
if it fails for another, the space's plainest configuration decides (see ``Failures.shared``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from estimators import MemplanError, TrainConfig

from ._space import SearchSpace, layout_key

__all__ = ["Failures", "contrast", "plainest", "summarize_failures"]


def _reason_key(reason: str) -> str:
    # Sizes and shapes in a message change with the configuration; the failure does not.
    return re.sub(r"\d+", "#", reason)


class Failures:
    """The configurations of ``space`` that could not be estimated, and why."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.reasons: dict[TrainConfig, str] = {}
        self._errors: dict[TrainConfig, MemplanError] = {}
        self._checked = False

    def add(self, config: TrainConfig, exc: MemplanError) -> None:
        self.reasons[config] = str(exc).replace("\n", " ")
        self._errors[config] = exc

    def resume(self, params: Mapping[str, Any], reason: str) -> None:
        """A failure stored by an earlier run of the same study (its trial's parameters)."""
        try:
            config = self.space.config(int(params["micro_batch_size"]), str(params["precision"]),
                                       int(params["checkpoint_segments"]), str(params["layout"]),
                                       bool(params.get("length_grouped", False)), str(params.get("technique", "none")))
        except (KeyError, StopIteration, ValueError, MemplanError):
            return  # a trial of another space's shape: estimated again if asked
        self.reasons.setdefault(config, reason)

    def shared(self, evaluate: Callable[[TrainConfig], object]) -> bool:
        """Is the (first) failure the model's own? Estimates the contrasting configuration
        once: True when it fails for the same reason (numbers aside), or when there is none
        to try. The same failure can read differently on a real and a fake run ("mat1 and
        mat2 shapes cannot be multiplied" against the meta kernel's "a and b must have same
        reduction dim"), so a contrast that fails otherwise is followed by the space's plainest
        configuration (a middle micro-batch, fp32, no checkpointing): if that fails too, so
        does the model."""
        if self._checked or not self.reasons:
            return False
        self._checked = True
        first = next(iter(self.reasons))
        others = [c for c in (contrast(self.space, first), plainest(self.space)) if c is not None and c != first]
        if not others:
            return True
        for i, other in enumerate(dict.fromkeys(others)):
            if evaluate(other) is not None:
                return False
            if i == 0 and _reason_key(self.reasons.get(other, "")) == _reason_key(self.reasons[first]):
                return True
        return True

    def in_space(self) -> dict[TrainConfig, str]:
        space = set(self.space)
        return {c: r for c, r in self.reasons.items() if c in space}

    def first_error(self) -> MemplanError:
        """The error to raise when nothing could be estimated: the first one raised here
        (a resumed study's failures carry only their message)."""
        if self._errors:
            return next(iter(self._errors.values()))
        return MemplanError(next(iter(self.reasons.values())))


def contrast(space: SearchSpace, config: TrainConfig) -> TrainConfig | None:
    """A configuration of ``space`` unlike ``config`` along every axis that has a choice:
    another micro-batch size (the next larger, else the next smaller), fp32 (else another
    precision), no checkpointing (else the most), another layout. None when the space holds
    nothing else."""
    def other(options: tuple[Any, ...], current: Any, prefer: Any = None) -> Any:
        rest = [o for o in options if o != current]
        if not rest:
            return current
        if prefer is not None:
            return prefer if prefer in rest else rest[-1]
        later = [o for o in rest if current in options and options.index(o) > options.index(current)]
        return later[0] if later else rest[-1]

    micro = other(space.micro_batch_sizes, config.micro_batch_size)
    precision = other(space.precisions, config.precision, prefer="fp32")
    segments = other(space.checkpoint_segments, config.checkpoint_segments, prefer=0)
    keys = [layout.key for layout in space.layouts]
    current = layout_key(config) if layout_key(config) in keys else keys[0]
    layout = other(tuple(keys), current)
    candidate = space.config(micro, precision, segments, layout)
    return None if candidate == config else candidate


def plainest(space: SearchSpace) -> TrainConfig:
    """The configuration of ``space`` least likely to fail for its own sake: a middle
    micro-batch size (a batch of one is refused by batch norm), fp32, no checkpointing."""
    micros = space.micro_batch_sizes
    precision = "fp32" if "fp32" in space.precisions else space.precisions[0]
    return space.config(micros[len(micros) // 2], precision, space.checkpoint_segments[0])


def summarize_failures(failures: Mapping[TrainConfig, str], *, shown: int = 3) -> str | None:
    """One line for a plan's footer: how many configurations could not run, grouped by reason
    (numbers aside), a few of each named."""
    if not failures:
        return None
    groups: dict[str, list[tuple[TrainConfig, str]]] = {}
    for config, reason in failures.items():
        groups.setdefault(_reason_key(reason), []).append((config, reason))
    parts = []
    for members in groups.values():
        names = ", ".join(c.describe() for c, _ in members[:shown])
        if len(members) > shown:
            names += f" and {len(members) - shown} more"
        parts.append(f"{names}: {members[0][1]}")
    n = len(failures)
    return f"{n} configuration{'s' if n != 1 else ''} could not run: " + "; ".join(parts)
