"""The estimator on data of varying shape: the planned (worst) batch, the distribution, an epoch.

Run by ``benchmarks/estimator_accuracy.py`` (its "Variable-shape data" section; ``--shapes``
runs these cases alone and replaces that section of the report). Per case, in a subprocess:

* predicted: ``Estimator(task, device="cpu").shape_distribution(config)``: the peak at the
  worst batch the loader can form (the policy ``max``), and at the median and p99 batch;
* measured at that batch: ``measure_cpu_peak(task, config)`` (its real batches are the
  planned ones); for a data-dependent model, the fullest real batch the estimate names;
* measured over a whole real epoch: ``measure_epoch_peak`` (a seeded random order, every
  item once), which the prediction must not fall below;
* the old estimate, from the first item alone (the shape profile forced to "fixed");
* the padded volume of an epoch's mean batch over the planned one, random and length-grouped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"

CASES: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("varlen_text", (4, 16), "fp32"),
    ("varlen_text", (16,), "bf16-mixed"),
    ("multisize_images", (1, 4, 16), "fp32"),
    ("moe_dynamic", (8,), "fp32"),
)
SECTION = "## Variable-shape data"
CASE_TIMEOUT_S = 900
NOTES = """- The 16 B below the epoch on `varlen_text` are not a shape effect: CPU kernels wrap the Python scalar of `scores / sqrt(d)` in an 8-byte tensor below the dispatcher, which no trace sees; the same model on a `TensorDataset` of 384-token rows is 16 B under its real peak too. `moe_dynamic` has fixed-shape inputs, so its "first-item estimate" is the estimate itself (before this work: one real run of one pair of batches, 17.08 MiB-class, 0.46% under this epoch).
- Machine shared with other jobs (load average 10-17 on 2 cores during the run): the estimate seconds are not evidence of speed; the byte figures do not depend on load.
"""


def case_paths() -> list[str]:
    return sorted({name for name, _, _ in CASES})


def run_case(name: str) -> None:
    """One model's rows, as JSON lines on stdout (runs in its own subprocess)."""
    import numpy as np
    import torch

    from estimators import Estimator, TrainConfig, load_task
    from estimators.probing._measure import measure_cpu_peak, measure_epoch_peak
    from estimators.task._shapes import ShapeProfile

    task = load_task(MODELS / f"{name}.py")
    est = Estimator(task, device="cpu")
    n = len(task.dataset())
    first_only = dataclasses.replace(task, _cache={
        "dataset": task.dataset(),
        "shapes": ShapeProfile(n, np.zeros(1, np.int64), np.zeros((1, 0), np.int64), "first item", "", varying=False)})
    old_est = Estimator(first_only, device="cpu")
    for case, batches, precision in CASES:
        if case != name:
            continue
        for b in batches:
            config = TrainConfig(micro_batch_size=b, precision=precision)
            row: dict[str, Any] = {"model": name, "batch": b, "precision": precision}
            t0 = time.perf_counter()
            e = est.shape_distribution(config)
            row["estimate_s"] = time.perf_counter() - t0
            row["predicted"] = e.peak_allocated_bytes
            row["method"] = e.method
            shapes = dict(e.batch_shapes or {})
            row["shapes"] = shapes
            if "draws" in shapes:
                torch.manual_seed(0)  # the estimate's real runs start from these weights
                row["measured_batch"] = measure_cpu_peak(task, config, batch_offset=shapes["batch_offset"]).peak_bytes
                row["predicted_batch"] = shapes.get("fullest_batch_peak_bytes", e.peak_allocated_bytes)
            else:
                row["measured_batch"] = measure_cpu_peak(task, config).peak_bytes
                row["predicted_batch"] = e.peak_allocated_bytes
                grouped = est.estimate(config.replace(length_grouped=True)).batch_shapes or {}
                row["grouped_factor"] = grouped.get("padding_factor")
            t0 = time.perf_counter()
            epoch, steps = measure_epoch_peak(task, config)
            row["epoch"], row["epoch_steps"], row["epoch_s"] = epoch.peak_bytes, steps, time.perf_counter() - t0
            row["first_item_estimate"] = old_est.estimate(config).peak_allocated_bytes
            print(json.dumps(row), flush=True)
            print(f"[{name}] b{b} {precision}: predicted {row['predicted']:,}, at that batch "
                  f"{row['measured_batch']:,}, epoch {row['epoch']:,}", file=sys.stderr, flush=True)


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.2f} MiB"


