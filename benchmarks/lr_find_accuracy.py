"""lr-find's suggestion against the best constant learning rate of a grid.

For each model file: a grid of constant learning rates (10^(k/4), 1e-5 to 1) trains a
fresh model (seed 0, the model file's optimizer with its lr replaced) for ``--steps`` steps of
batch 32; the grid's best is the lr with the lowest mean training loss over the last 20
steps. Then ``memplan.lr_find`` (default rule min/10) and the steepest-descent rule suggest
one each; the report gives both as a ratio to the grid's best.

    python benchmarks/lr_find_accuracy.py [--models a,b] [--steps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from estimators import load_task  # noqa: E402
from memplan.diagnostics._lr_find import lr_find, suggest  # noqa: E402

MODELS = {"mlp": "benchmarks/models/mlp.py", "cnn_bn": "benchmarks/models/cnn_bn.py",
          "digits": "examples/digits.py", "tiny_gpt": "examples/tiny_gpt.py"}


def grid(task, steps: int, b: int = 32) -> dict[float, float]:
    out = {}
    data = task.dataset()
    n = len(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    for k in range(-20, 1):
        lr = 10 ** (k / 4)
        torch.manual_seed(0)
        net = task.build_model().train()
        opt = task.make_optimizer(net)
        for g in opt.param_groups:
            g["lr"] = lr
        losses = []
        for s in range(steps):
            batch = task.collate([data[order[(s * b + i) % n]] for i in range(b)])
            opt.zero_grad(set_to_none=True)
            loss = task.compute_loss(net, batch)
            if not torch.isfinite(loss):
                losses = [math.inf]
                break
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out[lr] = float(np.mean(losses[-20:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="benchmarks/results/lr_find.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        task = load_task(MODELS[name])
        start = time.perf_counter()
        losses = grid(task, args.steps)
        grid_s = time.perf_counter() - start
        best = min(losses, key=losses.get)
        start = time.perf_counter()
        result = lr_find(task, batch_size=32)
        find_s = time.perf_counter() - start
        steep = suggest(result.lrs, result.smoothed, "steepest")[0]
        stated = task.settings.get("lr", "-")
        rows.append(f"| {name} | {type(task.make_optimizer(task.build_model())).__name__} | {stated} | {best:.3g} | "
                    f"{result.suggestion:.3g} ({result.suggestion / best:.2f}x) | {steep:.3g} ({steep / best:.2f}x) | "
                    f"{len(result.lrs)} | {find_s:.1f} s | {grid_s:.0f} s |")
        print(rows[-1], flush=True)
        _write(args, rows)  # after each model: a long run cut short keeps what it measured


def _write(args: argparse.Namespace, rows: list[str]) -> None:
    text = [
        "# lr-find against a grid of constant learning rates", "",
        f"Command: `python benchmarks/lr_find_accuracy.py --models {args.models} --steps {args.steps}` "
        f"(torch {torch.__version__}, {platform.machine()}, 1 thread, shared 2-core machine: times are indicative).", "",
        f"Grid: 21 constant lrs 1e-5..1 (x10^0.25), {args.steps} steps of batch 32 each; best = lowest mean loss "
        "of the last 20 steps. lr-find: 1e-7 to 10 over 100 steps, EMA 0.9, stop at 4x the minimum.", "",
        "| model | optimizer | model file's lr | grid best | lr-find min/10 (ratio) | steepest (ratio) | sweep steps | lr-find time | grid time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, ""]
    Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
