"""Selective activation checkpointing against none and full: estimate and CPU truth.

Per model and precision, four configurations of one micro-batch: no checkpointing, every
block of the block stack checkpointed with ``checkpoint_policy="selective"`` (matmul and
attention outputs kept), half the blocks selective, and every block fully checkpointed. For
each: the estimator's peak, ``measure_cpu_peak``'s peak (the estimator benchmark's truth),
their difference, and the predicted step time on the CPU and on an A100-80GB (fake-tensor
trace with CUDA semantics; no GPU needed). It prints a Markdown table.

    python benchmarks/selective_checkpoint.py [--models benchmarks/models/gpt_tied.py,...] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.probing._measure import measure_cpu_peak  # noqa: E402
from estimators.runtime._checkpoint import max_checkpoint_segments  # noqa: E402

MODELS = "benchmarks/models/gpt_tied.py,examples/tiny_gpt.py,benchmarks/models/vit.py"


def _configs(batch: int, precision: str, blocks: int) -> list[TrainConfig]:
    plan = [(0, "full"), (max(blocks // 2, 1), "selective"), (blocks, "selective"), (blocks, "full")]
    return [TrainConfig(micro_batch_size=batch, precision=precision, checkpoint_segments=s,  # type: ignore[arg-type]
                        checkpoint_policy=p) for s, p in plan]  # type: ignore[arg-type]


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | precision | checkpointing | estimate MiB | measured MiB | error | "
          "CPU step ms (pred.) | A100 peak MiB | A100 step ms (pred.) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for path in args.models.split(","):
        task = load_task(ROOT / path)
        blocks = max_checkpoint_segments(task.build_model(), task.checkpoint_blocks)
        cpu, gpu = Estimator(task, device="cpu"), Estimator(task, gpu="A100-80GB")
        for precision in args.precisions.split(","):
            for config in _configs(args.batch, precision, blocks):
                est = cpu.estimate(config)
                ref = measure_cpu_peak(task, config).peak_bytes
                cuda = gpu.estimate(config)
                what = ("none" if not config.checkpoint_segments else
                        f"{config.checkpoint_segments}/{blocks} {config.checkpoint_policy}")
                print(f"| {Path(path).stem} | {precision} | {what} | {_mb(est.peak_allocated_bytes)} | {_mb(ref)} | "
                      f"{(est.peak_allocated_bytes - ref) / ref:+.2%} | {1e3 * (est.step_time_s or 0):.1f} | "
                      f"{_mb(cuda.peak_allocated_bytes)} | {1e3 * (cuda.step_time_s or 0):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
