"""The predicted memory timeline as a picture (matplotlib, the ``memplan[plots]`` extra; the
search's own picture is ``planning._plot``'s, the figure helpers ``memplan._figures``')."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from estimators import Category, format_size

from .._figures import require_matplotlib, save_figure

if TYPE_CHECKING:
    from estimators import Timeline

__all__ = ["plot_timeline", "timeline_figure", "require_matplotlib"]

# Colours by category, stacked bottom-up in this order (what stays longest at the bottom).
_ORDER = (Category.PARAMS, Category.BUFFERS, Category.OPTIMIZER, Category.GRADIENTS, Category.BATCH,
          Category.ACTIVATIONS, Category.TEMPORARIES, Category.WORKSPACE)
_COLOURS = {
    Category.PARAMS: "#4e79a7", Category.BUFFERS: "#9c755f", Category.OPTIMIZER: "#af7aa1",
    Category.GRADIENTS: "#e15759", Category.BATCH: "#bab0ab", Category.ACTIVATIONS: "#59a14f",
    Category.TEMPORARIES: "#edc949", Category.WORKSPACE: "#76b7b2",
}
_MAX_POINTS = 4000  # events drawn; more only blur into the same pixels


def _sampled(n: int, keep: Sequence[int]) -> np.ndarray:
    """Event positions to draw: evenly spaced, plus the ones that must not be lost (the peak)."""
    if n <= _MAX_POINTS:
        return np.arange(n)
    idx = np.linspace(0, n - 1, _MAX_POINTS).astype(np.int64)
    return np.unique(np.concatenate([idx, np.asarray(keep, dtype=np.int64)]))


def timeline_figure(timeline: Timeline, *, budget_bytes: int | None = None, context_bytes: int = 0,
                    title: str | None = None) -> Any:
    """Stacked bytes per category over the events of the predicted steps."""
    plt = require_matplotlib()
    stacked = timeline.by_category()
    peak_i, peak = timeline.peak_index, timeline.peak_bytes
    x = _sampled(len(stacked), [peak_i, max(peak_i - 1, 0)])
    fig, ax = plt.subplots(figsize=(10, 4.2))
    scale = 1e6  # MB, as format_size prints
    layers = [stacked[x, int(c)] / scale for c in _ORDER]
    ax.stackplot(x, layers, labels=[c.label for c in _ORDER], colors=[_COLOURS[c] for c in _ORDER],
                 step="post", linewidth=0)
    top = max(peak, budget_bytes or 0) / scale * 1.12 or 1.0
    for k, (label, start, end) in enumerate(timeline.phase_spans()):
        if k % 2:
            ax.axvspan(start, end, color="#000000", alpha=0.05, linewidth=0)
        if end - start > len(stacked) / 40:  # a label only where there is room for it
            ax.text((start + end) / 2, 0.985, label.replace("step ", "s").replace("zero_grad", "zero"),
                    transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7, color="#444444")
    ax.annotate(f"peak {format_size(peak)} ({timeline.phase_labels[int(timeline.event_phase[peak_i])]})",
                xy=(peak_i, peak / scale), xytext=(12, 14), textcoords="offset points", fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "black"})
    ax.axhline(peak / scale, color="black", linewidth=0.6, linestyle=":")
    if budget_bytes:
        ax.axhline(budget_bytes / scale, color="#d62728", linewidth=1.2, linestyle="--")
        note = f"budget {format_size(budget_bytes)}"
        if context_bytes:
            note += f" (it also holds the CUDA context, {format_size(context_bytes)}, not drawn)"
        ax.text(0.99, budget_bytes / scale, note, color="#d62728", ha="right", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform())
    ax.set_ylim(0, top)
    ax.set_xlim(0, max(len(stacked) - 1, 1))
    ax.set_xlabel("allocation events of two optimizer steps (setup, then forward, backward, optimizer, zero_grad)")
    ax.set_ylabel("allocated (MB)")
    c = timeline.config
    target = timeline.gpu or timeline.device
    ax.set_title(title or f"predicted memory: micro-batch {c.micro_batch_size} x{c.grad_accum_steps} accumulation, "
                 f"{c.precision}, {c.checkpoint_segments} checkpointed blocks, on {target}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def plot_timeline(timeline: Timeline, path: str | Path, *, budget_bytes: int | None = None,
                  context_bytes: int = 0) -> Path:
    """Write the predicted memory timeline to ``path`` (PNG, SVG or PDF by its suffix)."""
    return save_figure(timeline_figure(timeline, budget_bytes=budget_bytes, context_bytes=context_bytes), path)
