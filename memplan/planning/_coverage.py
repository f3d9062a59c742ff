"""How much of the space a search answered, said in the plan.

A space no larger than ``trials`` is enumerated; a larger one is sampled, and its plan is the
best of what was estimated, not of the space. The plan says which (``Coverage``: a note, and
``provenance["search_coverage"]``), so that a plan from a sample is not read as the space's
best, and names the ``--trials`` that would estimate the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._objective import Objective
from ._space import SearchSpace

__all__ = ["Coverage", "coverage_of"]


@dataclass(frozen=True, slots=True)
class Coverage:
    """What a search answered of its space (its last study's: a widened space's when it widened)."""

    configurations: int
    """Distinct configurations in the space."""
    estimated: int
    """Configurations estimated (or found not to trace: their estimate was attempted)."""
    pruned: int
    """Configurations known not to fit without an estimate (model states alone, or holding
    at least as much as an estimated miss)."""
    enumerated: bool
    """The whole space was asked (it was no larger than the trial budget)."""
    trials_for_all: int
    """The ``--trials`` that enumerates the space."""

    @property
    def unanswered(self) -> int:
        """Configurations neither estimated nor pruned: what the plan knows nothing of."""
        return max(0, self.configurations - self.estimated - self.pruned)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def note(self) -> str | None:
        """The plan's note on a sampled space (None when nothing was left unanswered)."""
        if self.unanswered == 0:
            return None
        share = self.estimated / self.configurations if self.configurations else 0.0
        pruned = f", {self.pruned} more known not to fit without one" if self.pruned else ""
        return (f"estimated {self.estimated} of {self.configurations} configurations ({share:.0%}{pruned}); "
                f"{self.unanswered} were not estimated, so a faster one may exist: --trials {self.trials_for_all} "
                "(trials=) estimates them all")


def coverage_of(objective: Objective, space: SearchSpace, *, enumerated: bool) -> Coverage:
    """The coverage of ``space`` by ``objective``'s answers."""
    configs = list(space)
    estimated = sum(1 for c in configs if c in objective.cache or c in objective.failures.reasons)
    # Pruned: asked and answered without a trace, or never asked but ruled out by what is
    # known now (the model states, an estimated miss it holds at least as much as).
    pruned = sum(1 for c in configs if c not in objective.cache and c not in objective.failures.reasons
                 and (c in objective.pruned or objective.prune(c) is not None))
    return Coverage(configurations=len(configs), estimated=estimated, pruned=pruned,
                    enumerated=enumerated and estimated + pruned >= len(configs), trials_for_all=len(space))