def _pct(a: float, b: float) -> str:
    return f"{100.0 * (a - b) / b:+.2f}%"


def render(rows: list[dict[str, Any]], failures: list[str], *, command: str) -> str:
    L = [SECTION, "",
         f"- Command: `{command}`",
         "- Predicted: `Estimator(task, device=\"cpu\").shape_distribution(config)` (policy `max`: the "
         "worst batch the data loader can form at that micro-batch size; the median and p99 are those "
         "of an epoch of random batches). At that batch: `measure_cpu_peak(task, config)`, whose real "
         "batches are the planned ones (for the data-dependent `moe_dynamic`: the fullest of the estimate's "
         "real batches, predicted, against a real run on that batch, same initial weights). Epoch: "
         "`measure_epoch_peak`, one real epoch in a seeded random order (every item once; the model "
         "trains, so a router drifts). First item: the estimate of the code before this section existed "
         "(the batch template built from the first item). Padding: an epoch's mean padded volume over the "
         "planned batch's, in random and length-grouped order (the factor the predicted throughput uses).",
         "- Models: `varlen_text` (causal LM, 16-384 tokens padded per batch, the first items short), "
         "`multisize_images` (CNN, 3 x H x W with H, W in {24, 40, 64} padded per batch, no single image "
         "64 x 64), `moe_dynamic` (top-1 routing with `nonzero`: shapes depend on data values).",
         "",
         "| model | config | planned batch (sizes) | predicted | at that batch | error | median / p99 batch "
         "| real epoch (steps) | predicted − epoch | first-item estimate | padding random / grouped | estimate |",
         "|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        s = r["shapes"]
        if "draws" in s:
            planned = f"bound over {s['draws']} real batches"
            dist = "—"
        else:
            planned = ", ".join(map(str, s["padded"])) + f" (items {', '.join(map(str, s['items']))})"
            dist = f"{_mib(s['median']['peak_bytes'])} / {_mib(s['p99']['peak_bytes'])}"
        pad = (f"{s['padding_factor']:.2f} / {r['grouped_factor']:.2f}"
               if "padding_factor" in s and r.get("grouped_factor") else "—")
        bound = ""
        if "draws" in s:
            bound = f" (bound {_mib(r['predicted'])}, {_pct(r['predicted'], r['measured_batch'])})"
        L.append(
            f"| {r['model']} | b{r['batch']}, {r['precision']} | {planned} | {_mib(r['predicted_batch'])}{bound} "
            f"| {_mib(r['measured_batch'])} | {_pct(r['predicted_batch'], r['measured_batch'])} | {dist} "
            f"| {_mib(r['epoch'])} ({r['epoch_steps']}) | {_pct(r['predicted'], r['epoch'])} "
            f"| {_mib(r['first_item_estimate'])} ({r['first_item_estimate'] / r['epoch']:.2f}x of epoch) "
            f"| {pad} | {r['estimate_s']:.1f} s |")
    errs = [abs(r["predicted_batch"] - r["measured_batch"]) / r["measured_batch"] for r in rows]
    below = [r for r in rows if r["predicted"] < r["epoch"]]
    L += ["", f"- Max |error| at the planned batch: {100 * max(errs):.4f}% over {len(rows)} configs (goal ≤ 1%)"
          if errs else "- no rows", f"- Predictions below the real epoch's peak: {len(below)}"
          + ("".join(f"; {r['model']} b{r['batch']} {r['precision']} by {r['epoch'] - r['predicted']} B" for r in below))]
    L += NOTES.rstrip("\n").split("\n")
    for f in failures:
        L.append(f"- FAILED: {f}")
    return "\n".join(L) + "\n"


def replace_section(report: str, section: str) -> str:
    """``report`` with its variable-shape section replaced by ``section`` (appended if absent)."""
    start = report.find(SECTION)
    if start < 0:
        return report.rstrip("\n") + "\n\n" + section
    nxt = report.find("\n## ", start + len(SECTION))
    return report[:start] + section + (report[nxt + 1:] if nxt >= 0 else "")


if __name__ == "__main__":
    run_case(sys.argv[1])
