"""Human-readable tables of estimates (tabulate); sizes formatted only here, at the edge."""

from __future__ import annotations

from tabulate import tabulate

from estimators import Estimate, format_size

__all__ = ["estimate_table"]

_DISTRIBUTION_NOTE = "peak at the median / p99 / max batch"  # shown as rows of the table


def estimate_table(est: Estimate) -> str:
    """The breakdown at the peak, the peak itself, and the lines a GPU user needs."""
    rows = [[name, format_size(value)] for name, value in est.breakdown.items() if value]
    rows.append(["peak allocated", format_size(est.peak_allocated_bytes)])
    if est.peak_reserved_bytes is not None:
        rows.append(["peak reserved (caching allocator)", format_size(est.peak_reserved_bytes)])
    if est.device == "cuda":
        rows.append(["  of which cuBLAS workspace", format_size(est.workspace_bytes)])
        rows.append(["CUDA context (outside reserved)", format_size(est.context_bytes)])
        rows.append(["total on the device", format_size(est.peak_bytes + est.context_bytes)])
    shapes = est.batch_shapes or {}
    for label in ("median", "p99", "max"):
        if isinstance(shapes.get(label), dict):
            padded = ", ".join(str(x) for x in shapes[label]["padded"])
            rows.append([f"peak at the {label} batch (sizes {padded})", format_size(shapes[label]["peak_bytes"])])
    if est.step_time_s is not None:
        rows.append(["step time", f"{est.step_time_s * 1000:.1f} ms"])
    if est.samples_per_s is not None:
        rows.append(["throughput", f"{est.samples_per_s:.1f} samples/s"])
    target = est.gpu or est.device
    label = "modelled, not yet validated on a GPU" if est.modelled else est.method
    head = (
        f"{est.config.describe()} on {target} — peak in '{est.peak_phase}' ({label}); "
        f"{est.params:,} parameters ({est.trainable_params:,} trainable)"
    )
    lines = [head, tabulate(rows, headers=["category at peak", "bytes"], tablefmt="simple")]
    lines.extend(f"note: {n}" for n in est.notes if not n.startswith(_DISTRIBUTION_NOTE))
    return "\n".join(lines)
