"""Planning time of large models with the block stack composed from cut traces, against tracing it whole.

    python benchmarks/plan_speed.py --out benchmarks/results/plan_speed.md
    python benchmarks/plan_speed.py --rounds 1 --base /tmp/base   # also the code before composition

Three measurements, each in a process of its own with an empty cache folder (no trace, study or
CPU rate carried over), run in rounds that alternate the variants so that a busy machine slows
each about alike:

* one estimate of Llama 3-8B (bf16-mixed, micro-batch 1, on an H100-80GB), in a process that
  has imported memplan and made one trace of another model first (the imports and torch's first
  dispatch are a process's, not an estimate's);
* ``memplan plan`` of Llama 3-8B for 8 x H100-80GB;
* ``memplan plan`` of Llama 3.2-3B for one RTX-4090 (``--vram 24GB --host-memory 64GB``).

Variants: ``composed`` (the default), ``whole`` (``MEMPLAN_FULL_TRACE=1``: every configuration
traced whole, with the same code otherwise) and, with ``--base TREE``, ``base``: a checkout of the
code before composition (``git worktree add TREE <commit>``). The models are
``benchmarks/models_large.py``'s ``llama3_task`` (2048 tokens, global batch 16), written to model
files in a temporary folder. Each variant's plan is checked to be the same plan (configuration and
predicted peak) as the others'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MODEL_FILE = '''\
"""Llama {name} (benchmarks/models_large.py's llama3_task), 2048 tokens, global batch 16."""
import sys
sys.path.insert(0, {benchmarks!r})
from models_large import llama3_task

_task = llama3_task({name!r}, 2048)
model = _task.build_model
train_data = _task.train_data
checkpoint_blocks = _task.checkpoint_blocks
settings = {{"global_batch": 16}}
'''

CELLS = {
    "estimate-8b": "one estimate, Llama 3-8B, H100-80GB",
    "plan-8b-8xH100": "memplan plan, Llama 3-8B, 8 x H100-80GB",
    "plan-3b-RTX-4090": "memplan plan, Llama 3.2-3B, RTX-4090 24GB, 64GB host",
}
GOALS_S = {"estimate-8b": 1.0, "plan-8b-8xH100": 10.0, "plan-3b-RTX-4090": 20.0}
"""The planning-time goals (seconds, composed, on a 2-core machine)."""


def _plan_args(cell: str, folder: Path) -> list[str]:
    if cell == "plan-8b-8xH100":
        return [str(folder / "llama8b.py"), "--gpu", "H100-80GB", "--gpus", "8"]
    return [str(folder / "llama3b.py"), "--gpu", "RTX-4090", "--vram", "24GB", "--host-memory", "64GB"]


def _child(cell: str, folder: str) -> None:
    """One measurement, in this (fresh) process; prints a JSON line."""
    if cell == "estimate-8b":
        sys.path.insert(0, str(HERE))
        from models_large import llama3_task

        from estimators import Estimator, TrainConfig

        # Warm: imports, the fake mode and torch's first dispatch of each op belong to the
        # process, not to an estimate; a small model's trace pays them.
        Estimator(llama3_task("1b", 128), gpu="H100-80GB").estimate(TrainConfig(micro_batch_size=1), exact=True)
        task = llama3_task("8b", 2048)
        config = TrainConfig(micro_batch_size=1, precision="bf16-mixed")
        start = time.perf_counter()
        est = Estimator(task, gpu="H100-80GB").estimate(config, exact=True)
        wall = time.perf_counter() - start
        print(json.dumps({"wall_s": wall, "peak": est.peak_bytes, "allocated": est.peak_allocated_bytes,
                          "step_time_s": est.step_time_s, "notes": [n for n in est.notes if "block stack" in n]}))
        return
    from memplan.cli import main

    out = Path(folder) / f"{cell}.json"
    start = time.perf_counter()
    code = main(["plan", *_plan_args(cell, Path(folder)), "--no-progress", "--out", str(out)])
    wall = time.perf_counter() - start
    plan = json.loads(out.read_text()) if out.exists() else {}
    best = (plan.get("entries") or [{}])[0]
    print(json.dumps({"wall_s": wall, "code": code, "config": best.get("config"),
                      "peak": (best.get("predicted") or {}).get("peak_reserved_bytes")}))


def _run(cell: str, variant: str, base: str | None, models: Path) -> dict:
    env = dict(os.environ)
    tree = str(ROOT)
    env.pop("MEMPLAN_FULL_TRACE", None)
    if variant == "whole":
        env["MEMPLAN_FULL_TRACE"] = "1"
    elif variant == "base":
        assert base is not None
        tree = base
    env["PYTHONPATH"] = tree
    with tempfile.TemporaryDirectory() as cache:
        env["MEMPLAN_CACHE_DIR"] = cache
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, str(HERE / "plan_speed.py"), "--child", cell, str(models)],
                              cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{cell} ({variant}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["load"] = load
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every cell and variant, alternated")
    ap.add_argument("--base", help="a checkout of the code before composition, measured as variant 'base'")
    ap.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--variants", nargs="*", default=["whole", "composed"], choices=["whole", "composed"],
                    help="the variants besides base (default both)")
    ap.add_argument("--out", help="write the results as markdown here")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(Path.cwd()))
        _child(*args.child)
        return

    variants = list(args.variants) + (["base"] if args.base else [])
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        models = Path(folder)
        for name in ("3b", "8b"):
            (models / f"llama{name}.py").write_text(MODEL_FILE.format(name=name, benchmarks=str(HERE)))
        for r in range(args.rounds):
            # Alternate which variant goes first from round to round.
            order = variants if r % 2 == 0 else variants[::-1]
            for cell in args.cells:
                for variant in order:
                    got = _run(cell, variant, args.base, models)
                    results.setdefault((cell, variant), []).append(got)
                    print(f"round {r + 1} {cell:18s} {variant:9s} {got['wall_s']:7.1f} s  load {got['load']:.2f}",
                          flush=True)
    text = _render(args, variants, results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _s(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"


def _render(args: argparse.Namespace, variants: list[str], results: dict[tuple[str, str], list[dict]]) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    command = "python benchmarks/plan_speed.py " + " ".join(
        a for a in sys.argv[1:]) if len(sys.argv) > 1 else "python benchmarks/plan_speed.py"
    lines = [
        "# Planning large models: the block stack composed from cut traces, against tracing it whole",
        "",
        f"Command: `{command}`",
        "",
        f"- machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}",
        f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} round(s), each cell and "
        "variant in a fresh process with an empty cache folder, the variants alternated round by round",
        "- the CPU is shared with other jobs: the load average at each start is in the last column, and wall "
        "times on a busy machine are upper bounds; the ratios compare runs made side by side",
        "- variants: `composed` (default), `whole` (`MEMPLAN_FULL_TRACE=1`, the same code tracing every "
        "configuration whole)" + (", `base` (the code before composition)" if "base" in variants else ""),
        "",
        "| measurement | " + " | ".join(f"{v} (median s)" for v in variants)
        + " | whole / composed" + (" | base / composed" if "base" in variants else "")
        + " | goal (composed) | same plan | load |",
        "|---" * (len(variants) + 5 + ("base" in variants)) + "|",
    ]
    for cell in args.cells:
        med = {v: statistics.median(r["wall_s"] for r in results[(cell, v)]) for v in variants}
        runs = {v: ", ".join(_s(r["wall_s"]) for r in results[(cell, v)]) for v in variants}
        keys = {v: [(r.get("config"), r.get("peak")) for r in results[(cell, v)]] for v in variants}
        same = all(k == next(iter(keys.values())) for k in keys.values())
        loads = [r["load"] for v in variants for r in results[(cell, v)]]
        row = [CELLS[cell]] + [f"{_s(med[v])} ({runs[v]})" for v in variants]
        if "whole" in med and "composed" in med:
            row.append(f"**{med['whole'] / med['composed']:.1f}x**")
        else:
            row.append("")
        if "base" in variants:
            row.append(f"**{med['base'] / med['composed']:.1f}x**" if "composed" in med else "")
        if "composed" in med:
            goal = GOALS_S[cell]
            row.append(f"<= {goal:g} s: {'met' if med['composed'] <= goal else '**not met**'}")
        else:
            row.append("")
        row += ["yes" if same else "**no**", f"{min(loads):.1f}-{max(loads):.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    estimate = results.get(("estimate-8b", "composed"))
    if estimate:
        lines += ["", "The 8B estimate's notes: " + "; ".join(estimate[0].get("notes", []))]
    lines += ["", textwrap.dedent("""\
        Plans: `memplan plan` with its defaults (60 trials, probes skipped without a GPU), the global batch
        of 16 from the model files' settings; "same plan" compares the best configuration and its predicted
        peak between the variants.""").replace("\n", " ")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
