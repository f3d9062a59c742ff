"""Per-rank memory of pipeline parallelism: the one-process fake trace of each stage against real gloo ranks.

The test suite's attention LM (``tests/helpers/lm.py``) with 4 Llama-shaped blocks (64 wide,
4 heads, 64 tokens) is cut into 2 pipeline stages and run by each schedule (GPipe, 1F1B,
interleaved 1F1B) over 4 micro-batches of 4, each fp32, fp32 with 2 checkpointed segments,
and bf16-mixed with 2 checkpointed segments; GPipe and 1F1B also run fp32 over 8 micro-batches.
All of them are trained for 2 steps by the same 2 gloo processes, whose allocator peaks are
measured (``estimators.probing._measure``: gloo's own scratch is left out, as NCCL makes none).
Each rank is compared with the fake trace of its stage (``trace_step(..., stage=rank)``: the
events' peak, without kernel workspaces), and the fullest rank with the estimate (the fullest
stage's trace plus the CPU kernel workspaces). A second table, for information, gives the
estimate of the same model for an H100 against one device accumulating as many micro-batches.

    python benchmarks/pipeline_memory.py [--out benchmarks/results/pipeline_memory.md]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from helpers.lm import ATTENTION_LM_SOURCE  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.probing._measure import measure_distributed_peaks  # noqa: E402
from estimators.tracing._trace import trace_step  # noqa: E402

COMMAND = "python benchmarks/pipeline_memory.py --out benchmarks/results/pipeline_memory.md"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
VARIANTS = ({}, {"checkpoint_segments": 2}, {"precision": "bf16-mixed", "checkpoint_segments": 2})
CONFIGS = [
    *(TrainConfig(micro_batch_size=4, pp=2, pp_schedule=s, pp_microbatches=4, **kw)
      for s in SCHEDULES for kw in VARIANTS),
    # More micro-batches: GPipe holds every one's activations on the first stage, 1F1B at most pp.
    *(TrainConfig(micro_batch_size=4, pp=2, pp_schedule=s, pp_microbatches=8) for s in ("gpipe", "1f1b")),
]
GPU = "H100-80GB"
GPU_MICROBATCHES = (4, 8)


def _events_peak(trace) -> int:
    """The trace's events' peak: live bytes at the fullest moment, workspaces left out."""
    signed = trace.alloc_bytes[trace.event_alloc] * trace.event_sign.astype(np.int64)
    return int(np.cumsum(signed).max())


def _pipeline_notes(notes) -> str:
    return "; ".join(n.removeprefix("pipeline: ") for n in notes if n.startswith("pipeline:")) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm.py"
        path.write_text(ATTENTION_LM_SOURCE.replace("layers=3", "layers=4"))
        t0 = time.perf_counter()
        measured = measure_distributed_peaks(str(path), CONFIGS)
        measure_s = time.perf_counter() - t0
        task = load_task(path)
        est = Estimator(load_task(path), device="cpu")
        rows, notes = [], []
        for config, ranks in zip(CONFIGS, measured):
            traced = [_events_peak(trace_step(task, config, stage=r)) for r in range(config.pp)]
            e = est.estimate(config, exact=True)
            fullest = max(m.peak_bytes for m in ranks)
            per_rank = " | ".join(f"{m.peak_bytes:,} / {t:,} ({m.peak_bytes / t:.4f})" for m, t in zip(ranks, traced))
            rows.append(f"| {config.describe()} | {per_rank} | {e.peak_allocated_bytes:,} | "
                        f"{fullest / e.peak_allocated_bytes:.4f} | {e.method} |")
            notes.append(f"- {config.describe()}: {_pipeline_notes(e.notes)}")
        gpu = Estimator(load_task(path), gpu=GPU)
        gpu_rows = []
        for m in GPU_MICROBATCHES:
            for config in (*(TrainConfig(micro_batch_size=4, pp=2, pp_schedule=s, pp_microbatches=m,
                                         precision="bf16-mixed") for s in SCHEDULES),
                           TrainConfig(micro_batch_size=4, grad_accum_steps=m, precision="bf16-mixed")):
                e = gpu.estimate(config)
                gpu_rows.append(f"| {config.describe()} | {e.peak_reserved_bytes:,} | {e.peak_allocated_bytes:,} | "
                                f"{e.step_time_s * 1e3:.2f} | {e.method} | {_pipeline_notes(e.notes)} |")
    lines = ["# Pipeline parallelism: per-rank peak, fake trace of each stage vs real gloo ranks", "",
             f"Command: `{COMMAND}`", "",
             f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "- model: tests/helpers/lm.py's attention LM with 4 Llama-shaped blocks (64 wide, 4 heads, "
             "64 tokens), cut into 2 stages; micro-batches of 4",
             f"- {len(CONFIGS)} configurations trained for 2 steps each by the same 2 gloo processes "
             f"({measure_s:.0f} s, spawning included)",
             "- measured: each rank's allocator peak, gloo's scratch left out (allocated on its worker threads "
             "or inside the process group's call: NCCL makes none)",
             "- traced: the events' peak of the one-process fake trace of that rank's stage "
             "(`trace_step(task, config, stage=rank)`), without kernel workspaces",
             "- estimate: `Estimator(device=\"cpu\").estimate(config, exact=True)`, the fullest stage's "
             "trace with the CPU kernel workspaces", "",
             "| configuration | rank 0 measured / traced | rank 1 measured / traced | estimate (bytes) | "
             "fullest measured / estimate | method |",
             "|---|---:|---:|---:|---:|---|", *rows, "",
             "The estimate's pipeline notes:", "", *notes, "",
             f"## The same model planned for an {GPU} (for information, nothing measured)", "",
             f"`Estimator(load_task(path), gpu=\"{GPU}\").estimate(config)`: pipelines of 2 stages against one "
             "device accumulating as many micro-batches.", "",
             "| configuration | peak reserved (bytes) | peak allocated (bytes) | step time (ms) | method | "
             "pipeline notes |",
             "|---|---:|---:|---:|---|---|", *gpu_rows, ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
