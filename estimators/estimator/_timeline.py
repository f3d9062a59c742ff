"""The predicted memory of a configuration over time: the estimate's own replay, kept.

An :class:`~estimators.Estimate` keeps only the peak and its breakdown. A
:class:`Timeline` keeps every allocation and free of the replay the estimate was made
from (the same events, the same per-target sizes), so a plot or a snapshot drawn from it
shows the very peak the estimate reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._config import TrainConfig
from ..memory._replay import replay_sizes
from ..tracing._recorder import Category
from ._estimate import Estimator

__all__ = ["Timeline", "predicted_timeline"]


@dataclass(frozen=True, eq=False)
class Timeline:
    """Allocation events of one configuration's predicted training steps.

    ``event_alloc[i]`` is the allocation event ``i`` creates (``event_sign[i] == +1``) or
    frees (-1); ``sizes`` and ``categories`` describe each allocation as the target's
    allocator counts it (512-byte blocks on CUDA). ``event_phase[i]`` indexes
    ``phase_labels`` ("setup", "step 1 forward", ...).
    """

    config: TrainConfig
    device: str
    gpu: str | None
    sizes: np.ndarray
    categories: np.ndarray
    event_alloc: np.ndarray
    event_sign: np.ndarray
    event_phase: np.ndarray
    phase_labels: list[str]

    @property
    def signed(self) -> np.ndarray:
        """Bytes each event adds (+) or releases (-)."""
        return self.sizes[self.event_alloc] * self.event_sign.astype(np.int64)

    @property
    def running(self) -> np.ndarray:
        """Bytes allocated after each event."""
        return np.cumsum(self.signed)

    @property
    def peak_index(self) -> int:
        running = self.running
        return int(np.argmax(running)) if len(running) else 0

    @property
    def peak_bytes(self) -> int:
        running = self.running
        return int(running[self.peak_index]) if len(running) else 0

    def by_category(self) -> np.ndarray:
        """Bytes allocated per category after each event: shape (events, categories)."""
        out = np.zeros((len(self.event_alloc), len(Category)), dtype=np.int64)
        cats = self.categories[self.event_alloc].astype(np.int64)
        out[np.arange(len(cats)), cats] = self.signed
        return np.cumsum(out, axis=0)

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(label, first event, one past the last event) of each phase, in order."""
        spans: list[tuple[str, int, int]] = []
        phases = self.event_phase.tolist()
        start = 0
        for i in range(1, len(phases) + 1):
            if i == len(phases) or phases[i] != phases[start]:
                spans.append((self.phase_labels[phases[start]], start, i))
                start = i
        return spans


def predicted_timeline(estimator: Estimator, config: TrainConfig) -> Timeline:
    """The events behind ``estimator.estimate(config, exact=True)``.

    >>> from estimators import Estimator, TrainConfig, load_task     # doctest: +SKIP
    >>> est = Estimator(load_task("examples/digits.py"), device="cpu")
    >>> tl = predicted_timeline(est, TrainConfig(micro_batch_size=64))
    >>> tl.peak_bytes == est.estimate(TrainConfig(micro_batch_size=64), exact=True).peak_allocated_bytes
    True
    """
    estimator.check_config(config)
    prepared, _method = estimator._events(config, exact=True)
    return Timeline(
        config=config,
        device=estimator.device,
        gpu=estimator.spec.name if estimator.spec is not None else None,
        sizes=replay_sizes(prepared, estimator.device).astype(np.int64),
        categories=prepared.alloc_category.astype(np.int64),
        event_alloc=prepared.event_alloc,
        event_sign=prepared.event_sign,
        event_phase=prepared.event_phase,
        phase_labels=list(prepared.phase_labels),
    )
