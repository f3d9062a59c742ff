"""Pictures (matplotlib, the ``memplan[plots]`` extra): a predicted memory timeline, a
search's trade-off between memory and throughput, a learning-rate range test.

matplotlib is imported lazily with the Agg backend (files only, no display), so the rest of
memplan neither needs it nor pays for its import.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from estimators import Category, ConfigError, Estimate, format_size

if TYPE_CHECKING:
    from estimators import Timeline

    from ..planning._plan import Plan

__all__ = ["require_matplotlib", "plot_timeline", "PlanPoint", "plan_points", "pareto_front", "plot_plan",
           "figure_png", "save_figure", "timeline_figure", "plan_figure", "record_plan_plot"]

# Colours by category, stacked bottom-up in this order (what stays longest at the bottom).
_ORDER = (Category.PARAMS, Category.BUFFERS, Category.OPTIMIZER, Category.GRADIENTS, Category.BATCH,
          Category.ACTIVATIONS, Category.TEMPORARIES, Category.WORKSPACE)
_COLOURS = {
    Category.PARAMS: "#4e79a7", Category.BUFFERS: "#9c755f", Category.OPTIMIZER: "#af7aa1",
    Category.GRADIENTS: "#e15759", Category.BATCH: "#bab0ab", Category.ACTIVATIONS: "#59a14f",
    Category.TEMPORARIES: "#edc949", Category.WORKSPACE: "#76b7b2",
}
_MAX_POINTS = 4000  # events drawn; more only blur into the same pixels


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line error saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'memplan[plots]' (or pip install matplotlib)") from None
    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    require_matplotlib().close(fig)
    return path


def figure_png(fig: Any) -> str:
    """The figure as base64 PNG (for an HTML page or an Optuna user attribute)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


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


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One searched configuration on the memory/throughput plane."""

    label: str
    peak_bytes: int
    samples_per_s: float
    status: str
    """feasible | infeasible (predicted over the budget) | failed (its probe: oom, error, timeout)."""
    measured: bool = False
    chosen: bool = False


def _label(config: Any) -> str:
    layout = "" if config.strategy == "single" else f" {config.strategy}x{config.world_size}"
    return (f"{config.micro_batch_size}x{config.grad_accum_steps} {config.precision} "
            f"ckpt{config.checkpoint_segments}{layout}")


def plan_points(plan: Plan, estimates: Sequence[Estimate], limit: int) -> list[PlanPoint]:
    """Every estimated configuration, with what the search made of it."""
    entries = {e.config: e for e in plan.entries}
    points = []
    for est in estimates:
        entry = entries.get(est.config)
        need = est.peak_bytes + est.context_bytes
        if entry is not None and entry.probe_status not in (None, "ok"):
            status = "failed"
        elif entry is None and need > limit:
            status = "infeasible"
        elif entry is None:
            status = "failed"  # feasible by prediction yet dropped from the plan: its probe failed
        else:
            status = "feasible"
        if entry is not None:
            points.append(PlanPoint(_label(est.config), entry.peak_bytes, entry.samples_per_s, status,
                                    measured=entry.measured is not None, chosen=entry is plan.best))
        else:
            points.append(PlanPoint(_label(est.config), need, float(est.samples_per_s or 0.0), status))
    return points


def pareto_front(points: Sequence[PlanPoint]) -> list[PlanPoint]:
    """Feasible points no other feasible point beats on both memory (less) and speed (more)."""
    front: list[PlanPoint] = []
    best = -1.0
    for p in sorted((p for p in points if p.status == "feasible"), key=lambda p: (p.peak_bytes, -p.samples_per_s)):
        if p.samples_per_s > best:
            front.append(p)
            best = p.samples_per_s
    return front


def plan_figure(points: Sequence[PlanPoint], *, budget_bytes: int, limit: int, title: str = "") -> Any:
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    scale = 1e6  # MB, as format_size prints
    styles = {"feasible": ("o", "#4e79a7", "feasible"), "infeasible": ("x", "#9e9e9e", "over the budget (predicted)"),
              "failed": ("X", "#d62728", "probe failed (OOM / error)")}
    for status, (marker, colour, label) in styles.items():
        sel = [p for p in points if p.status == status]
        if sel:
            ax.scatter([p.peak_bytes / scale for p in sel], [p.samples_per_s for p in sel], marker=marker,
                       color=colour, label=f"{label} ({len(sel)})", s=28, alpha=0.85, zorder=3)
    measured = [p for p in points if p.measured]
    if measured:
        ax.scatter([p.peak_bytes / scale for p in measured], [p.samples_per_s for p in measured], s=90,
                   facecolors="none", edgecolors="black", label="measured by a probe", zorder=4)
    front = pareto_front(points)
    if front:
        ax.step([p.peak_bytes / scale for p in front], [p.samples_per_s for p in front], where="post",
                color="#59a14f", linewidth=1.5, label="Pareto front", zorder=2)
    ax.axvline(budget_bytes / scale, color="#d62728", linestyle="--", linewidth=1.2, label=f"budget {format_size(budget_bytes)}")
    if limit != budget_bytes:
        ax.axvline(limit / scale, color="#d62728", linestyle=":", linewidth=1, label="budget minus margin")
    for p in points:
        if p.chosen:
            ax.scatter(
                [p.peak_bytes / scale],
                [p.samples_per_s],
                marker="*",
                s=320,
                color="#f28e2c",
                edgecolors="black",
                label=f"chosen: {p.label}",
                zorder=5,
            )
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel("peak memory with the CUDA context where there is one (MB, log scale)")
    ax.set_ylabel("samples / s")
    ax.set_title(title or "searched configurations", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def plot_plan(plan: Plan, estimates: Sequence[Estimate], path: str | Path) -> tuple[Path, str]:
    """Write the plan plot to ``path``; also return it as base64 PNG (for the study)."""
    limit = int(plan.budget_bytes * (1 - plan.margin))
    target = plan.gpu or plan.device
    fig = plan_figure(
        plan_points(plan, estimates, limit),
        budget_bytes=plan.budget_bytes,
        limit=limit,
        title=f"{plan.trials} configurations on {target}",
    )
    png = figure_png(fig)
    return save_figure(fig, path), png


def record_plan_plot(plan: Plan, estimates: Sequence[Estimate], path: str | Path, study: Any) -> Path:
    """Write the plan plot and keep it, with its points, as user attributes of ``study``
    (``plan_plot_png``: base64 PNG; ``plan_points``: the plotted figures), which
    optuna-dashboard lists with the study."""
    out, png = plot_plan(plan, estimates, path)
    limit = int(plan.budget_bytes * (1 - plan.margin))
    points = plan_points(plan, estimates, limit)
    front = set(pareto_front(points))
    study.set_user_attr("plan_plot_png", png)
    study.set_user_attr(
        "plan_points",
        [
            {
                "config": p.label,
                "peak_bytes": p.peak_bytes,
                "samples_per_s": p.samples_per_s,
                "status": p.status,
                "measured": p.measured,
                "chosen": p.chosen,
                "pareto": p in front,
            }
            for p in points
        ],
    )
    return out
