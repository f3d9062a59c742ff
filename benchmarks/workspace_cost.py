"""Cost of measuring kernel workspaces on the CPU estimate path, against a baseline tree.

Per model file (``benchmarks/models/*.py`` and ``examples/{digits,tiny_gpt}.py``), in one
process per tree and model, with one intra-op thread:

* *fit*: ``measure_fit(task, config)`` for fp32 and bf16-mixed (the real, profiled runs at
  ``WORKSPACE_ANCHORS``), the median of ``--repeat`` calls;
* *check*: ``borrow_holds`` for bf16-mixed with every block checkpointed (the one small real
  run that confirms a borrowed fit), where the tree has it;
* *first estimate*: a fresh ``Estimator(task, device="cpu").estimate(config)`` of bf16-mixed,
  every block checkpointed, micro-batch 16 (anchors traced, fit measured and, where the tree
  does it, checked), the median of ``--repeat`` fresh estimators.

    python benchmarks/workspace_cost.py [--baseline DIR] [--models a,b] [--repeat 3] [--out FILE]

``--baseline DIR`` runs the same measurements with DIR (a checkout of other code, e.g.
``git archive main | tar -x -C DIR``) first on ``sys.path`` and reports both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = [*sorted((ROOT / "benchmarks" / "models").glob("*.py")),
          ROOT / "examples" / "digits.py", ROOT / "examples" / "tiny_gpt.py"]


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_one(path: str, repeat: int) -> dict:
    """Runs in the subprocess: the timings of one model with the tree on ``sys.path``."""
    import torch
    from estimators import Estimator, TrainConfig, load_task
    from estimators.memory import _workspace
    from estimators.runtime._checkpoint import max_checkpoint_segments

    torch.set_num_threads(1)
    task = load_task(path)
    # The process's first profiled run pays the profiler's start-up: not the fit's cost.
    _workspace.measure_fit(task, TrainConfig(micro_batch_size=2))
    segments = max_checkpoint_segments(task.build_model(), task.checkpoint_blocks)
    out: dict = {"model": Path(path).stem, "anchors": list(_workspace.WORKSPACE_ANCHORS)}
    for precision in ("fp32", "bf16-mixed"):
        config = TrainConfig(micro_batch_size=2, precision=precision)
        out[f"fit {precision}"] = _median_s(lambda: _workspace.measure_fit(task, config), repeat)
    config = TrainConfig(micro_batch_size=16, precision="bf16-mixed", checkpoint_segments=segments)
    if segments and hasattr(_workspace, "borrow_holds"):
        fit = _workspace.measure_fit(task, config.replace(checkpoint_segments=0))
        out["check"] = _median_s(lambda: _workspace.borrow_holds(task, config, fit), repeat) if fit else None
    out["first estimate"] = _median_s(lambda: Estimator(task, device="cpu").estimate(config), repeat)
    return out


def run_model(tree: Path, model: Path, repeat: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print(f"{tree}: {model.stem}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, __file__, "--one", str(model), "--repeat", str(repeat)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tree)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"model": model.stem, "error": proc.stderr[-300:]}


def run_trees(trees: list[Path], models: list[Path], repeat: int) -> list[list[dict]]:
    """Per tree, per model: the trees take turns model by model, in alternating order, so
    that a change in the machine's load hits both alike."""
    rows: list[list[dict]] = [[] for _ in trees]
    for k, model in enumerate(models):
        order = list(range(len(trees)))[::(-1) ** k]
        for t in order:
            rows[t].append(run_model(trees[t], model, repeat))
    return rows


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def report(rows: list[dict], base: list[dict] | None, args: argparse.Namespace) -> str:
    load = os.getloadavg()[0]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "(unset: the CPU's best)")
    lines = [
        "# Kernel-workspace measurement: its cost on the CPU estimate path",
        "",
        f"- Command: `python benchmarks/workspace_cost.py {' '.join(sys.argv[1:])}`",
        f"- Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"ONEDNN_MAX_CPU_ISA={isa}, "
        f"1-minute load average {load:.1f} at the end",
        f"- Medians of {args.repeat} calls, one intra-op thread, after one untimed fit; the trees take turns model by model; see the script's docstring.",
        "",
        "| model | fit fp32 | fit bf16 | check (bf16, all blocks) | first estimate (bf16, all blocks, b16) |"
        + (" baseline fit fp32 | baseline fit bf16 | baseline first estimate |" if base else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if base else ""),
    ]
    for k, row in enumerate(rows):
        if "error" in row:
            lines.append(f"| {row['model']} | error: {row['error'].splitlines()[-1] if row['error'] else '?'} |")
            continue
        line = (f"| {row['model']} | {_ms(row['fit fp32'])} | {_ms(row['fit bf16-mixed'])} | "
                f"{_ms(row.get('check'))} | {_ms(row['first estimate'])} |")
        if base:
            b = base[k]
            line += (f" {_ms(b.get('fit fp32'))} | {_ms(b.get('fit bf16-mixed'))} | {_ms(b.get('first estimate'))} |"
                     if "error" not in b else " error | | |")
        lines.append(line)
    if rows and "anchors" in rows[0]:
        lines.append("")
        lines.append(f"Anchors: {rows[0]['anchors']}" + (f"; baseline {base[0].get('anchors')}" if base else ""))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a tree of other code to measure the same way")
    ap.add_argument("--models", help="comma-separated model names (file stems)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="Markdown report to write (else stdout)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.repeat)))
        return
    models = [m for m in MODELS if not args.models or m.stem in args.models.split(",")]
    trees = [ROOT] + ([Path(args.baseline).resolve()] if args.baseline else [])
    results = run_trees(trees, models, args.repeat)
    rows, base = results[0], (results[1] if args.baseline else None)
    text = report(rows, base, args)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
