"""``memplan estimate --plot/--snapshot``: the estimate's timeline as a picture and as a
snapshot PyTorch's memory viewer opens."""

from __future__ import annotations

from estimators import Estimator, TrainConfig, format_size, parse_size, predicted_timeline, write_snapshot

__all__ = ["write_timeline_outputs"]


def write_timeline_outputs(estimator: Estimator, config: TrainConfig, *, plot: str | None = None,
                           snapshot: str | None = None, vram: str | None = None) -> list[str]:
    """Write what was asked for; return one line per file written."""
    if plot:
        from ._plots import require_matplotlib
        require_matplotlib()
    budget = parse_size(vram, what="--vram") if vram else (estimator.spec.memory_bytes if estimator.spec else None)
    timeline = predicted_timeline(estimator, config)
    lines = []
    if snapshot:
        path = write_snapshot(timeline, snapshot)
        lines.append(f"snapshot written to {path} (peak {format_size(timeline.peak_bytes)}); open it at "
                     "https://pytorch.org/memory_viz or: python -m torch.cuda._memory_viz trace_plot "
                     f"{path} -o trace.html")
    if plot:
        from ._plots import plot_timeline
        path = plot_timeline(timeline, plot, budget_bytes=budget,
                             context_bytes=estimator.spec.context_bytes if estimator.spec else 0)
        lines.append(f"timeline written to {path}")
    return lines
