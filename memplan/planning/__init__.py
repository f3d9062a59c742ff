"""Searching the configurations that fit the budget, and the ranked plan it returns.

``search`` is the pipeline (``_search``); each of its steps is a module of its own: the
inputs, the space, the study and its objective, the failures, the refusals, the probes and
races that confirm the best, the ranking and the ``Plan``.
"""

from __future__ import annotations

from ._inputs import default_budget, estimator_for, resolve_task
from ._plan import RACED_NOTE, Plan, PlanEntry, check_plan_model, provenance
from ._search import SearchInterrupted, search
from ._space import DEFAULT_GLOBAL_BATCH
from ._study import default_storage

__all__ = ["search", "resolve_task", "estimator_for", "default_budget", "default_storage",
           "Plan", "PlanEntry", "provenance", "check_plan_model", "RACED_NOTE", "DEFAULT_GLOBAL_BATCH",
           "SearchInterrupted"]
