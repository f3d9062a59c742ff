"""OOM recovery: seeded injected OOMs on a small model; recoveries tried/recovered and their cost.

Each run trains a small MLP (6-64-64-2, 40 samples, global batch 8, 2 epochs = 10 optimizer
steps, evaluation every 3 steps) on the CPU under a ``MemoryGuard`` (the tests' ``InjectingGuard``,
tests/helpers/oom.py) armed to raise a real ``torch.OutOfMemoryError`` at a seeded op of a seeded phase (forward, backward, optimizer,
evaluation), once or twice. The trainer steps down the ladder (micro-batch 8 -> 4x2 -> 2x4 ->
1x8) and replays the step. A run counts as recovered when it ends with as many optimizer steps
as an uninterrupted run and final weights within 1e-5 of it.

    python benchmarks/recovery.py --runs 20 --out benchmarks/results/recovery.md
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' OOM injector

from helpers.oom import InjectingGuard  # noqa: E402

from estimators import Task, TrainConfig  # noqa: E402
from estimators.runtime._guard import MemoryGuard  # noqa: E402
from memplan.training import TrainOptions, train  # noqa: E402
from memplan.training._checkpoint_io import load_checkpoint  # noqa: E402

BIG = TrainConfig(micro_batch_size=8)
LADDER = [TrainConfig(micro_batch_size=4, grad_accum_steps=2), TrainConfig(micro_batch_size=2, grad_accum_steps=4),
          TrainConfig(micro_batch_size=1, grad_accum_steps=8)]
PHASES = ("forward", "backward", "optimizer", "evaluation")
_TASKS: list[Task] = []


def task() -> Task:
    g = torch.Generator().manual_seed(1)
    x, xv = torch.randn(40, 6, generator=g), torch.randn(12, 6, generator=g)
    y, yv = (x[:, 0] - x[:, 2] > 0).long(), (xv[:, 0] - xv[:, 2] > 0).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    t = Task(name="mlp", build_model=build, train_data=lambda: TensorDataset(x, y),
             val_data=lambda: TensorDataset(xv, yv), settings={"lr": 0.01})
    _TASKS.append(t)
    return t


def options(out: Path) -> TrainOptions:
    return TrainOptions(out_dir=out, epochs=2, eval_every=3, progress=False, num_workers=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="memplan-recovery-"))

    logging.getLogger("memplan.trainer").setLevel(logging.ERROR)
    train(task(), BIG, options(tmp / "warm-up"), memory_guard=MemoryGuard(10**12))
    t0 = time.perf_counter()
    ref = train(task(), BIG, options(tmp / "ref"), memory_guard=MemoryGuard(10**12))
    ref_wall = time.perf_counter() - t0
    ref_state = load_checkpoint(tmp / "ref" / "checkpoint.pt")["model"]
    t0 = time.perf_counter()  # the same run with a ladder and no OOM: the cost of the undo copies
    train(task(), BIG, options(tmp / "ref-ladder"), memory_guard=MemoryGuard(10**12), ladder=LADDER)
    ladder_wall = time.perf_counter() - t0

    tried = recovered_events = runs_ok = 0
    seconds: list[float] = []
    walls: list[float] = []
    by_phase: dict[str, int] = {p: 0 for p in PHASES}
    for seed in range(args.runs):
        rng = random.Random(seed)
        phase, times = rng.choice(PHASES), rng.choice((1, 1, 2))
        guard = InjectingGuard(10**12)
        guard.inject(after_ops=rng.randint(1, 60), phase=phase, times=times)
        t0 = time.perf_counter()
        result = train(task(), BIG, options(tmp / f"s{seed}"), memory_guard=guard, ladder=LADDER)
        walls.append(time.perf_counter() - t0)
        events = result.summary["recoveries"]
        tried += guard.injected
        recovered_events += len(events)
        by_phase[phase] += len(events)
        seconds += [e["seconds"] for e in events]
        state = load_checkpoint(tmp / f"s{seed}" / "checkpoint.pt")["model"]
        same = all(torch.allclose(v, ref_state[k], atol=1e-5, rtol=0) for k, v in state.items())
        runs_ok += int(result.steps == ref.steps and same)

    gc_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect()
        gc_times.append(time.perf_counter() - t0)
    gc_s = statistics.median(gc_times)
    lines = [
        "# OOM recovery (injected OOMs, CPU)",
        "",
        f"Command: `python benchmarks/recovery.py --runs {args.runs}{' --out ' + str(args.out) if args.out else ''}`  ",
        f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        "Small MLP (6-64-64-2), 10 optimizer steps, global batch 8, ladder 8x1 -> 4x2 -> 2x4 -> 1x8.",
        "",
        f"- runs: {args.runs}; OOMs injected: {tried}; recovered: {recovered_events} "
        f"(by phase: {', '.join(f'{p} {n}' for p, n in by_phase.items())})",
        f"- runs ending with the uninterrupted run's step count and weights (atol 1e-5): {runs_ok}/{args.runs}",
        f"- time per recovery (free memory, restore, switch config; the replay itself not included): "
        f"median {statistics.median(seconds) * 1e3:.2f} ms, max {max(seconds) * 1e3:.2f} ms" if seconds else "- no recoveries",
        f"- wall time per run: median {statistics.median(walls):.2f} s with injected OOMs (recovery + replay); "
        f"{ref_wall:.2f} s without a ladder and {ladder_wall:.2f} s with a ladder but no OOM (a ladder adds a "
        "per-step undo copy of parameters, optimizer state and buffers in host memory, for replays)",
        f"- one full `gc.collect()` in this process takes {gc_s * 1e3:.0f} ms (median of 5) and is most of a "
        "recovery's time here (2 shared, loaded cores)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
