"""Per-rank memory of tensor parallelism (and HSDP): the one-process fake trace against real gloo ranks.

The test suite's attention LM (``tests/helpers/lm.py``: 3 Llama-shaped blocks, 64 wide, 4
heads, 64 tokens) is estimated at tp 2 and at FSDP2 x 2 by tp 2, each plain and sequence
parallel (fp32; fp32 with 2 checkpointed blocks; bf16-mixed with 3 micro-batches and 2
checkpointed blocks), then trained for 2 steps by 2 and 4 gloo processes whose allocator peaks
are measured (``estimators.probing._measure``: gloo's own scratch, made on its threads or inside
the process group's call, is left out, as NCCL makes none).

    python benchmarks/tensor_parallel_memory.py [--out benchmarks/results/tensor_parallel_memory.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from helpers.lm import ATTENTION_LM_SOURCE  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.probing._measure import measure_distributed_peaks  # noqa: E402

COMMAND = "python benchmarks/tensor_parallel_memory.py --out benchmarks/results/tensor_parallel_memory.md"
GROUPS = [
    [TrainConfig(micro_batch_size=16, tp=2, sequence_parallel=sp, **kw) for sp in (False, True)
     for kw in ({}, {"checkpoint_segments": 2}, {"precision": "bf16-mixed", "grad_accum_steps": 3,
                                                  "checkpoint_segments": 2})],
    [*(TrainConfig(micro_batch_size=16, tp=2, strategy="fsdp", world_size=2, sequence_parallel=sp, **kw)
       for sp in (False, True) for kw in ({}, {"precision": "bf16-mixed", "grad_accum_steps": 3,
                                               "checkpoint_segments": 2})),
     # HSDP, 2 groups of 2 FSDP2 ranks, on the same 4 processes.
     *(TrainConfig(micro_batch_size=16, strategy="fsdp", world_size=4, dp_replicate=2, **kw)
       for kw in ({}, {"precision": "bf16-mixed", "grad_accum_steps": 3, "checkpoint_segments": 2}))],
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm.py"
        path.write_text(ATTENTION_LM_SOURCE)
        est = Estimator(load_task(path), device="cpu")
        rows = []
        for group in GROUPS:
            measured = measure_distributed_peaks(str(path), group)
            for config, ranks in zip(group, measured):
                e = est.estimate(config, exact=True)
                ratios = " / ".join(f"{m.peak_bytes / e.peak_allocated_bytes:.4f}" for m in ranks)
                rows.append(f"| {config.describe()} | {e.method} | {e.peak_allocated_bytes:,} | "
                            f"{' / '.join(f'{m.peak_bytes:,}' for m in ranks)} | {ratios} |")
    lines = ["# Tensor parallelism and HSDP: per-rank peak, fake trace vs real gloo ranks", "", f"Command: `{COMMAND}`", "",
             f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "- the measurement leaves out gloo's scratch (allocated on its worker threads or inside the process "
             "group's call: NCCL makes none); a rank still above the prediction holds buffers of collectives it "
             "is finishing (see distributed.md)", "",
             "| configuration | method | predicted bytes | measured per rank | measured / predicted |",
             "|---|---|---:|---:|---:|", *rows, ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
