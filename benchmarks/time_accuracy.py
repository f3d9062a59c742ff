"""Step-time accuracy of the static estimator against real CPU steps.

For each model: ONE ``Estimator(task, device="cpu")`` predicts the step time (uncalibrated)
of every configuration (micro-batch sizes x fp32/bf16-mixed, no accumulation, no
checkpointing); each configuration's real step time is measured (see below). Reported per model:

* Spearman rank correlation between predicted and measured step times (goal >= 0.9);
* after ``Estimator.calibrate`` with two measured configurations (``--calibrate-on``, default
  the largest batch at fp32 and at bf16: the two a search probes here, since it probes the best
  configuration and then the best of each other precision, and the largest batch is the
  fastest of each precision on these models), the median and max |error| of the calibrated
  predictions on the other configurations (goal: median <= 15%);
* measured/predicted ratio per configuration, to see which op classes are mispriced;
* probe overhead (``overhead_s``: a probe's wall time less its steps): the first probe of the
  process and the later ones (goal <= 3 s).

Measurements (``--measure``):

* ``probe`` (default): ``estimators.probing._probe.probe`` per configuration (steps=5, warmup=2), the
  median wall time of a step, as a search sees it. Use on a quiet machine.
* ``cpu-time``: the same step (``estimators.runtime._planned.PlannedSteps``) in this process with ONE torch
  thread, timed by the process's CPU time (median of 3-9 steps after 2 warm-up steps). On a
  shared machine the wall clock counts other processes' time slices; the CPU time of a
  single-threaded step barely moves with the load (cache and memory-bus sharing remain). The
  estimator's CPU rates are then measured the same way (``estimators.timing._timing._clock``). Probe
  overhead is still measured, with one short probe per model.

Measurements are written to ``--save`` (default ``benchmarks/results/time_measurements.json``)
with the machine, clock and load average of each point; ``--cache FILE`` reads them back
instead of measuring, so the model can be iterated on offline (predictions need only traces).

The CPU rates are measured afresh at the start (``--keep-rates``: use the cached file) and
again at the end; both are saved with the measurements, and ``--cache`` predicts with the
saved start rates, so an offline rerun compares like with like.

    python benchmarks/time_accuracy.py [--models mlp,cnn_bn,...] [--batches 8,32,96]
        [--threads N] [--measure probe|cpu-time] [--cache FILE] [--save FILE] [--out FILE]
        [--calibrate-on max-fp32,max-bf16] [--also-calibrate-on "min-fp32,max-fp32;..."]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.timing._calibration import TimeCalibration  # noqa: E402
from estimators.timing._cpu_rates import cpu_name, cpu_rates, cpu_rates_path  # noqa: E402
from estimators.timing._timing import DeviceRates  # noqa: E402

MODELS = ("mlp", "cnn_bn", "gpt_tied", "vit", "frozen_backbone")
BATCHES = (8, 32, 96)
PRECISIONS = ("fp32", "bf16-mixed")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "time.md"
DEFAULT_SAVE = ROOT / "benchmarks" / "results" / "time_measurements.json"


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


def model_path(name: str) -> Path:
    p = ROOT / "benchmarks" / "models" / f"{name}.py"
    return p if p.is_file() else ROOT / "examples" / f"{name}.py"


def key(name: str, c: TrainConfig) -> str:
    return f"{name}|{c.micro_batch_size}|{c.precision}"


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability()}


# -- measuring ---------------------------------------------------------------------------------

def measure_cpu_time(path: Path, config: TrainConfig, *, warmup: int = 2, min_steps: int = 3,
                     max_steps: int = 9, budget_s: float = 6.0) -> dict[str, Any]:
    """The probe's step, in this process, timed by CPU time (one torch thread)."""
    from estimators.runtime._build import build_for_training
    from estimators.runtime._planned import PlannedSteps

    task = load_task(str(path))
    torch.manual_seed(0)
    step = PlannedSteps(task, config, build_for_training(task, config, "cpu"))
    task.batch_template()
    for i in range(1, warmup + 1):  # the first step creates the optimizer state
        step(i)
    cpu, wall = [], []
    started = time.perf_counter()
    i = warmup
    while len(cpu) < max_steps and (len(cpu) < min_steps or time.perf_counter() - started < budget_s):
        i += 1
        t, c = time.perf_counter(), time.process_time()
        step(i)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return {"step_s": statistics.median(cpu), "times_s": cpu, "wall_s": wall}


