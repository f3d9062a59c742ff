"""Search quality: ``memplan.search`` against an exhaustive measured grid (CPU).

Per model and budget:

* search: ``memplan.search(path, vram=budget, global_batch=G, precisions=P, probe_top=2)``
  with default trials, timed (search cost; a fresh MEMPLAN_CACHE_DIR so no study resumes);
* grid: every configuration of the same space (``memplan.planning._space.build_space`` with the
  arguments search uses) probed (``estimators.probing._probe.probe``, steps=5, warmup=2) with the
  budget enforced (``budget_bytes = budget * (1 - margin)``), timed (grid cost);
* quality: the chosen plan's measured throughput as a % of the grid's best feasible one
  (goal >= 95%), whether its measured peak is within the budget (goal: always), and
  search cost / grid cost (goal <= 20%).

Budgets: "generous" = 2x the largest estimated peak of the space (everything fits);
"tight" = just below the estimated peak of the 3 configurations that were measured fastest
in the grid, so they are excluded (relaxed to fewer if nothing else would fit).

The grid is probed once, under the generous budget; feasibility under the tight budget is
read from the same probes' measured peaks (a probe under the tight budget would report
``oom`` for exactly those over it). The grid cost reported for both budgets is that one
grid's wall time. To keep the grid affordable on a shared 2-core machine the space is
reduced the same way for search and grid: a fixed global batch (by default each model file's own) and fp32 only
(``--precisions``).

    python benchmarks/search_quality.py [--models digits,mlp,cnn_bn,gpt_tied] [--global-batch model|N]
    (--models may also name any other file in benchmarks/models, e.g. frozen_backbone,moe_dynamic)
        [--precisions fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A fresh cache (studies, rates) for this run; the machine's measured CPU rates are copied in
# so the estimator prices time as it does for a user.
_OLD_CACHE = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memplan")
_TMP_CACHE = tempfile.mkdtemp(prefix="memplan-search-bench-")
for f in glob.glob(os.path.join(_OLD_CACHE, "cpu-rates-*.json")):
    shutil.copy(f, _TMP_CACHE)
os.environ["MEMPLAN_CACHE_DIR"] = _TMP_CACHE

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.runtime._checkpoint import max_checkpoint_segments  # noqa: E402
from estimators.probing._probe import probe  # noqa: E402
from estimators.probing._race import race  # noqa: E402
from memplan.planning import search  # noqa: E402
from memplan.planning._inputs import meta_model  # noqa: E402
from memplan.planning._space import _precisions, build_space  # noqa: E402

MODELS = {
    "digits": ROOT / "examples" / "digits.py",
    "mlp": ROOT / "benchmarks" / "models" / "mlp.py",
    "cnn_bn": ROOT / "benchmarks" / "models" / "cnn_bn.py",
    "gpt_tied": ROOT / "benchmarks" / "models" / "gpt_tied.py",
}
# The other benchmark models (frozen parts, data-dependent shapes, an encoder-decoder, …):
# chosen with --models; the default run is the four above.
MORE_MODELS = {p.stem: p for p in sorted((ROOT / "benchmarks" / "models").glob("*.py")) if p.stem not in MODELS}
MARGIN = 0.10
SETTLE_WITHIN = 0.80
SETTLE_MAX = 3
SETTLE_RACES = 4
SETTLE_ROUNDS = 10
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "search.md"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mb(n) -> str:
    return f"{n / 1e6:.2f} MB" if n is not None else "-"


def throughput(global_batch: int, step_s: float | None) -> float:
    return global_batch / step_s if step_s else 0.0


def global_batch_for(path: Path, arg: str) -> int:
    if arg != "model":
        return int(arg)
    return int(load_task(str(path)).settings["global_batch"])


def settle(path: Path, chosen: TrainConfig, feasible: list[TrainConfig], grid: dict, global_batch: int,
           limit: int, name: str, label: str) -> tuple[dict[TrainConfig, float], dict[TrainConfig, list[float]]]:
    """Throughput of the chosen plan's rivals relative to it, settled by repeated races.

    Separate probes cannot order configurations a few percent apart on this 2-core machine:
    eight 40-step probes of one configuration (mlp, micro-batch 32), each in a fresh process,
    measured 35-51 ms a step, and within one process the median of 40 steps drifts by 10-24%
    over a minute. So every feasible configuration within SETTLE_WITHIN of the grid's best
    (at most SETTLE_MAX of them) is compared with the chosen plan step against step:
    SETTLE_RACES races (``estimators.probing._race.race``, SETTLE_ROUNDS rounds each, each race a
    fresh process, alternating which of the two is built and stepped first). A race's ratio
    is the median of its rounds' step-time ratios; the rival keeps the median of its races'.
    Returns those ratios (rival's throughput / the chosen plan's; the chosen plan's is 1) and
    the races' ratios. This referee's cost is counted neither in the search's cost nor in the
    grid's.
    """
    best_tp = max(throughput(global_batch, grid[c]["step_s"]) for c in feasible)
    leaders = sorted((c for c in feasible if throughput(global_batch, grid[c]["step_s"]) >= SETTLE_WITHIN * best_tp),
                     key=lambda c: -throughput(global_batch, grid[c]["step_s"]))[:SETTLE_MAX]
    ratios: dict[TrainConfig, list[float]] = {chosen: [1.0]}
    for rival in leaders:
        if rival == chosen:
            continue
        ratios[rival] = []
        for k in range(SETTLE_RACES):
            pair = (chosen, rival) if k % 2 == 0 else (rival, chosen)
            r = race(str(path), pair, rounds=SETTLE_ROUNDS, timeout_s=600)
            if not r.ok:
                log(f"[{name}] {label} race {pair[0].describe()} vs {pair[1].describe()}: {r.status} {r.message}")
                continue
            # ratio = first's step / second's: the rival's throughput over the chosen plan's.
            ratios[rival].append(r.ratio if pair[0] == chosen else 1 / r.ratio)
    out = {c: statistics.median(v) if v else 0.0 for c, v in ratios.items()}
    log(f"[{name}] {label} settled (relative to the chosen plan): "
        + ", ".join(f"{c.describe()} {v:.3f} (races {_span(ratios[c])})" for c, v in out.items()))
    return out, ratios


def _span(values: list[float]) -> str:
    """The lowest and highest ratio (of rounds or races): how far this referee can be trusted."""
    return f"{min(values):.2f}-{max(values):.2f}" if values else "none"


def run_model(name: str, path: Path, global_batch: int, precisions: tuple[str, ...], deadline: float) -> dict:
    task = load_task(str(path))
    est = Estimator(task, device="cpu")
    space = build_space(
        dataset_size=task.dataset_size() if task.train_data is not None else None,
        global_batch=global_batch,
        precisions=_precisions(est, precisions),
        max_segments=max_checkpoint_segments(meta_model(task), task.checkpoint_blocks),
        max_micro_batch=None,
    )
    configs = list(space)
    preds = {c: est.estimate(c) for c in configs}
    need = {c: preds[c].peak_bytes + preds[c].context_bytes for c in configs}
    generous = int(math.ceil(2 * max(need.values()) / (1 - MARGIN)))
    gen_limit = int(generous * (1 - MARGIN))
    log(f"[{name}] space {len(configs)} configs; generous budget {mb(generous)}")

    grid = {}
    t0 = time.perf_counter()
    for c in configs:
        r = probe(str(path), c, device="cpu", steps=5, warmup=2, budget_bytes=gen_limit)
        m = r.estimate if r.ok else None
        grid[c] = {"status": r.status, "step_s": m.step_time_s if m else None,
                   "peak": (m.peak_bytes + m.context_bytes) if m else None, "msg": r.message}
        log(f"[{name}] grid {c.describe()}: {r.status} step {grid[c]['step_s']} peak {mb(grid[c]['peak'])}")
    grid_s = time.perf_counter() - t0

    ok = [c for c in configs if grid[c]["status"] == "ok"]
    by_speed = sorted(ok, key=lambda c: -throughput(space.global_batch, grid[c]["step_s"]))
    tight = None
    for k in (3, 2, 1):
        top = by_speed[:k]
        limit = int(0.98 * min(min(need[c], grid[c]["peak"]) for c in top))
        rest = [c for c in ok if grid[c]["peak"] <= limit and need[c] <= limit]
        if rest:
            tight, excluded_top = int(limit / (1 - MARGIN)), k
            break
    budgets = [("generous", generous)]
    if tight is not None:
        budgets.append(("tight", tight))

    out = {"name": name, "space": len(configs), "global_batch": space.global_batch, "grid_s": grid_s,
           "segments": space.checkpoint_segments, "micros": space.micro_batch_sizes,
           "precisions": space.precisions, "runs": [], "grid": grid, "preds": preds}
    for label, budget in budgets:
        limit = int(budget * (1 - MARGIN))
        feasible = [c for c in ok if grid[c]["peak"] <= limit]
        best = max(feasible, key=lambda c: throughput(space.global_batch, grid[c]["step_s"]))
        best_tp = throughput(space.global_batch, grid[best]["step_s"])
        t1 = time.perf_counter()
        plan = search(str(path), vram=budget, global_batch=global_batch, precisions=list(precisions),
                      probe_top=2, margin=MARGIN)
        search_s = time.perf_counter() - t1
        chosen = plan.best.config
        probed_in_search = plan.best.measured is not None
        if probed_in_search:
            s_step = plan.best.measured.step_time_s
            s_peak = plan.best.measured.peak_bytes + plan.best.measured.context_bytes
        else:
            r = probe(str(path), chosen, device="cpu", steps=5, warmup=2, budget_bytes=limit)
            s_step = r.estimate.step_time_s if r.ok and r.estimate else None
            s_peak = (r.estimate.peak_bytes + r.estimate.context_bytes) if r.estimate else None
        g = grid.get(chosen)
        g_tp = throughput(space.global_batch, g["step_s"]) if g else 0.0
        settled, settled_rounds = settle(path, chosen, feasible, grid, space.global_batch, limit, name, label)
        settled_best = max(settled, key=lambda c: settled[c])
        run = {
            "label": label, "budget": budget, "limit": limit, "n_feasible": len(feasible),
            "excluded_top": excluded_top if label == "tight" else 0,
            "best": best, "best_tp": best_tp, "chosen": chosen, "search_s": search_s,
            "probed_in_search": probed_in_search, "search_tp": throughput(space.global_batch, s_step),
            "search_peak": s_peak, "grid_tp": g_tp, "grid_peak": g["peak"] if g else None,
            "pct_grid": 100 * g_tp / best_tp if best_tp else float("nan"),
            "settled": settled, "settled_rounds": settled_rounds, "settled_best": settled_best,
            "pct_settled": 100 * settled[chosen] / settled[settled_best] if settled.get(chosen) else float("nan"),
            "pct_search_probe": 100 * throughput(space.global_batch, s_step) / best_tp if best_tp else float("nan"),
            "within": (s_peak is not None and s_peak <= limit) and (g is None or g["peak"] is None or g["peak"] <= limit),
            "ratio": search_s / grid_s, "trials": plan.trials, "notes": plan.notes,
            "top_measured": [str(e.config.describe()) for e in plan.entries if e.measured is not None],
        }
        out["runs"].append(run)
        log(f"[{name}] {label}: chosen {chosen.describe()} ({run['pct_settled']:.1f}% settled, {run['pct_grid']:.1f}% of grid best {best.describe()}), "
            f"search {search_s:.1f}s grid {grid_s:.1f}s")
    return out


def render(cmd: str, load_start, results, args, done: bool, skipped) -> str:
    la = os.getloadavg()
    out = ["# Search quality: memplan.search vs an exhaustive measured grid (CPU)", "",
           f"Command: `{cmd}`", "",
           f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
           f"- torch {torch.__version__}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
           f"- load average (1/5/15 min) at start: {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}",
           f"- load average at end (or at this write): {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}",
           f"- fresh MEMPLAN_CACHE_DIR: {_TMP_CACHE}; margin {MARGIN}; search: probe_top=2, default trials (60)",
           f"- space reduced for search and grid alike: global batch {args.global_batch} (per model below), precisions {args.precisions}; "
           "micro-batch = every divisor of the global batch, checkpoint segments as search builds them",
           "- the grid is probed once under the generous budget; tight-budget feasibility = measured peak <= tight limit; "
           "grid cost for both budgets = that grid's wall time",
           "- the grid ran before the searches, so the searches did not pay the probe server's start (~10 s under load)",
           ""]
    if not done:
        out += ["**PARTIAL: the run had not finished when this was written.**", ""]
    if skipped:
        out += [f"Skipped (deadline or failure): {', '.join(skipped)}", ""]
    out += ["Goals: chosen plan's measured throughput >= 95% of the grid's best feasible; chosen plan's measured peak "
            "within budget (always); search cost / grid cost <= 20%.", "",
            f"Quality is judged on settled figures: each feasible configuration within {100 * SETTLE_WITHIN:.0f}% of the "
            f"grid's best (at most {SETTLE_MAX}) is raced against the chosen plan {SETTLE_RACES} times "
            f"(`estimators.probing._race`: both in one fresh process, {SETTLE_ROUNDS} rounds of one optimizer step each, "
            "alternating which goes first); a race's ratio is the median of its rounds' step-time ratios, and the "
            "rival keeps the median of its races' (their lowest and highest are shown: where they straddle 1, this "
            "referee cannot tell the two apart). Races are also how the search itself breaks close calls, so this "
            "referee shares whatever bias races carry (`race.md`, `race_alone.md`: on cnn_bn races favoured one of a "
            "pair by 8-13% where the two trained alone came within 6% of each other, either way); separate probes, "
            "the alternative, spread by 1.45x for one configuration here (eight 40-step probes of mlp, micro-batch 32). The single grid probe's figures are "
            "shown beside them. The settling is not counted in either cost.", "",
            "## Summary", "",
            "| model | budget | feasible (grid) | best (settled) | chosen | chosen % of best (settled) | "
            "% (single grid probe) | peak within budget | search s | grid s | cost ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r["runs"]:
            out.append(
                f"| {r['name']} | {x['label']} {mb(x['budget'])} (limit {mb(x['limit'])}) | {x['n_feasible']}/{r['space']} | "
                f"{x['settled_best'].describe()} ({x['settled'][x['settled_best']]:.3f}x the chosen; races {_span(x['settled_rounds'][x['settled_best']])}) | {x['chosen'].describe()} | "
                f"{x['pct_settled']:.1f}% | {x['pct_grid']:.1f}% (grid best {x['best'].describe()}) | {'yes' if x['within'] else 'NO'} (search probe {mb(x['search_peak'])}, grid {mb(x['grid_peak'])}) | "
                f"{x['search_s']:.1f} | {r['grid_s']:.1f} | {100 * x['ratio']:.0f}% |")
    out += ["", "## Details", ""]
    for r in results:
        out += [f"### {r['name']}", "",
                f"Space: {r['space']} configurations (micro {r['micros']}, segments {r['segments']}, {r['precisions']}), "
                f"global batch {r['global_batch']}.", ""]
        for x in r["runs"]:
            out.append(f"- {x['label']} settled, throughput relative to the chosen plan (median of {SETTLE_RACES} races of {SETTLE_ROUNDS} rounds): "
                       + "; ".join(f"{c.describe()} {v:.3f} (races {_span(x['settled_rounds'][c])})"
                                   for c, v in x["settled"].items()))
        for x in r["runs"]:
            out.append(f"- {x['label']}: trials {x['trials']}; search's own probe of the chosen plan {x['search_tp']:.0f}/s; probed by search: {x['top_measured']}; "
                       f"notes: {list(x['notes'])}; tight excludes the {x['excluded_top']} measured-fastest" if x['label'] == 'tight'
                       else f"- {x['label']}: trials {x['trials']}; search's own probe of the chosen plan {x['search_tp']:.0f}/s; probed by search: {x['top_measured']}; notes: {list(x['notes'])}")
        out += ["", "| config | predicted step s | measured step s | meas/pred | predicted peak | measured peak | status |",
                "|---|---|---|---|---|---|---|"]
        for c, g in r["grid"].items():
            p = r["preds"][c]
            ratio = f"{g['step_s'] / p.step_time_s:.2f}" if g["step_s"] and p.step_time_s else "-"
            st = f"{g['step_s']:.4f}" if g["step_s"] else "-"
            out.append(f"| {c.describe()} | {p.step_time_s:.4f} | {st} | {ratio} | {mb(p.peak_bytes + p.context_bytes)} | "
                       f"{mb(g['peak'])} | {g['status']} {g['msg'][:50]} |")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--global-batch", default="model",
                    help="a number, or 'model': each model file's own settings['global_batch'], as `memplan plan` uses")
    ap.add_argument("--precisions", default="fp32")
    ap.add_argument("--deadline-utc", default=None, help="HH:MM; stop starting work after it")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    load_start = os.getloadavg()
    deadline = float("inf")
    if args.deadline_utc:
        now = _dt.datetime.now(_dt.timezone.utc)
        hh, mm = (int(v) for v in args.deadline_utc.split(":"))
        deadline = now.replace(hour=hh, minute=mm, second=0).timestamp()
    precisions = tuple(args.precisions.split(","))
    known = {**MODELS, **MORE_MODELS}
    unknown = [n for n in args.models.split(",") if n not in known]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    results, skipped = [], []
    outp = Path(args.out)
    for name in args.models.split(","):
        if time.time() > deadline:
            skipped.append(name)
            continue
        try:
            results.append(run_model(name, known[name], global_batch_for(known[name], args.global_batch),
                                     precisions, deadline))
        except Exception as exc:  # noqa: BLE001
            log(f"[{name}] failed: {type(exc).__name__}: {exc}")
            skipped.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
        outp.write_text(render(cmd, load_start, results, args, False, skipped))
    outp.write_text(render(cmd, load_start, results, args, True, skipped))
    log(f"wrote {outp}")


if __name__ == "__main__":
    main()
