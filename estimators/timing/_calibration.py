"""Refitting the step-time model with probes' measurements (:class:`TimeCalibration`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._timing import StepTimeParts

__all__ = ["TimeCalibration"]

_MIN_SHARE = 0.02
"""A part below this share of every probe's predicted time is not refitted: the probes
cannot see it."""

_RIDGE = 1e-4
"""Pull of each coefficient towards 1 (the measured rates), relative to the probes' own
weight: decides only what the probes leave undetermined (one probe, two parts; two probes
with nearly the same mix of parts), where it spreads the correction in proportion to each
part's share instead of letting noise pick an extreme split."""


@dataclass
class TimeCalibration:
    """Probe measurements of one task on one device and the step-time model they refit.

    Calibrated step time = ``a * overhead + sum over dtypes d of b_d * work_d``
    (:class:`StepTimeParts`), the coefficients minimising the probes' squared *relative* errors
    (a 0.05 s and a 5 s probe count alike), all ``>= 0``:

    * the per-op overhead is the same at every batch size and the work grows with it, so
      probes at a small and a large batch tell ``a`` and ``b`` apart; one probe (or probes
      with the same mix) moves each part in proportion to its share, the smallest change
      that explains the measurement (a ridge towards 1);
    * work is refitted per dtype, and a dtype no probe ran keeps ``b = 1`` (its measured
      rates): kernels of different dtypes are different code (on an AVX2 CPU, fp32 GEMMs run
      in oneDNN, bf16 ones in a fallback 20-40x slower), and a correction learnt on fp32
      steps made bf16 predictions 25-60% worse in benchmarks/time_accuracy.py.

    Example:
        >>> cal = TimeCalibration()
        >>> cal.add(StepTimeParts(0.01, {"float32": 0.01}), 0.03)   # a=1, b=2 ...
        >>> cal.add(StepTimeParts(0.01, {"float32": 0.10}), 0.21)   # ... fit both
        >>> {k: round(v, 2) for k, v in cal.coefficients().items()}
        {'overhead': 1.0, 'float32': 2.0}
    """

    points: list[tuple[StepTimeParts, float]] = field(default_factory=list)
    """(uncalibrated parts, measured seconds) of each probe."""

    def add(self, parts: StepTimeParts, measured_s: float) -> None:
        if parts.total_s > 0 and measured_s > 0 and math.isfinite(measured_s):
            self.points.append((parts, float(measured_s)))

    def __len__(self) -> int:
        return len(self.points)

    def coefficients(self) -> dict[str, float]:
        """``{"overhead": a, dtype: b_dtype, ...}`` for the parts the probes saw; any other
        part's coefficient is 1."""
        if not self.points:
            return {}
        rows = [{"overhead": p.overhead_s, **p.work_s} for p, _ in self.points]
        measured = np.asarray([m for _, m in self.points])
        names = sorted({k for r in rows for k, v in r.items()
                        if v > 0 and any(r2.get(k, 0.0) >= _MIN_SHARE * sum(r2.values()) for r2 in rows)})
        names = [n for n in ("overhead",) if n in names] + [n for n in names if n != "overhead"]
        # Relative errors: each row divided by its measurement, fitted to 1. Parts not
        # refitted keep coefficient 1: their time moves to the right-hand side.
        full = np.asarray([[r.get(k, 0.0) for k in names] for r in rows]) / measured[:, None]
        rest = np.asarray([sum(v for k, v in r.items() if k not in names) for r in rows]) / measured
        target = 1.0 - rest
        coef = dict.fromkeys(names, 1.0)
        free = list(names)
        while free:
            cols = [names.index(n) for n in free]
            fixed = [names.index(n) for n in names if n not in free]
            x = full[:, cols]
            y = target - (full[:, fixed] @ np.asarray([coef[names[j]] for j in fixed]) if fixed else 0.0)
            # Ridge towards 1: solve for the change d in (x^T x + lam I) d = x^T (y - x 1).
            lam = _RIDGE * float(np.trace(x.T @ x)) / len(cols)
            d = np.linalg.solve(x.T @ x + lam * np.eye(len(cols)), x.T @ (y - x.sum(axis=1)))
            values = 1.0 + d
            if (values >= 0).all():
                coef.update(zip(free, map(float, values)))
                break
            # The most negative one is pinned at its bound 0 and the others refitted.
            worst = free[int(np.argmin(values))]
            coef[worst] = 0.0
            free.remove(worst)
        return coef

    def apply(self, parts: StepTimeParts) -> float:
        coef = self.coefficients()
        return coef.get("overhead", 1.0) * parts.overhead_s + sum(
            coef.get(k, 1.0) * v for k, v in parts.work_s.items())

    def correction(self, parts: StepTimeParts) -> float:
        """Calibrated minus uncalibrated seconds (0 without probes): added to the model's
        step time, so that other terms of it (communication) are left as they are."""
        return self.apply(parts) - parts.total_s if self.points else 0.0