def measure_probe(path: Path, config: TrainConfig, overheads: list[dict]) -> dict[str, Any]:
    from estimators.probing._probe import probe

    res = probe(str(path), config, device="cpu", steps=5, warmup=2, timeout_s=600)
    overheads.append({"model": path.stem, "config": config.describe(), "overhead_s": res.overhead_s,
                      "wall_s": res.wall_s, "status": res.status})
    ok = res.ok and res.estimate is not None
    return {"step_s": res.estimate.step_time_s if ok else None, "status": res.status,
            "message": res.message, "overhead_s": res.overhead_s}


def probe_overhead(path: Path, config: TrainConfig, overheads: list[dict]) -> None:
    """One short probe, for its overhead only (process, task load, model build, transfer)."""
    from estimators.probing._probe import probe

    res = probe(str(path), config, device="cpu", steps=1, warmup=0, timeout_s=600)
    overheads.append({"model": path.stem, "config": config.describe(), "overhead_s": res.overhead_s,
                      "wall_s": res.wall_s, "status": res.status})
    log(f"[{path.stem}] overhead probe {config.describe()}: {res.status}, overhead {res.overhead_s:.2f}s")


# -- evaluating --------------------------------------------------------------------------------

def calibration_points(rows: list[dict], spec: str, batches) -> list[dict]:
    """``min-fp32,max-fp32``: the smallest and largest batch at fp32 (and so on)."""
    chosen = []
    for item in spec.split(","):
        which, prec = item.split("-", 1)
        prec = {"fp32": "fp32", "bf16": "bf16-mixed"}[prec]
        b = min(batches) if which == "min" else max(batches)
        chosen += [r for r in rows if r["config"].precision == prec and r["config"].micro_batch_size == b
                   and r["meas"]]
    return chosen


def evaluate(name: str, est: Estimator, rows: list[dict], batches, calibrate_on: str) -> dict:
    ok = [r for r in rows if r["meas"]]
    rho = spearman([r["pred"] for r in ok], [r["meas"] for r in ok]) if len(ok) >= 3 else float("nan")
    cal = calibration_points(ok, calibrate_on, batches)
    for r in cal:
        est.calibrate(r["config"], r["meas"])
    rest = [r for r in ok if r not in cal]
    errs = []
    for r in rest:
        r["cal_pred"] = est.estimate(r["config"]).step_time_s
        r["cal_err"] = (r["cal_pred"] - r["meas"]) / r["meas"]
        errs.append(abs(r["cal_err"]))
    return {"name": name, "rows": rows, "rho": rho, "median_err": statistics.median(errs) if errs else float("nan"),
            "max_err": max(errs) if errs else float("nan"), "coef": est._calibration.coefficients(),
            "cal": [r["config"].describe() for r in cal]}


