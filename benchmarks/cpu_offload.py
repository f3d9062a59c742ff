"""FSDP2's CPU offload: the estimate against real offloaded ranks on CPU, and what it predicts
for cards that are not here.

Part 1 (truth on CPU): per model, FSDP2 at world size 1 and 2 with ``cpu_offload=True`` (fp32,
and bf16-mixed with accumulation and checkpointing), each rank's real peak (gloo processes,
``measure_distributed_peaks``, the distributed estimator test's truth) against the estimate. On
a CPU host and device are one memory: the offloaded step is FSDP2's with the offload policy's
code paths, and so is its estimate.

Part 2 (GPU targets, no GPU needed): Llama 3 models planned per configuration with and without
offload on one card: device peak, host memory and step time predicted.

    python benchmarks/cpu_offload.py [--models benchmarks/models/gpt_tied.py,...] [--no-llama]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = "benchmarks/models/gpt_tied.py,examples/tiny_gpt.py"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def truth(models: list[str], batch: int) -> None:
    from estimators import Estimator, TrainConfig, load_task
    from estimators.probing._measure import measure_distributed_peaks

    print("| model | configuration | rank | estimate MiB | measured MiB | error |")
    print("|---|---|---:|---:|---:|---:|")
    for path in models:
        task = load_task(ROOT / path)
        estimator = Estimator(task, device="cpu")
        for world in (1, 2):
            configs = [TrainConfig(micro_batch_size=batch, strategy="fsdp", world_size=world, cpu_offload=True),
                       TrainConfig(micro_batch_size=batch, strategy="fsdp", world_size=world, cpu_offload=True,
                                   precision="bf16-mixed", grad_accum_steps=2, checkpoint_segments=2)]
            measured = measure_distributed_peaks(str(ROOT / path), configs)
            for config, ranks in zip(configs, measured):
                est = estimator.estimate(config, exact=True).peak_allocated_bytes
                for rank, m in enumerate(ranks):
                    err = (est - m.peak_bytes) / m.peak_bytes * 100
                    print(f"| {Path(path).stem} | {config.describe()} | {rank} | {_mb(est)} | {_mb(m.peak_bytes)} "
                          f"| {err:+.2f}% |")


def llama(names: list[str], seq: int, gpu: str) -> None:
    import torch

    from estimators import Estimator, TrainConfig
    from estimators.runtime._checkpoint import max_checkpoint_segments
    from models_large import llama3_task

    print(f"\n| model | configuration on one {gpu} | device peak GB (context incl.) | host GB | step s | samples/s "
          "| trace |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        task = llama3_task(name, seq)
        estimator = Estimator(task, gpu=gpu)
        with torch.device("meta"):
            blocks = max_checkpoint_segments(task.build_model(), task.checkpoint_blocks)
        # Every block checkpointed: the activations at their least, so that the states show.
        base = dict(micro_batch_size=1, grad_accum_steps=16, checkpoint_segments=blocks)
        configs = []
        for precision in ("bf16-mixed", "bf16-true"):
            configs.append(TrainConfig(precision=precision, **base))
            configs.append(TrainConfig(precision=precision, strategy="fsdp", cpu_offload=True, **base))
        for config in configs:
            t0 = time.perf_counter()
            est = estimator.estimate(config, exact=True)
            print(f"| {name} / {seq} | {config.describe()} | {_gb(est.peak_bytes + est.context_bytes)} | "
                  f"{_gb(est.host_bytes)} | {est.step_time_s:.2f} | {est.samples_per_s:.2f} | "
                  f"{time.perf_counter() - t0:.0f} s |", flush=True)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--llama", default="1b,3b", help="Llama 3 sizes for part 2 (empty: skip)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gpu", default="RTX-4090")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    truth(args.models.split(","), args.batch)
    if args.llama:
        llama(args.llama.split(","), args.seq, args.gpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
