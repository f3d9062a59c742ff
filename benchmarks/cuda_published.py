"""memplan's CUDA predictions against published GPU measurements (no GPU needed).

The rows are the bert-large-uncased table measured on a Tesla V100-SXM2-16GB by Hugging Face
(``shared/data/published_gpu_runs.md``; transformers ``docs/source/en/perf_train_gpu_one.md``,
2022): NVML "used" memory after ``trainer.train()`` and the train samples/s. memplan predicts
each row with ``Estimator(task, gpu="V100-16GB").estimate(config, exact=True)`` on the model
files ``benchmarks/models/bert_large.py`` (adamw_hf rows) and ``bert_large_adafactor.py``
(Adafactor rows). Nothing is fitted to these rows: they check the mechanism.

Memory: predicted ``max_memory_reserved`` plus the CUDA context the same page measured on the
same setup (``torch.ones((1, 1)).to("cuda")``: 1343 MiB, torch ~1.10 / CUDA 11.2 without lazy
loading) against NVML used. Two setup differences memplan cannot express are shown apart,
not hidden: the 2022 Trainer's ``model.zero_grad()`` (torch 1.10: ``set_to_none=False``) keeps
the gradients allocated between steps where memplan's step frees them; the column "+ kept
grads" adds the gradient bytes to the prediction of the rows without accumulation (with
accumulation they are alive at the peak either way). HF checkpointing of 2022 is reentrant,
memplan's non-reentrant (same saved inputs per layer).

"torch 1.10" adds, on top, the input of every softmax the step keeps: torch up to 1.10 saved
``_softmax``'s input as well as its output for backward (pytorch/pytorch#49600, Dec 2020:
"softmax (and logsoftmax) save `input` for backward computation", though the kernels use only
the output; ``_softmax_backward_data`` took the input's dtype instead from torch 1.11 on), the
installed torch saves the output only. The bytes come from a trace of the row (the forward's ``aten._softmax``
inputs; one layer's with checkpointing, where one layer is recomputed at a time), added only
when the peak falls in a forward or backward phase. Both corrections are arithmetic on the
prediction, not traces, and are shown apart from it.

The "CPU policy" column is the same prediction with the CUDA kernel semantics switched off
(CPU autocast's op lists, CPU dropout): what memplan predicted before they were modelled.

    python benchmarks/cuda_published.py [--out benchmarks/results/cuda_published.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.tracing import _trace as _tracing  # noqa: E402
from estimators.tracing._trace import trace_step  # noqa: E402

MIB = 2**20
CONTEXT_MIB = 1343
"""CUDA context of the measured setup, measured on the same page (see the module docstring)."""
GPU = "V100-16GB"

# (micro-batch, accumulation, precision, checkpointing, optimizer, NVML used MiB, samples/s)
ROWS = [
    (4, 1, "fp32", False, "adamw_hf", 14949, 8.86),
    (1, 4, "fp32", False, "adamw_hf", 8681, 7.75),
    (1, 4, "fp32", True, "adamw_hf", 6775, 5.99),
    (4, 1, "fp16-mixed", False, "adamw_hf", 13939, 18.64),
    (1, 4, "fp16-mixed", True, "adamw_hf", 7275, 10.09),
    (4, 1, "fp32", False, "Adafactor", 12295, 7.96),
    (1, 4, "fp16-mixed", True, "Adafactor", 4847, 9.06),
    (4, 1, "fp32", False, "bnb Adam8bit", 13085, 9.15),
    (1, 4, "fp16-mixed", True, "bnb Adam8bit", 5363, 10.35),
]
MODEL_FILES = {
    "adamw_hf": ROOT / "benchmarks" / "models" / "bert_large.py",
    "Adafactor": ROOT / "benchmarks" / "models" / "bert_large_adafactor.py",
}
WHY_NOT = {
    "bnb Adam8bit": "bitsandbytes' 8-bit Adam runs CUDA-only kernels (no CPU or meta kernels to trace) "
                    "and is not installed here",
}


@contextlib.contextmanager
def _cpu_policy() -> Iterator[None]:
    @contextlib.contextmanager
    def none(*args: Any, **kwargs: Any) -> Iterator[None]:
        yield None
    with mock.patch.object(_tracing, "trace_semantics", none):
        yield


def _softmax_inputs(est: Estimator, config: TrainConfig, peak_phase: str) -> int:
    """Bytes of the softmax inputs torch <= 1.10 would keep at the peak (see the docstring)."""
    if "forward" not in peak_phase and "backward" not in peak_phase:
        return 0
    trace = trace_step(est.task, config, target="cuda", capability=est.spec.compute_capability)
    inputs = [op.bytes_moved - op.new_bytes for op in trace.ops if op.name == "aten._softmax" and op.phase == 1]
    if not inputs:
        return 0
    return max(inputs) if config.checkpoint_segments else sum(inputs)


def _pct(pred: float, meas: float) -> str:
    return f"{100.0 * (pred - meas) / meas:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_published.md"))
    ap.add_argument("--no-cpu-policy", action="store_true", help="skip the CPU-policy comparison column")
    args = ap.parse_args(argv)
    estimators = {name: Estimator(load_task(str(path)), gpu=GPU) for name, path in MODEL_FILES.items()}
    lines = []
    errors_mem, errors_mem_kept, errors_old, errors_time = [], [], [], []
    for b, acc, prec, ckpt, opt, used, sps in ROWS:
        label = f"b{b} x{acc} {prec} {'ckpt' if ckpt else 'no ckpt'} {opt}"
        if opt not in estimators:
            lines.append(f"| {label} | {used} | – | – | – | – | – | – | – | {sps} | – | – | not traced: {WHY_NOT[opt]} |")
            continue
        est = estimators[opt]
        config = TrainConfig(micro_batch_size=b, grad_accum_steps=acc, precision=prec,
                             checkpoint_segments=24 if ckpt else 0)
        start = time.perf_counter()
        e = est.estimate(config, exact=True)
        seconds = time.perf_counter() - start
        pred_used = e.peak_reserved_bytes / MIB + CONTEXT_MIB
        grads = e.trainable_params * 4 / MIB
        kept = pred_used + (grads - e.breakdown.get("gradients", 0) / MIB if acc == 1 else 0.0)
        old_torch = kept + _softmax_inputs(est, config, e.peak_phase) / MIB
        cpu_col = "–"
        if not args.no_cpu_policy:
            with _cpu_policy():
                old = Estimator(load_task(str(MODEL_FILES[opt])), gpu=GPU).estimate(config, exact=True)
            cpu_col = f"{old.peak_reserved_bytes / MIB + CONTEXT_MIB:.0f} ({_pct(old.peak_reserved_bytes / MIB + CONTEXT_MIB, used)})"
        errors_mem.append(abs(pred_used - used) / used)
        errors_mem_kept.append(abs(kept - used) / used)
        errors_old.append(abs(old_torch - used) / used)
        errors_time.append(abs(e.samples_per_s - sps) / sps)
        lines.append(
            f"| {label} | {used} | {pred_used:.0f} | {_pct(pred_used, used)} | {kept:.0f} | {_pct(kept, used)} "
            f"| {old_torch:.0f} | {_pct(old_torch, used)} "
            f"| {cpu_col} | {sps} | {e.samples_per_s:.2f} | {_pct(e.samples_per_s, sps)} "
            f"| peak in {e.peak_phase}; {seconds:.1f} s |")
        print(lines[-1], file=sys.stderr, flush=True)
    header = [
        f"# CUDA predictions against published V100 measurements ({_dt.date.today()})",
        "",
        f"Command: `python benchmarks/cuda_published.py` (torch {torch.__version__}, {platform.machine()}, "
        "no GPU). Source of the measurements and of the setup: `shared/data/published_gpu_runs.md`.",
        "",
        f"Predicted used = predicted `max_memory_reserved` + {CONTEXT_MIB} MiB context (measured on the same "
        "page). \"+ kept grads\" adds the gradients the 2022 Trainer's `zero_grad()` keeps allocated "
        "(rows without accumulation only; an analytic correction, not a trace). \"torch 1.10\" adds on top "
        "the softmax inputs torch <= 1.10 also saved for backward (pytorch/pytorch#49600), in bytes taken "
        "from a trace of the row, when the peak is in a forward or backward phase (arithmetic, not a trace). "
        "Both corrections model the 2022 setup's software, not the card. \"CPU policy\": the "
        "prediction with CPU autocast's op policy and CPU dropout (the behaviour before CUDA semantics "
        "were modelled). No constant was fitted to these rows.",
        "",
        "| row | NVML used MiB | predicted MiB | error | + kept grads MiB | error | torch 1.10 MiB | error "
        "| CPU policy MiB (error) | samples/s | predicted | error | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = [
        "",
        f"Mean |error| memory: {100 * sum(errors_mem) / len(errors_mem):.1f}% as predicted, "
        f"{100 * sum(errors_mem_kept) / len(errors_mem_kept):.1f}% with kept gradients, "
        f"{100 * sum(errors_old) / len(errors_old):.1f}% with torch 1.10's saved softmax inputs too; worst "
        f"{100 * max(errors_mem):.1f}% / {100 * max(errors_mem_kept):.1f}% / {100 * max(errors_old):.1f}%. "
        f"Time: mean |error| {100 * sum(errors_time) / len(errors_time):.1f}%, worst {100 * max(errors_time):.1f}%.",
    ]
    Path(args.out).write_text("\n".join(header + lines + summary) + "\n")
    print("\n".join(header + lines + summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
