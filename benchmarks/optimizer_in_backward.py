"""The optimizer step in backward (``TrainConfig.optimizer_in_backward``): memory and loss (CPU).

Part 1, memory: per model and micro-batch, the estimate (``Estimator(task).estimate``) and
the real CPU peak (``measure_cpu_peak``, the estimator benchmark's truth) of the plain step
and of the step in backward, fp32, clipping off.

Part 2, training: ``--train-steps`` optimizer steps of examples/digits.py (AdamW, its lr and
weight decay, constant lr, batch 64, no accumulation, clipping off) through the runtime's
``train_step``, once plain and once with the step in backward, on the same shuffled batches
from the same initial weights; the losses of every step, the final weights and the validation
accuracy are compared.

    python benchmarks/optimizer_in_backward.py [--models ...] [--batches 4,32] [--train-steps 220]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, format_size, load_task  # noqa: E402
from estimators._step_options import StepOptions  # noqa: E402
from estimators.probing._measure import measure_cpu_peak  # noqa: E402
from estimators.runtime._build import build_for_training  # noqa: E402
from estimators.runtime._step import make_step_parts, train_step  # noqa: E402

NO_CLIP = StepOptions(clip="off")


def memory_rows(path: str, batches: list[int]) -> list[str]:
    task = load_task(str(ROOT / path)).with_step(NO_CLIP)
    rows = []
    for b in batches:
        figures = []
        for in_bwd in (False, True):
            config = TrainConfig(micro_batch_size=b, optimizer_in_backward=in_bwd)
            est = Estimator(task, device="cpu").estimate(config).peak_allocated_bytes
            real = measure_cpu_peak(task, config).peak_bytes
            figures.append((est, real))
        (pe, pr), (be, br) = figures
        rows.append(f"| {Path(path).name} | {b} | {format_size(pe)} | {format_size(pr)} | {(pe - pr) / pr:+.3%} "
                    f"| {format_size(be)} | {format_size(br)} | {(be - br) / br:+.3%} | {(br - pr) / pr:+.1%} |")
        print(rows[-1], flush=True)
    return rows


def train(in_bwd: bool, steps: int) -> tuple[list[float], dict[str, torch.Tensor], float]:
    task = load_task(str(ROOT / "examples/digits.py")).with_step(NO_CLIP)
    config = TrainConfig(micro_batch_size=64, optimizer_in_backward=in_bwd)
    torch.manual_seed(0)
    built = build_for_training(task, config, "cpu")
    parts = make_step_parts(task, config, built.model, built.wrapped, device=torch.device("cpu"), options=NO_CLIP)
    loader = torch.utils.data.DataLoader(task.dataset(), batch_size=64, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            result = train_step(parts, iter([batch]), [1.0], step=len(losses) + 1)
            losses.append(float(result.loss_sum))
            if len(losses) == steps:
                break
    built.model.eval()
    xs, ys = zip(*[task.val_data()[i] for i in range(len(task.val_data()))])
    with torch.no_grad():
        accuracy = float((built.model(torch.stack(xs)).argmax(1) == torch.tensor(ys)).float().mean())
    return losses, {k: v.detach().clone() for k, v in built.model.state_dict().items()}, accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="examples/digits.py,benchmarks/models/mlp.py,benchmarks/models/gpt_tied.py")
    ap.add_argument("--batches", default="4,32")
    ap.add_argument("--train-steps", type=int, default=220)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | micro-batch | plain: estimate | plain: measured | error | in backward: estimate "
          "| in backward: measured | error | in backward vs plain (measured) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.models.split(","):
        memory_rows(path, [int(b) for b in args.batches.split(",")])
    plain_losses, plain_w, plain_acc = train(False, args.train_steps)
    bwd_losses, bwd_w, bwd_acc = train(True, args.train_steps)
    loss_diff = max(abs(a - b) for a, b in zip(plain_losses, bwd_losses))
    w_diff = max(float((plain_w[k].float() - bwd_w[k].float()).abs().max()) for k in plain_w)
    print(f"\ndigits.py, {args.train_steps} steps: final loss plain {plain_losses[-1]:.6f}, in backward "
          f"{bwd_losses[-1]:.6f}; largest per-step loss difference {loss_diff:.3g}; largest weight difference "
          f"{w_diff:.3g}; validation accuracy plain {plain_acc:.4f}, in backward {bwd_acc:.4f}")


if __name__ == "__main__":
    main()
