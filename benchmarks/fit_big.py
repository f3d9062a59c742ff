"""Which Llama 3 models (1B, 3B, 8B) fit which cards, and how long planning takes (no GPU here).

    python benchmarks/fit_big.py --label before --out benchmarks/results/fit_big.md
    python benchmarks/fit_big.py --label after --out benchmarks/results/fit_big.md
    python benchmarks/fit_big.py --label smoke --models 1b --targets RTX-4090 --trials 4 --out /tmp/fit.md

Every cell (model, sequence length, target) is planned with ``memplan.search(gpu=...)`` in a
process of its own, with an empty cache, so that its wall time includes every trace it needs
and nothing an earlier cell left behind. The models are built on the meta device and traced
with fake tensors: no memory of the model's size is touched (the peak RSS of each cell is
recorded to show it).

Results are kept per label in a JSON file next to ``--out`` (``fit_big.json`` for
``fit_big.md``); a run replaces its own label's cells and the markdown is written again from
every label, so a later ``--label after`` run puts its columns next to ``before``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# target name: (gpu, devices per node)
TARGETS = {
    "RTX-4090": ("RTX-4090", 1),
    "A100-40GB": ("A100-40GB", 1),
    "A100-80GB": ("A100-80GB", 1),
    "8xH100": ("H100-80GB", 8),
}
# Sequences per optimizer step, the same on every target so that samples/s compare: 16 x 2048
# tokens is 32k tokens a step (a fine-tuning batch), and 16 splits evenly over 8 ranks.
GLOBAL_BATCH = {"1b": 16, "3b": 16, "8b": 16}
SEQS = (2048,)
LONG = {"1b": (4096,)}  # the extra, longer-sequence row
REFUSAL = ("3b", 2048, "RTX-4090", "2GB")  # model, seq, card, budget


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


# -- one cell, in a child process ----------------------------------------------------------

def run_cell(model: str, seq: int, target: str, trials: int, vram: str | None, host_memory: str | None = None) -> dict:
    import memplan
    from estimators import NoFeasiblePlanError
    from models_large import LLAMA3, llama3_task

    gpu, gpus = TARGETS[target]
    task = llama3_task(model, seq)
    cell: dict = {"model": model, "seq": seq, "target": target, "gpu": gpu, "gpus": gpus, "vram": vram,
                  "global_batch": GLOBAL_BATCH[model], "trials": trials, "reference_params": LLAMA3[model][-1],
                  "load_at_start": os.getloadavg()[0], "host_memory": host_memory}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MEMPLAN_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        try:
            plan = memplan.search(task, gpu=gpu, gpus=gpus, vram=vram, trials=trials,
                                  global_batch=GLOBAL_BATCH[model], progress=False, host_memory=host_memory)
        except NoFeasiblePlanError as exc:
            cell.update(status="none", message=str(exc))
        else:
            best = plan.best
            cell.update(status="plan", samples_per_s=best.predicted.samples_per_s, peak_bytes=best.peak_bytes,
                        budget_bytes=plan.budget_bytes, config=best.config.describe(),
                        config_fields=dataclasses.asdict(best.config), params=best.predicted.params,
                        estimated=plan.trials, feasible=len(plan.entries))
        cell["wall_s"] = time.perf_counter() - t0
    cell["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if "params" not in cell:
        with __import__("torch").device("meta"):
            cell["params"] = sum(p.numel() for p in task.build_model().parameters())
    return cell


# -- the table ---------------------------------------------------------------------------

def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _short(message: str, width: int = 220) -> str:
    first = message.splitlines()[0]
    return first if len(first) <= width else first[: width - 1] + "…"


def _key(cell: dict) -> str:
    return f"{cell['model']}|{cell['seq']}|{cell['target']}|{cell.get('vram') or ''}"


def _row_name(cell: dict) -> str:
    extra = f" at {cell['vram']}" if cell.get("vram") else ""
    return f"{cell['model'].upper()} / {cell['seq']} / {cell['target']}{extra}"


def _verdict(cell: dict | None) -> str:
    if cell is None:
        return "—"
    if cell["status"] == "plan":
        return f"{cell['samples_per_s']:,.2f}/s, {_gb(cell['peak_bytes'])}"
    if cell["status"] == "none":
        return "no plan"
    return f"error ({cell['status']})"


def render(data: dict) -> str:
    labels = list(data["runs"])
    keys: list[str] = []
    for label in labels:
        keys += [k for k in data["runs"][label]["cells"] if k not in keys]
    lines = ["# Fitting Llama 3 models of 1B, 3B and 8B parameters on 24-80 GB cards (no GPU present)", "",
             "Each cell is one `memplan.search(task, gpu=..., gpus=..., global_batch=..., trials=...)` in a process "
             "of its own with an empty cache (wall time includes every trace). Models: "
             "`benchmarks/models_large.py:llama3_task` — the dimensions of Llama 3.2-1B, 3.2-3B (tied embeddings) "
             "and Llama 3-8B (untied), rotary positions, GQA with 8 key/value heads, SwiGLU, built on the meta "
             "device. Global batch: " + ", ".join(f"{m.upper()} {b} sequences" for m, b in GLOBAL_BATCH.items())
             + " (the same on every target). Cell: predicted samples/s and peak (per device) of the best plan, "
             "or *no plan*.", ""]
    header = ["model / seq / target"] + [f"{lab}: best plan" for lab in labels] + [f"{lab}: planning" for lab in labels]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for key in keys:
        cells = [data["runs"][lab]["cells"].get(key) for lab in labels]
        any_cell = next(c for c in cells if c is not None)
        row = [_row_name(any_cell)] + [_verdict(c) for c in cells]
        row += [f"{c['wall_s']:.1f} s" if c else "—" for c in cells]
        lines.append("| " + " | ".join(row) + " |")
    for label in labels:
        run = data["runs"][label]
        lines += ["", f"## {label}", ""] + [f"- command: `{c}`" for c in run["commands"]] + [
                  f"- machine: {run['machine']}",
                  f"- run: {run['started']}; {run['note']}" if run.get("note") else f"- run: {run['started']}", ""]
        lines += ["| model / seq / target | params | trials (estimated, feasible) | chosen configuration | "
                  "predicted samples/s | predicted peak / budget | planning | peak RSS | load at start |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key in keys:
            c = run["cells"].get(key)
            if c is None:
                continue
            params = f"{c['params'] / 1e9:.3f}B (real {c['reference_params']})"
            if c["status"] == "plan":
                row = [f"{c['trials']} ({c['estimated']}, {c['feasible']})", c["config"], f"{c['samples_per_s']:,.2f}",
                       f"{_gb(c['peak_bytes'])} / {_gb(c['budget_bytes'])}"]
            else:
                row = [str(c["trials"]), "**no plan**: " + _short(c.get("message", "")).replace("|", "\\|"), "—", "—"]
            lines.append("| " + " | ".join([_row_name(c), params] + row + [
                f"{c['wall_s']:.1f} s", f"{c['rss_bytes'] / 2**20:,.0f} MiB", f"{c['load_at_start']:.2f}"]) + " |")
    return "\n".join(lines) + "\n"


# -- the driver --------------------------------------------------------------------------

def _cells(models: list[str], targets: list[str], long_rows: bool, refusal: bool) -> list[tuple]:
    # The refusal first: it is quick, and the one figure the issue names.
    out = [REFUSAL] if refusal and REFUSAL[0] in models else []
    for model in models:
        seqs = SEQS + (LONG.get(model, ()) if long_rows else ())
        for seq in seqs:
            out += [(model, seq, target, None) for target in targets]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="column name, e.g. before or after")
    ap.add_argument("--out", required=True, help="markdown file; its .json sibling keeps every label's cells")
    ap.add_argument("--models", nargs="+", default=list(GLOBAL_BATCH), choices=list(GLOBAL_BATCH))
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--trials", type=int, default=24, help="trial budget of each search")
    ap.add_argument("--trials-for", action="append", default=[], metavar="MODEL=N",
                    help="a smaller trial budget for one model (a cell that ran too long)")
    ap.add_argument("--no-long", action="store_true", help="skip the 4096-token row")
    ap.add_argument("--no-refusal", action="store_true", help="skip the 3B-on-2GB refusal")
    ap.add_argument("--note", default="", help="a line about this run for the results file")
    ap.add_argument("--host-memory", default="128GB",
                    help="host RAM each target machine is assumed to have for CPU offload (default 128GB)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.cell:  # child: one cell, its result as JSON on the last line of stdout
        model, seq, target, trials, vram, host = json.loads(args.cell)
        print(json.dumps(run_cell(model, seq, target, trials, vram, host)))
        return

    per_model = {k: int(v) for k, v in (item.split("=", 1) for item in args.trials_for)}
    out = Path(args.out)
    store = out.with_suffix(".json")
    data = json.loads(store.read_text()) if store.exists() else {"runs": {}}
    run = data["runs"].setdefault(args.label, {"cells": {}})
    # A label may be filled by several runs (a capped rerun of one model): each command is kept.
    command = "python benchmarks/fit_big.py " + " ".join(sys.argv[1:])
    run.setdefault("commands", [])
    if command not in run["commands"]:
        run["commands"].append(command)
    run.update(machine=_machine(), started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               note=" ".join(x for x in (run.get("note", ""), args.note) if x))
    cells = _cells(args.models, args.targets, not args.no_long, not args.no_refusal)
    # The longer-sequence row last: the first to give up when time is short.
    cells.sort(key=lambda c: c[1] != SEQS[0])
    for model, seq, target, vram in cells:
        trials = per_model.get(model, args.trials)
        spec = json.dumps([model, seq, target, trials, vram, args.host_memory])
        print(f"[{time.strftime('%H:%M:%S')}] {model} seq {seq} on {target}{' at ' + vram if vram else ''}, "
              f"{trials} trials ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--label", args.label, "--out", args.out, "--cell", spec],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            cell = {"model": model, "seq": seq, "target": target, "vram": vram, "status": f"exit {proc.returncode}",
                    "message": tail[0], "trials": trials, "wall_s": float("nan"), "rss_bytes": 0,
                    "params": 0, "reference_params": "", "load_at_start": float("nan")}
        else:
            cell = json.loads(proc.stdout.strip().splitlines()[-1])
        run["cells"][_key(cell)] = cell
        print(f"    {_verdict(cell)} in {cell['wall_s']:.1f} s"
              + (f": {_short(cell.get('message', ''), 200)}" if cell["status"] != "plan" else f": {cell.get('config')}"),
              flush=True)
        # Written after every cell: an interrupted run keeps what it measured.
        store.write_text(json.dumps(data, indent=1) + "\n")
        out.write_text(render(data))


if __name__ == "__main__":
    main()
