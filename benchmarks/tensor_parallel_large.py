"""Large plans with tensor parallelism: Llama 3.1 70B and 405B and 8B at 32k tokens, planned for
H100s that are not here (fake tensors only), beside torchtitan's published layouts.

    python benchmarks/tensor_parallel_large.py [--only NAME] [--out benchmarks/results/tensor_parallel_large.md]

Two kinds of rows:

* ``plan``: ``memplan.search`` for the machine and global batch, timed (the goal: within 2
  minutes), with the layout it chose;
* ``estimate``: the per-rank estimate of torchtitan's published 2-D layout (Llama 3.1 70B,
  FSDP 32 x TP 8 on 256 H100s, local batch 16 of 8192 tokens, full activation checkpointing,
  71.9 GiB published with sequence parallelism, Float8 and torch.compile), set beside
  Megatron-LM's per-rank formula for what full checkpointing keeps: each layer's input,
  ``2 s b h`` bytes in bf16, split by ``t`` only under sequence parallelism.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from models_large import LLAMA3, llama3_task  # noqa: E402

import memplan  # noqa: E402
from estimators import Estimator, NoFeasiblePlanError, TrainConfig  # noqa: E402

COMMAND = "python benchmarks/tensor_parallel_large.py --out benchmarks/results/tensor_parallel_large.md"

# name: (model, seq, gpus per node, nodes, global batch, what torchtitan published for it)
PLANS = {
    "70b-64": ("70b", 8192, 8, 8, 64, "FSDP 64, local batch 1, full AC (64 A100-80GB; 1-D only)"),
    "8b-32k": ("8b", 32768, 8, 1, 8, "FSDP 8, local batch 1, full AC: 83.9 GiB (with compile + Float8)"),
    "405b-512": ("405b", 8192, 8, 64, 512, "FSDP 8 x TP 8 x PP 8, local batch 32, full AC: 72.7 GiB (interleaved 1F1B)"),
}


def plan_row(name: str) -> list[str]:
    size, seq, gpus, nodes, global_batch, published = PLANS[name]
    task = llama3_task(size, seq=seq, samples=max(64, global_batch), torchtitan=True)
    start = time.perf_counter()
    try:
        plan = memplan.search(task, gpu="H100-80GB", vram="80GB", gpus=gpus, nodes=nodes, global_batch=global_batch,
                              precisions=["bf16-mixed"], probe_top=0, progress=False)
        chosen = plan.best.config.describe()
        peak = f"{plan.best.predicted.peak_bytes / 2**30:.1f}"
    except NoFeasiblePlanError as exc:
        chosen, peak = f"none fits: {str(exc)[:160]}", "-"
    seconds = time.perf_counter() - start
    print(f"{name}: {chosen} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return [f"Llama 3.1 {size.upper()}, {seq} tokens, {gpus * nodes} x H100-80GB, global batch {global_batch}",
            chosen, peak, f"{seconds:.1f}", published]


def estimate_rows() -> list[list[str]]:
    layers, width, *_ = LLAMA3["70b"]
    seq, micro, tp = 8192, 16, 8
    task = llama3_task("70b", seq=seq, torchtitan=True)  # split at its attention and MLP modules
    est = Estimator(task, gpu="H100-80GB")
    kept = layers * 2 * seq * micro * width  # Megatron: each layer's input, bf16
    rows = []
    for sp in (False, True):
        config = TrainConfig(micro_batch_size=micro, precision="bf16-mixed", checkpoint_segments=layers,
                             strategy="fsdp", world_size=32, tp=tp, sequence_parallel=sp)
        start = time.perf_counter()
        e = est.estimate(config)
        seconds = time.perf_counter() - start
        reserved = (e.peak_reserved_bytes or e.peak_allocated_bytes) / 2**30
        rows.append([config.describe(), f"{reserved:.1f}", f"{e.breakdown['activations'] / 2**30:.1f}",
                     f"{kept / tp / 2**30:.1f}" if sp else f"{kept / 2**30:.1f}", "71.9 (SP + Float8 + compile)",
                     f"{seconds:.1f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=[*PLANS, "estimate"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    plans = [plan_row(n) for n in PLANS if args.only in (None, n)]
    estimates = estimate_rows() if args.only in (None, "estimate") else []
    lines = ["# Large plans with tensor parallelism", "", f"Command: `{COMMAND}`", "",
             f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    if plans:
        lines += ["## Plans (`memplan.search`, bf16-mixed, 80 GB cards)", "",
                  "| model and machine | chosen | predicted peak GiB | plan s | torchtitan published |",
                  "|---|---|---:|---:|---|", *("| " + " | ".join(r) + " |" for r in plans), ""]
    if estimates:
        lines += ["## torchtitan's 2-D layout, estimated per rank", "",
                  "| configuration | reserved GiB | activations GiB | Megatron: kept layer inputs GiB | published GiB | s |",
                  "|---|---:|---:|---:|---:|---:|", *("| " + " | ".join(r) + " |" for r in estimates), ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
