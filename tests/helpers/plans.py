"""Plans made in a line, for the tests of what reads a plan (exports, callbacks)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from estimators import Estimate, TrainConfig
from memplan.planning import Plan, PlanEntry

STEP_S = 0.25


def estimate(config: TrainConfig, *, peak: int | None = None, speed: float | None = None,
             device: str = "cpu") -> Estimate:
    """A prediction for ``config``: memory growing with the micro-batch, the bigger the faster."""
    micro = config.micro_batch_size
    return Estimate(config=config, device=device, gpu=None, peak_allocated_bytes=peak or 1_000_000 * micro,
                    peak_reserved_bytes=None, breakdown={}, peak_phase="backward", context_bytes=0,
                    workspace_bytes=0, method="traced", modelled=False, params=1, trainable_params=1,
                    step_time_s=STEP_S, samples_per_s=speed or 100.0 * micro)


def plan_of(*configs: TrainConfig, global_batch: int, device: str = "cpu", compile: bool | None = None,
            provenance: Mapping[str, Any] | None = None) -> Plan:
    """A plan of ``configs``, the first its choice."""
    entries = tuple(PlanEntry(config=c, predicted=estimate(c, device=device)) for c in configs)
    return Plan(entries=entries, budget_bytes=10**9, margin=0.1, device=device, gpu=None,
                global_batch=global_batch, trials=len(entries), compile=compile, provenance=dict(provenance or {}))
