"""Step-time accuracy of the static estimator against probes (real CPU steps).

For each model: ONE ``Estimator(task, device="cpu")`` predicts the step time (uncalibrated)
of every configuration (micro-batch sizes x fp32/bf16-mixed, no accumulation, no
checkpointing); each configuration is then probed (``estimators._probe.probe``, steps=5,
warmup=2) for its measured step time. Reported per model:

* Spearman rank correlation between predicted and measured step times (goal >= 0.9);
* after ``Estimator.calibrate`` with two configurations (smallest and largest batch, fp32),
  the median |error| of the calibrated predictions on the other configurations (goal <= 15%);
* measured/predicted ratio per configuration, to see which op classes are mispriced;
* probe overhead (``overhead_s``): the first probe of the process and the later ones
  (goal <= 3 s).

Everything runs sequentially, with the default number of torch threads.

    python benchmarks/time_accuracy.py [--models mlp,cnn_bn,...] [--batches 8,32,96] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators._probe import probe  # noqa: E402

MODELS = ("mlp", "cnn_bn", "gpt_tied", "vit", "frozen_backbone")
BATCHES = (8, 32, 96)
PRECISIONS = ("fp32", "bf16-mixed")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "time.md"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):
        idx = np.where(x == v)[0]
        if len(idx) > 1:
            r[idx] = r[idx].mean()
    return r


def spearman(a, b) -> float:
    ra, rb = ranks(np.asarray(a)), ranks(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def header(cmd: str, load_start, load_end) -> list[str]:
    return [
        f"Command: `{cmd}`",
        "",
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- torch {torch.__version__}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        f"- load average (1/5/15 min) at start: {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}",
        f"- load average at end (or at this write): {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}",
        "",
    ]


def model_path(name: str) -> Path:
    p = ROOT / "benchmarks" / "models" / f"{name}.py"
    return p if p.is_file() else ROOT / "examples" / f"{name}.py"


def run_model(name: str, batches, overheads: list[dict]) -> dict:
    path = model_path(name)
    task = load_task(str(path))
    est = Estimator(task, device="cpu")
    rows = []
    t0 = time.perf_counter()
    configs = [TrainConfig(micro_batch_size=b, precision=p) for p in PRECISIONS for b in batches]
    for c in configs:
        t = time.perf_counter()
        e = est.estimate(c)
        rows.append({"config": c, "pred": e.step_time_s, "method": e.method, "est_s": time.perf_counter() - t})
    est_total = time.perf_counter() - t0
    log(f"[{name}] estimated {len(configs)} configs in {est_total:.1f}s")
    for r in rows:
        c = r["config"]
        res = probe(str(path), c, device="cpu", steps=5, warmup=2)
        overheads.append({"model": name, "config": c.describe(), "overhead_s": res.overhead_s, "wall_s": res.wall_s})
        r["status"] = res.status
        r["meas"] = res.estimate.step_time_s if (res.ok and res.estimate is not None) else None
        r["overhead_s"] = res.overhead_s
        r["message"] = res.message
        log(f"[{name}] {c.describe()}: pred {r['pred']:.4f}s meas {r['meas']} ({res.status}) overhead {res.overhead_s:.2f}s")
    ok = [r for r in rows if r["meas"]]
    rho = spearman([r["pred"] for r in ok], [r["meas"] for r in ok]) if len(ok) >= 3 else float("nan")
    # Calibration: smallest and largest batch at fp32.
    cal = [r for r in ok if r["config"].precision == "fp32" and r["config"].micro_batch_size in (min(batches), max(batches))]
    for r in cal:
        est.calibrate(r["config"], r["meas"])
    rest = [r for r in ok if r not in cal]
    errs = []
    for r in rest:
        r["cal_pred"] = est.estimate(r["config"]).step_time_s
        r["cal_err"] = (r["cal_pred"] - r["meas"]) / r["meas"]
        errs.append(abs(r["cal_err"]))
    factor = est._calibration.factor
    return {"name": name, "rows": rows, "rho": rho, "median_err": statistics.median(errs) if errs else float("nan"),
            "factor": factor, "cal": [r["config"].describe() for r in cal], "est_s": est_total}


def render(cmd, load_start, results, overheads, done: bool) -> str:
    out = ["# Step-time accuracy: static estimator vs probes (CPU)", ""]
    out += header(cmd, load_start, os.getloadavg())
    if not done:
        out += ["**PARTIAL: the run had not finished when this was written.**", ""]
    out += ["Goals: Spearman >= 0.9 per model; median |error| of calibrated predictions (2 probes: smallest and "
            "largest batch at fp32) on the other configurations <= 15%; probe overhead <= 3 s.", ""]
    out += ["## Summary", "", "| model | configs ok | Spearman | calib. factor (meas/pred) | median abs err after calib. | goals |",
            "|---|---|---|---|---|---|"]
    for r in results:
        n_ok = sum(1 for x in r["rows"] if x["meas"])
        g1 = r["rho"] >= 0.9
        g2 = r["median_err"] <= 0.15
        out.append(f"| {r['name']} | {n_ok}/{len(r['rows'])} | {r['rho']:.3f} | {r['factor']:.2f} | "
                   f"{100 * r['median_err']:.1f}% | rank {'ok' if g1 else 'MISS'}, calib {'ok' if g2 else 'MISS'} |")
    out += ["", "## Per configuration", "",
            "ratio = measured / predicted (uncalibrated). Within a model, a ratio that moves with batch size or "
            "precision points at mispriced op classes.", "",
            "| model | config | method | predicted s | measured s | ratio | calibrated s | calib. err |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r["rows"]:
            ratio = f"{x['meas'] / x['pred']:.2f}" if x["meas"] and x["pred"] else "-"
            cal = f"{x['cal_pred']:.4f}" if "cal_pred" in x else ("(calibration point)" if x["config"].describe() in r["cal"] else "-")
            err = f"{100 * x['cal_err']:+.1f}%" if "cal_err" in x else "-"
            meas = f"{x['meas']:.4f}" if x["meas"] else f"{x['status']}: {x['message'][:60]}"
            out.append(f"| {r['name']} | {x['config'].describe()} | {x['method']} | {x['pred']:.4f} | {meas} | {ratio} | {cal} | {err} |")
    out += ["", "## Probe overhead", ""]
    if overheads:
        first = overheads[0]
        later = [o["overhead_s"] for o in overheads[1:]]
        out.append(f"- first probe of the process ({first['model']}, {first['config']}): overhead {first['overhead_s']:.2f} s "
                   f"(wall {first['wall_s']:.2f} s)")
        if later:
            out.append(f"- later probes (n={len(later)}): median overhead {statistics.median(later):.2f} s, "
                       f"max {max(later):.2f} s")
        out.append(f"- all probes: median {statistics.median([o['overhead_s'] for o in overheads]):.2f} s")
        out.append("")
        out.append("Estimator cost per model (all configurations, first estimate includes tracing): " +
                   ", ".join(f"{r['name']} {r['est_s']:.1f} s" for r in results))
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(str(b) for b in BATCHES))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    load_start = os.getloadavg()
    batches = tuple(int(b) for b in args.batches.split(","))
    results, overheads = [], []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        try:
            results.append(run_model(name, batches, overheads))
        except Exception as exc:  # noqa: BLE001
            log(f"[{name}] failed: {type(exc).__name__}: {exc}")
        out.write_text(render(cmd, load_start, results, overheads, done=False))
    out.write_text(render(cmd, load_start, results, overheads, done=True))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
