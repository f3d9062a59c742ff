"""Validate memplan's CUDA predictions on a real GPU: predicted vs measured, in one run.

For the example and benchmark model files, in fp32, bf16-mixed and fp16-mixed, without and
with activation checkpointing (every block of the model's block stack), this script

* predicts the configuration: ``Estimator(task, gpu=...).estimate(config, exact=True)`` (a fake
  trace on CPU tensors with CUDA's kernel semantics: the same code path as ``--gpu`` planning
  on a machine without a GPU), and
* measures it on the GPU with a probe (``estimators.probing._probe.probe``: a child process of its own,
  ``max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats`` over the
  first two optimizer steps, the median step time of a few more),

and writes both to ``benchmarks/results/cuda_validation.md`` with the errors. It stops
starting new configurations after ``--time-limit`` seconds (default 420: the whole run fits
in 8 minutes on one H200) and reports what it finished.

    python benchmarks/validate_cuda.py                       # on a machine with a GPU
    python benchmarks/validate_cuda.py --predict-only --gpu H200   # predictions only, on CPU

Without a GPU (and without ``--predict-only``) it stops with a one-line message, exit code 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, MemplanError, TrainConfig, load_task  # noqa: E402
from estimators.runtime._checkpoint import max_checkpoint_segments  # noqa: E402

MIB = 2**20
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
MODELS: dict[str, int] = {
    # model file (relative to the repository) -> micro-batch size
    "examples/tiny_gpt.py": 8,
    "examples/digits.py": 64,
    "benchmarks/models/mlp.py": 64,
    "benchmarks/models/cnn_bn.py": 16,
    "benchmarks/models/vit.py": 16,
    "benchmarks/models/gpt_tied.py": 16,
    "benchmarks/models/encdec.py": 16,
    "benchmarks/models/lstm.py": 16,
    "benchmarks/models/buffers.py": 32,
    "benchmarks/models/frozen_backbone.py": 16,
    "benchmarks/models/moe_dynamic.py": 16,
    "benchmarks/models/bert_large.py": 2,
}


def _segments(task: Any) -> int:
    with torch.device("meta"):
        model = task.build_model()
    return max_checkpoint_segments(model, task.checkpoint_blocks)


def _pct(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None or meas == 0:
        return "–"
    return f"{100.0 * (pred - meas) / meas:+.1f}%"


def _mib(x: int | None) -> str:
    return "–" if x is None else f"{x / MIB:.1f}"


def _configs(task: Any, batch: int, bf16: bool) -> list[TrainConfig]:
    out = []
    try:
        segments = _segments(task)
    except Exception:  # noqa: BLE001 - a model that cannot build on meta is checkpointed as none
        segments = 0
    for precision in PRECISIONS:
        if precision == "bf16-mixed" and not bf16:
            continue
        for ckpt in (0, segments) if segments else (0,):
            out.append(TrainConfig(micro_batch_size=batch, precision=precision, checkpoint_segments=ckpt))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--predict-only", action="store_true", help="predictions only (no GPU needed)")
    ap.add_argument("--gpu", default=None, help="card to predict for (default: the local GPU)")
    ap.add_argument("--models", default=None, help="comma-separated subset of the model files' stems")
    ap.add_argument("--time-limit", type=float, default=420.0, help="stop starting configurations after this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_validation.md"))
    args = ap.parse_args(argv)
    if not args.predict_only and not torch.cuda.is_available():
        print("validate_cuda: no CUDA GPU is visible here; run it on a machine with one, or pass "
              "--predict-only --gpu NAME for the predictions alone", file=sys.stderr)
        return 2
    if args.predict_only and args.gpu is None:
        print("validate_cuda: --predict-only needs --gpu NAME (e.g. --gpu H200)", file=sys.stderr)
        return 2
    from estimators.probing._probe import probe, prestart, shutdown

    if not args.predict_only:
        prestart()
    start = time.perf_counter()
    models = {m: b for m, b in MODELS.items()
              if args.models is None or Path(m).stem in args.models.split(",")}
    rows: list[str] = []
    gpu_name = args.gpu
    done = skipped = 0
    try:
        for rel, batch in models.items():
            task = load_task(str(ROOT / rel))
            est = Estimator(task, device="cuda", gpu=args.gpu)
            gpu_name = est.spec.name if est.spec else gpu_name
            for config in _configs(task, batch, est.spec is None or est.spec.bf16):
                if time.perf_counter() - start > args.time_limit:
                    skipped += 1
                    continue
                rows.append(_row(rel, config, est, None if args.predict_only else probe))
                done += 1
                print(rows[-1], file=sys.stderr, flush=True)
            est.close()
    finally:
        if not args.predict_only:
            shutdown()
    _write(args, rows, gpu_name, done, skipped, time.perf_counter() - start)
    return 0


def _row(rel: str, config: TrainConfig, est: Estimator, probe: Any) -> str:
    label = f"{Path(rel).stem} b{config.micro_batch_size} {config.precision}" + (
        f" ckpt{config.checkpoint_segments}" if config.checkpoint_segments else "")
    try:
        p = est.estimate(config, exact=True)
    except MemplanError as exc:
        return f"| {label} | prediction failed: {exc} |" + " |" * 8
    backend = next((n.split(": ", 1)[1].split(" (")[0] for n in p.notes if n.startswith("attention backend")), "")
    if probe is None:
        return (f"| {label} | {_mib(p.peak_allocated_bytes)} | – | – | {_mib(p.peak_reserved_bytes)} | – | – "
                f"| {1e3 * (p.step_time_s or 0):.2f} | – | – | {p.peak_phase}; {backend} |")
    r = probe(str(ROOT / rel), config, device="cuda", steps=5, warmup=2, timeout_s=120)
    if not r.ok or r.estimate is None:
        return (f"| {label} | {_mib(p.peak_allocated_bytes)} | {r.status}: {r.message[:80]} | – "
                f"| {_mib(p.peak_reserved_bytes)} | – | – | {1e3 * (p.step_time_s or 0):.2f} | – | – | |")
    m = r.estimate
    return (f"| {label} | {_mib(p.peak_allocated_bytes)} | {_mib(m.peak_allocated_bytes)} "
            f"| {_pct(p.peak_allocated_bytes, m.peak_allocated_bytes)} | {_mib(p.peak_reserved_bytes)} "
            f"| {_mib(m.peak_reserved_bytes)} | {_pct(p.peak_reserved_bytes, m.peak_reserved_bytes)} "
            f"| {1e3 * (p.step_time_s or 0):.2f} | {1e3 * (m.step_time_s or 0):.2f} "
            f"| {_pct(p.step_time_s, m.step_time_s)} | predicted peak {p.peak_phase}, measured {m.peak_phase}; {backend} |")


def _write(args: argparse.Namespace, rows: list[str], gpu: str | None, done: int, skipped: int, wall: float) -> None:
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    mode = "predictions only (no GPU)" if args.predict_only else f"measured on {torch.cuda.get_device_name()}"
    lines = [
        f"# CUDA validation: predicted vs measured ({_dt.date.today()})",
        "",
        f"Command: `python benchmarks/validate_cuda.py{' --predict-only --gpu ' + args.gpu if args.predict_only else ''}`"
        f" — {mode}; card {gpu}; torch {torch.__version__}, CUDA {cuda}, cuDNN {cudnn}. "
        f"{done} configurations in {wall:.0f} s, {skipped} skipped by the time limit.",
        "",
        "Allocated = `max_memory_allocated`, reserved = `max_memory_reserved` (MiB), over the first two "
        "optimizer steps; step = median step time (ms). Predictions: `Estimator(...).estimate(config, exact=True)`.",
        "",
        "| config | alloc pred | alloc meas | err | reserved pred | reserved meas | err | step pred | "
        "step meas | err | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
