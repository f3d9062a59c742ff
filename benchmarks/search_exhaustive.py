"""The chosen plan against the exhaustive best of the same space, on the fit_big cells (no GPU here).

    python benchmarks/search_exhaustive.py --out benchmarks/results/search_exhaustive.md
    python benchmarks/search_exhaustive.py --models 8b --targets A100-40GB A100-80GB --out /tmp/ex.md

Each cell (``benchmarks/fit_big.py``'s model, sequence length and target) runs in a process of
its own with an empty cache: ``memplan.search(gpu=..., probe_top=0)``, a search not given a
trial budget whose default is fit_big's T (the chosen plan, its wall time and what its plan
says it covered; a budget given would be the enumeration's limit), then the same
search again with a trial budget larger than the space, which resumes the study and estimates
every configuration the first left (the exhaustive best of the same space; a configuration
pruned without a trace is one known not to fit). ``--enumerate-limit N`` sets
``ENUMERATE_LIMIT`` (0: a space larger than the trials is always sampled, as before it).

Checks: the chosen plan reaches >= 98% of the exhaustive best's predicted samples/s in every
cell, and of two single cards of one kind (same model and sequence), the larger never gets a
slower plan than the smaller (the exhaustive best, too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from fit_big import GLOBAL_BATCH, LONG, SEQS, TARGETS, _machine  # noqa: E402

CARD_ORDER = ("RTX-4090", "A100-40GB", "A100-80GB")
"""Single cards from the smallest memory up (the monotonicity check's order)."""


def run_cell(model: str, seq: int, target: str, trials: int, limit: int | None) -> dict:
    from models_large import llama3_task

    import memplan
    from estimators import NoFeasiblePlanError
    from memplan.planning import _search

    _search.DEFAULT_TRIALS = trials  # the chosen search is a default search with fit_big's budget
    if limit is not None:
        _search.ENUMERATE_LIMIT = limit
    gpu, gpus = TARGETS[target]
    task = llama3_task(model, seq)
    cell: dict = {"model": model, "seq": seq, "target": target, "trials": trials, "limit": _search.ENUMERATE_LIMIT,
                  "load_at_start": os.getloadavg()[0]}
    kwargs = dict(gpu=gpu, gpus=gpus, global_batch=GLOBAL_BATCH[model], progress=False, host_memory="128GB",
                  probe_top=0, compile_top=0)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MEMPLAN_CACHE_DIR"] = cache
        for name, n in (("chosen", None), ("exhaustive", 10**6)):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                plan = memplan.search(task, trials=n, **kwargs)
            except NoFeasiblePlanError as exc:
                cell[name] = {"status": "none", "message": str(exc).splitlines()[0]}
            else:
                cell[name] = {"status": "plan", "samples_per_s": plan.best.predicted.samples_per_s,
                              "config": plan.best.config.describe(), "coverage": plan.provenance.get("search_coverage"),
                              "estimated": plan.trials}
            # CPU time of this process alone (a trace worker's is not in it): wall time is the cost.
            cell[name].update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    return cell


def _fmt(side: dict) -> str:
    if side["status"] != "plan":
        return "no plan"
    return f"{side['samples_per_s']:,.3f}/s"


def _cov(side: dict) -> str:
    c = side.get("coverage")
    if not c:
        return "—"
    return (f"{c['estimated']} est. + {c['pruned']} pruned of {c['configurations']}"
            + (" (enumerated)" if c["enumerated"] else f", {c['configurations'] - c['estimated'] - c['pruned']} unasked"))


def render(cells: list[dict], command: str, note: str) -> str:
    lines = ["# The chosen plan against the exhaustive best of its space (fit_big cells, no GPU present)", "",
             f"- command: `{command}`", f"- machine: {_machine()}",
             f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}" + (f"; {note}" if note else ""), "",
             "Chosen: `memplan.search(task, gpu=..., probe_top=0, compile_top=0)`, a search given no trial "
             "budget whose default is benchmarks/fit_big.py's T, in a process with an empty cache; exhaustive: the same search "
             "again with trials above the space's size (it resumes the study and estimates the rest). "
             "Coverage: what the chosen plan's `provenance['search_coverage']` says.", "",
             "| model / seq / target | chosen | chosen configuration | coverage of the chosen search | "
             "chosen wall | exhaustive best | exhaustive extra wall | chosen / best | >= 98% |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for c in cells:
        a, b = c["chosen"], c["exhaustive"]
        if a["status"] == "plan" and b["status"] == "plan":
            ratio = a["samples_per_s"] / b["samples_per_s"]
            good = ratio >= 0.98
        else:
            ratio, good = float("nan"), a["status"] == b["status"]
        ok &= good
        lines.append(f"| {c['model'].upper()} / {c['seq']} / {c['target']} | {_fmt(a)} | {a.get('config', '—')} | "
                     f"{_cov(a)} | {a['wall_s']:.0f} s | {_fmt(b)} | {b['wall_s']:.0f} s | "
                     f"{ratio:.3f} | {'yes' if good else '**no**'} |")
    lines += ["", f"Every cell >= 98% of its exhaustive best: **{'yes' if ok else 'no'}**.", "",
              "## Larger card, same kind: never a slower plan", "",
              "| model / seq | smaller → larger | chosen | exhaustive best | larger not slower |", "|---|---|---|---|---|"]
    by = {(c["model"], c["seq"], c["target"]): c for c in cells}
    mono = True
    for (model, seq, target), c in by.items():
        if target not in CARD_ORDER:
            continue
        for bigger in CARD_ORDER[CARD_ORDER.index(target) + 1:]:
            d = by.get((model, seq, bigger))
            if d is None:
                continue
            pair = []
            for side in ("chosen", "exhaustive"):
                s, t = c[side], d[side]
                if s["status"] != "plan":
                    pair.append((True, "smaller: no plan"))
                elif t["status"] != "plan":
                    pair.append((False, "larger: no plan"))
                else:
                    pair.append((t["samples_per_s"] >= s["samples_per_s"],
                                 f"{s['samples_per_s']:.3f} → {t['samples_per_s']:.3f}"))
            good = all(p[0] for p in pair)
            mono &= good
            lines.append(f"| {model.upper()} / {seq} | {target} → {bigger} | {pair[0][1]} | {pair[1][1]} | "
                         f"{'yes' if good else '**no**'} |")
    lines += ["", f"Larger cards never slower: **{'yes' if mono else 'no'}**.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(GLOBAL_BATCH), choices=list(GLOBAL_BATCH))
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--trials", type=int, default=24, help="the chosen search's trials (fit_big's: 24)")
    ap.add_argument("--enumerate-limit", type=int, default=None, help="ENUMERATE_LIMIT for this run")
    ap.add_argument("--no-long", action="store_true", help="skip the 4096-token row")
    ap.add_argument("--note", default="")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        model, seq, target, trials, limit = json.loads(args.cell)
        print(json.dumps(run_cell(model, seq, target, trials, limit)))
        return
    command = "python benchmarks/search_exhaustive.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    cells: list[dict] = []
    for model in args.models:
        for seq in SEQS + (() if args.no_long else LONG.get(model, ())):
            for target in args.targets:
                print(f"[{time.strftime('%H:%M:%S')}] {model} {seq} {target}", flush=True)
                spec = json.dumps([model, seq, target, args.trials, args.enumerate_limit])
                proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--cell", spec],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], flush=True)
                    continue
                cells.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print("   ", json.dumps(cells[-1]), flush=True)
                out.with_suffix(".json").write_text(json.dumps(cells, indent=1) + "\n")
                out.write_text(render(cells, command, args.note))


if __name__ == "__main__":
    main()
