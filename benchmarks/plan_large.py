"""Planning time for large models on cards that are not here (fake tensors only).

    python benchmarks/plan_large.py --size 1b --gpu A100-80GB
    python benchmarks/plan_large.py --size 7b --gpu A100-80GB --gpus 8 --precision bf16 --out benchmarks/results/plan_7b.md

Prints (and with --out writes) the wall time of ``memplan.search`` on a Llama-style model
built on the meta device, the number of configurations estimated and traced, the process's
peak RSS (no real allocation of the model's size may happen), and the ranked plan.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1b", choices=("1b", "7b"))
    ap.add_argument("--gpu", default="A100-80GB")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--precision", action="append", help="restrict precisions (repeatable)")
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--out", help="write the results as markdown here")
    args = ap.parse_args()

    import torch
    from models_large import llama_task

    import memplan
    from estimators.tracing import _trace

    traces = {"n": 0, "s": 0.0}
    original = _trace.trace_step

    def counted(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            traces["n"] += 1
            traces["s"] += time.perf_counter() - t0

    _trace.trace_step = counted
    import estimators.estimator._traces as est_mod
    est_mod.trace_step = counted

    task = llama_task(args.size)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MEMPLAN_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        plan = memplan.search(task, gpu=args.gpu, gpus=args.gpus, nodes=args.nodes, trials=args.trials,
                              precisions=args.precision, global_batch=args.global_batch, progress=False)
        wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from memplan.planning import _inputs
    # Every trace the estimator holds, including those its worker process made (not counted
    # by the wrapper above, which runs in this process only).
    held = sum(len(est._traces._prepared) for est in _inputs._ESTIMATORS.get(task, {}).values())
    lines = [
        f"# Plan for a {args.size.upper()} Llama-style model on {args.gpus} x {args.gpu}"
        + (f" x {args.nodes} nodes" if args.nodes > 1 else ""),
        "",
        "Command: `python benchmarks/plan_large.py " + " ".join(sys.argv[1:]) + "`",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
        f"- parameters: {plan.best.predicted.params:,}",
        f"- search wall time: **{wall:.1f} s** ({plan.trials} configurations estimated from {held} traces: "
        f"{traces['n']} made in this process, taking {traces['s']:.1f} s, the others by the estimator's worker "
        "process meanwhile)",
        f"- process peak RSS: {rss / 2**20:,.0f} MiB (the model's fp32 weights alone would be "
        f"{plan.best.predicted.params * 4 / 2**30:,.1f} GiB)",
        f"- launch: `torchrun --nproc-per-node {plan.launch['nproc_per_node']} --nnodes {plan.launch['nnodes']}`",
        "",
        "```",
        plan.table(limit=12),
        "```",
        "",
        "Per-rank breakdown of the chosen plan at its peak "
        f"({plan.best.predicted.peak_phase}): "
        + ", ".join(f"{k} {memplan.format_size(v)}" for k, v in plan.best.predicted.breakdown.items() if v > 0),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
