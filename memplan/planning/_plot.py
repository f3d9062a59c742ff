"""The search's picture: every configuration it estimated on the memory/throughput plane, the
Pareto front, the budget and the chosen one (matplotlib, the ``memplan[plots]`` extra), kept
with the study for optuna-dashboard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimators import Estimate, format_size

from .._figures import figure_png, require_matplotlib, save_figure
from ._plan import Plan
from ._space import layout_key

__all__ = ["PlanPoint", "plan_points", "pareto_front", "plan_figure", "plot_plan", "record_plan_plot"]


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
    layout = "" if config.strategy == "single" and config.ranks == 1 else " " + layout_key(config)
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