def run_model(name: str, batches, args, measurements: dict, overheads: list[dict], rates: DeviceRates) -> dict:
    path = model_path(name)
    task = load_task(str(path))
    est = Estimator(task, device="cpu")
    est._rates = rates  # the rates measured with these step times (a cache's own, offline)
    rows = []
    t0 = time.perf_counter()
    configs = [TrainConfig(micro_batch_size=b, precision=p) for p in PRECISIONS for b in batches]
    for c in configs:
        e = est.estimate(c)
        rows.append({"config": c, "pred": e.step_time_s, "method": e.method})
    est_s = time.perf_counter() - t0
    log(f"[{name}] estimated {len(configs)} configs in {est_s:.1f}s")
    points = measurements["points"]
    if not args.cache and args.measure == "cpu-time":
        probe_overhead(path, configs[0], overheads)
    for r in rows:
        c = r["config"]
        k = key(name, c)
        if not args.cache:
            load_before = os.getloadavg()
            m = measure_cpu_time(path, c) if args.measure == "cpu-time" else measure_probe(path, c, overheads)
            m.update(clock="cpu" if args.measure == "cpu-time" else "wall", load_before=load_before,
                     load_after=os.getloadavg(),
                     at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))
            points[k] = m
            log(f"[{name}] {c.describe()}: pred {r['pred']:.4f}s meas {m.get('step_s')} "
                f"load {load_before[0]:.2f}")
        m = points.get(k, {})
        r["meas"] = m.get("step_s")
        r["status"] = m.get("status", "ok" if r["meas"] else "missing")
        r["message"] = m.get("message", "")
    # Other choices of the two calibration points, each on a fresh calibration.
    alternatives = {}
    for spec in args.also_calibrate_on.split(";") if args.also_calibrate_on else []:
        est._calibration = TimeCalibration()
        alt = evaluate(name, est, [dict(r) for r in rows], batches, spec)
        alternatives[spec] = (alt["median_err"], alt["max_err"], alt["coef"])
    est._calibration = TimeCalibration()
    res = evaluate(name, est, rows, batches, args.calibrate_on)
    res["alternatives"] = alternatives
    res["est_s"] = est_s
    return res


# -- report ------------------------------------------------------------------------------------

