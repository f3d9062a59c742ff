"""Pure low precision (``bf16-true``) against bf16-mixed and fp32: memory and loss.

    python benchmarks/bf16_true.py --out benchmarks/results/bf16_true.md

Three parts:

* *CPU*: for each model, the estimate (``Estimator(task, device="cpu").estimate(config,
  exact=True)``) and the CPU allocator's real peak (``measure_cpu_peak``, the estimator
  benchmark's truth) of fp32, bf16-mixed and bf16-true at one micro-batch size.
* *CUDA targets* (no GPU here): the predicted peak of Llama 3 models on cards they are
  planned for (``benchmarks/models_large.py``), bf16-mixed against bf16-true, every block
  checkpointed, a micro-batch of one.
* *Loss*: 100 AdamW steps (lr 3e-3, micro-batch 32) of an MLP with batch norm learning a
  random linear teacher (the model of ``tests/estimators/runtime/test_bf16_true.py``) through the estimators'
  own step loop (``PlannedSteps``): the first loss and the mean of the last 10.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.probing._measure import measure_cpu_peak  # noqa: E402
from estimators.runtime._build import build_for_training  # noqa: E402
from estimators.runtime._planned import PlannedSteps  # noqa: E402

PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")
CPU_MODELS = [  # path, config (precision replaced)
    ("examples/digits.py", TrainConfig(micro_batch_size=16)),
    ("benchmarks/models/gpt_tied.py", TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=2)),
    ("benchmarks/models/mlp.py", TrainConfig(micro_batch_size=32)),
    ("benchmarks/models/cnn_bn.py", TrainConfig(micro_batch_size=8)),
    ("benchmarks/models/vit.py", TrainConfig(micro_batch_size=8)),
]
CUDA_ROWS = [("1b", "RTX-4090"), ("3b", "A100-40GB"), ("8b", "A100-80GB")]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def cpu_rows() -> list[str]:
    lines = ["| model | config | precision | estimate MiB | measured MiB | error | vs bf16-mixed (measured) |",
             "|---|---|---|---|---|---|---|"]
    for path, base in CPU_MODELS:
        task = load_task(str(HERE.parent / path))
        est = Estimator(task, device="cpu")
        measured: dict[str, int] = {}
        for prec in PRECISIONS:
            c = base.replace(precision=prec)
            try:
                e = est.estimate(c, exact=True).peak_bytes
                m = measure_cpu_peak(task, c).peak_bytes
            except Exception as exc:  # noqa: BLE001 - a row says why it could not run
                lines.append(f"| {Path(path).stem} | {base.describe()} | {prec} | – | – | – | {str(exc)[:80]} |")
                continue
            measured[prec] = m
            ratio = f"{m / measured['bf16-mixed']:.3f}x" if prec == "bf16-true" and "bf16-mixed" in measured else ""
            lines.append(f"| {Path(path).stem} | {base.replace(precision='fp32').describe().replace(', fp32', '')} "
                         f"| {prec} | {_mib(e)} | {_mib(m)} | {(e - m) / m:+.3%} | {ratio} |")
    return lines


def cuda_rows() -> list[str]:
    from models_large import LLAMA3, llama3_task

    lines = ["| model / card | bf16-mixed peak GB | bf16-true peak GB | card GB | breakdown (bf16-true) | trace s |",
             "|---|---|---|---|---|---|"]
    for size, gpu in CUDA_ROWS:
        task = llama3_task(size, 2048)
        est = Estimator(task, gpu=gpu)
        peaks = {}
        t0 = time.perf_counter()
        for prec in ("bf16-mixed", "bf16-true"):
            c = TrainConfig(micro_batch_size=1, precision=prec, checkpoint_segments=LLAMA3[size][0])
            peaks[prec] = est.estimate(c, exact=True)
        seconds = time.perf_counter() - t0
        low = peaks["bf16-true"]
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(low.breakdown.items(), key=lambda kv: -kv[1]) if v > 0)
        lines.append(f"| {size.upper()} / {gpu} | {peaks['bf16-mixed'].peak_bytes / 1e9:.2f} | {low.peak_bytes / 1e9:.2f} "
                     f"| {est.spec.memory_bytes / 1e9:.1f} | {parts} | {seconds:.0f} |")
    return lines


def loss_rows(steps: int = 100) -> list[str]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.models import teacher_task

    task = teacher_task()
    lines = ["| precision | first loss | mean of last 10 | vs fp32 |", "|---|---|---|---|"]
    ref = None
    for prec in PRECISIONS:
        config = TrainConfig(micro_batch_size=32, precision=prec)
        run = PlannedSteps(task, config, build_for_training(task, config, "cpu"))
        losses = [float(run(i).loss_sum) for i in range(steps)]
        end = sum(losses[-10:]) / 10
        ref = end if ref is None else ref
        lines.append(f"| {prec} | {losses[0]:.4f} | {end:.4f} | {(end - ref) / ref:+.2%} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-cuda", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [f"# bf16-true against bf16-mixed and fp32 ({started})", "",
           f"Command: `python benchmarks/bf16_true.py{' --skip-cuda' if args.skip_cuda else ''}"
           f"{' --out ' + args.out if args.out else ''}` (torch {torch.__version__}, {platform.machine()}, "
           "one intra-op thread, no GPU).", "",
           "## CPU: estimate against the allocator's real peak", "", *cpu_rows(), ""]
    if not args.skip_cuda:
        out += ["## CUDA targets (predicted; micro-batch 1, every block checkpointed, seq 2048)", "",
                *cuda_rows(), ""]
    out += ["## Loss after 100 steps (teacher MLP with batch norm, AdamW 3e-3)", "", *loss_rows(), ""]
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