def render(cmd: str, meta: dict, results: list[dict], overheads: list[dict], rates: dict, done: bool) -> str:
    out = ["# Step-time accuracy: static estimator vs real CPU steps", "", f"Command: `{cmd}`", ""]
    m = meta["machine"]
    if meta.get("measure_command") and meta["measure_command"] != cmd:
        out += [f"Measurements from: `{meta['measure_command']}`", ""]
    out += [f"- measured: {meta['measured']} ({meta['clock_note']})",
            f"- machine: {m['cpu']}, {m['cores']} cores ({m['capability']}), torch {m['torch']}, torch threads "
            f"{m['threads']}",
            f"- load average (1/5/15 min) while measuring: {meta['load_note']}",
            f"- this report written {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
            f"load average now {'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
            f"- CPU rates used (`{rates['file']}`): per-op overhead {rates['overhead_us']:.1f} us; "
            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(rates['class_rates'].items()))
            + " (GFLOP/s for matmul/conv/attention, GB/s for the others)"]
    if meta.get("drift"):
        out.append("- the same rates measured again after the steps, as a ratio end/start (how much the machine "
                   "drifted during the run): " + meta["drift"])
    out.append("")
    if not done:
        out += ["**PARTIAL: the run had not finished when this was written.**", ""]
    out += [f"Goals: Spearman >= 0.9 per model; median |error| of calibrated predictions ({meta['calibrate_on']}: "
            "2 measured configurations) on the other configurations <= 15%; probe overhead <= 3 s.", ""]
    out += ["Model (`estimators/timing/_timing.py`): each traced op costs a fixed per-op overhead plus "
            "max(FLOPs / its class's FLOP/s, bytes / its class's bandwidth), with rates per op class (matmul, "
            "conv, attention — forward and backward apart —, norm, activation, cast, elementwise) and dtype, "
            "measured once per machine and thread count. Calibration fits step = a * overhead + sum_d b_d * work_d "
            "(work per dtype d; a, b >= 0; a dtype no calibration point ran keeps b = 1) to the measured "
            "configurations; the other configurations are predictions.", ""]
    out += ["## Summary", "",
            "| model | configs ok | Spearman | calibrated coefficients | median abs err after calib. "
            "| max abs err | goals |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        n_ok = sum(1 for x in r["rows"] if x["meas"])
        g1, g2 = r["rho"] >= 0.9, r["median_err"] <= 0.15
        coef = ", ".join(f"{k} {v:.2f}" for k, v in r["coef"].items())
        out.append(f"| {r['name']} | {n_ok}/{len(r['rows'])} | {r['rho']:.3f} | {coef} | "
                   f"{100 * r['median_err']:.1f}% | {100 * r['max_err']:.1f}% | "
                   f"rank {'ok' if g1 else 'MISS'}, calib {'ok' if g2 else 'MISS'} |")
    all_errs = [abs(x["cal_err"]) for r in results for x in r["rows"] if "cal_err" in x]
    if all_errs:
        out += ["", f"All models: median abs error after calibration {100 * statistics.median(all_errs):.1f}%, "
                    f"max {100 * max(all_errs):.1f}% (n={len(all_errs)})."]
    specs = [spec for r in results for spec in r.get("alternatives", {})]
    if specs:
        specs = list(dict.fromkeys(specs))
        out += ["", "Other choices of the 2 calibration points (median / max abs error on the other configurations):",
                "", "| model | " + " | ".join(specs) + " |", "|---|" + "---|" * len(specs)]
        for r in results:
            cells = []
            for spec in specs:
                med, mx, _ = r["alternatives"].get(spec, (float("nan"),) * 3)
                cells.append(f"{100 * med:.1f}% / {100 * mx:.1f}%")
            out.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    out += ["", "## Per configuration", "",
            "ratio = measured / predicted (uncalibrated). Within a model, a ratio that moves with batch size or "
            "precision points at mispriced op classes.", "",
            "| model | config | method | predicted s | measured s | ratio | calibrated s | calib. err |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r["rows"]:
            ratio = f"{x['meas'] / x['pred']:.2f}" if x["meas"] and x["pred"] else "-"
            cal = (f"{x['cal_pred']:.4f}" if "cal_pred" in x
                   else ("(calibration point)" if x["config"].describe() in r["cal"] else "-"))
            err = f"{100 * x['cal_err']:+.1f}%" if "cal_err" in x else "-"
            meas = f"{x['meas']:.4f}" if x["meas"] else f"{x['status']}: {x['message'][:60]}"
            out.append(f"| {r['name']} | {x['config'].describe()} | {x['method']} | {x['pred']:.4f} | {meas} | "
                       f"{ratio} | {cal} | {err} |")
    out += ["", "## Probe overhead", ""]
    if overheads:
        first = overheads[0]
        later = [o["overhead_s"] for o in overheads[1:] if o.get("status", "ok") == "ok"]
        out.append(f"- first probe of the process ({first['model']}, {first['config']}): overhead "
                   f"{first['overhead_s']:.2f} s (wall {first['wall_s']:.2f} s; the probe server was started by "
                   "`prestart()` after the CPU rates and before the traces were measured, as a search does; what is left "
                   "of its start, if anything, is in this number)")
        if later:
            out.append(f"- later probes (n={len(later)}): median overhead {statistics.median(later):.2f} s, "
                       f"max {max(later):.2f} s (fork, task load, model build, result)")
        out.append("")
    out.append("Estimator cost per model (all configurations, first estimate includes tracing): "
               + ", ".join(f"{r['name']} {r['est_s']:.1f} s" for r in results))
    return "\n".join(out) + "\n"


def load_note(points: dict) -> str:
    loads = [p["load_before"][0] for p in points.values() if "load_before" in p]
    loads += [p["load_after"][0] for p in points.values() if "load_after" in p]
    if not loads:
        return "not recorded"
    return f"1-min average {min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}) over the points"


def drift(measurements: dict) -> str:
    start, end = measurements.get("rates"), measurements.get("rates_after")
    if not start or not end:
        return ""
    parts = [f"overhead {end['op_overhead_s'] / start['op_overhead_s']:.2f}"]
    parts += [f"{k} {end['class_rates'][k] / v:.2f}" for k, v in sorted(start["class_rates"].items())
              if k in end["class_rates"]]
    return ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(str(b) for b in BATCHES))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    ap.add_argument("--measure", choices=("probe", "cpu-time"), default="probe")
    ap.add_argument("--cache", help="read measurements from this JSON file instead of measuring")
    ap.add_argument("--save", default=str(DEFAULT_SAVE), help="write the measurements here")
    ap.add_argument("--calibrate-on", default="max-fp32,max-bf16",
                    help="the 2 measured configurations used to calibrate, e.g. min-fp32,max-bf16")
    ap.add_argument("--also-calibrate-on", default="min-fp32,max-fp32;min-fp32,max-bf16;min-fp32,min-bf16",
                    help="other calibration choices to report, separated by ';' (empty: none)")
    ap.add_argument("--keep-rates", action="store_true",
                    help="use the cached CPU rates file instead of measuring the rates again first")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure == "cpu-time" and not args.cache and torch.get_num_threads() != 1:
        ap.error("--measure cpu-time needs --threads 1 (CPU time sums the threads and their spin-waits)")
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.cache:
        measurements = json.loads(Path(args.cache).read_text())
        if measurements["machine"]["threads"] != torch.get_num_threads():
            log(f"note: the cache was measured with {measurements['machine']['threads']} threads; "
                f"predicting for {torch.get_num_threads()}")
    else:
        measurements = {"machine": machine(), "clock": "cpu" if args.measure == "cpu-time" else "wall",
                        "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        "command": cmd, "points": {}, "probe_overhead": []}
        if Path(args.save).is_file():  # keep other models' points of an earlier run
            old = json.loads(Path(args.save).read_text())
            if old.get("machine") == measurements["machine"] and old.get("clock") == measurements["clock"]:
                measurements["points"] = old.get("points", {})
    if args.cache and "rates" in measurements:
        rates = DeviceRates(**measurements["rates"])
        rates_file = f"{args.cache}, measured with its steps"
    else:
        # Measured afresh by default: a rates file cached on a busy machine would be compared
        # with steps measured on a quiet one. Before the probe server starts: its torch import
        # competing for the two cores made the 2-thread rates 3-30x wrong.
        rates = cpu_rates(refresh=not args.keep_rates)
        rates_file = cpu_rates_path().name
        measurements["rates"] = asdict(rates)
    if not args.cache:
        from estimators.probing._probe import prestart

        # As a search does: the probe server imports torch while the traces are measured, so
        # a probe's overhead is its own (fork, task load, model build, result).
        prestart()
    rates_info = {"file": rates_file, "overhead_us": rates.op_overhead_s * 1e6, "class_rates": rates.class_rates}
    overheads: list[dict] = [] if not args.cache else list(measurements.get("probe_overhead", []))
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(done: bool) -> None:
        clock = measurements["clock"]
        meta = {"machine": measurements["machine"], "calibrate_on": args.calibrate_on,
                "measure_command": measurements.get("command"),
                "measured": measurements.get("started", "?") + " to " + measurements.get("finished", "?")
                + (f" (read from {args.cache})" if args.cache else ""),
                "clock_note": ("CPU time of single-threaded steps, in-process" if clock == "cpu"
                               else "wall time, median of 5 probe steps"),
                "load_note": load_note(measurements["points"]),
                "drift": drift(measurements)}
        out.write_text(render(cmd, meta, results, overheads, rates_info, done))
        if not args.cache:
            measurements["probe_overhead"] = overheads
            Path(args.save).write_text(json.dumps(measurements, indent=1) + "\n")

    for name in args.models.split(","):
        try:
            results.append(run_model(name, batches, args, measurements, overheads, rates))
        except Exception as exc:  # noqa: BLE001
            log(f"[{name}] failed: {type(exc).__name__}: {exc}")
        write(done=False)
    if not args.cache:
        # Measured again at the end: how far the machine drifted while the steps ran.
        measurements["rates_after"] = asdict(cpu_rates(refresh=True))
        measurements["finished"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    write(done=True)
    for r in results:
        log(f"{r['name']:16s} rho {r['rho']:.3f}  {r['coef']}  "
            f"median err {100 * r['median_err']:.1f}%  max {100 * r['max_err']:.1f}%")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
