"""What the trainer's memory-relevant options cost on top of the estimate (CPU, measured).

Per model, one configuration (micro-batch ``--batch``, fp32, no accumulation, no checkpointing)
is trained for ``--steps`` optimizer steps under ``estimators.runtime._guard.MemoryGuard`` (which counts
every live tensor storage, the model's and optimizer's included) once per variant:

* ``clip off``  -- ``grad_clip_mode="off"``: the step the estimator traces;
* ``clip norm`` -- the default, ``clip_grad_norm_(1.0)``;
* ``clip value`` -- ``clip_grad_value_(1.0)`` (the global norm is still computed, for the log);
* ``ema``       -- ``ema_decay=0.999`` with clipping off (a second copy of the weights).

It prints a Markdown table: the estimator's predicted peak for the configuration, each
variant's measured peak, and each variant's difference from ``clip off``. Validation data is
dropped (evaluation would add its own, unrelated peak).

    python benchmarks/technique_memory.py [--models examples/digits.py,...] [--batch 16] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import TrainConfig, estimate, format_size, load_task  # noqa: E402
from estimators.runtime._guard import MemoryGuard  # noqa: E402
from memplan.training import TrainOptions, train  # noqa: E402

VARIANTS = {
    "clip off": {"grad_clip_mode": "off"},
    "clip norm": {"grad_clip_mode": "norm"},
    "clip value": {"grad_clip_mode": "value"},
    "ema": {"grad_clip_mode": "off", "ema_decay": 0.999},
}


def measure(path: str, batch: int, steps: int, variant: dict, out: Path) -> int:
    task = dataclasses.replace(load_task(path), val_data=None)
    guard = MemoryGuard(10**13)
    result = train(task, TrainConfig(micro_batch_size=batch),
                   TrainOptions(max_steps=steps, out_dir=out, progress=False, num_workers=0,
                                schedule="constant", **variant),
                   memory_guard=guard)
    return int(result.summary["peak_memory_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="examples/digits.py,benchmarks/models/cnn_bn.py,benchmarks/models/gpt_tied.py")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"micro-batch {args.batch}, fp32, {args.steps} steps, CPU, torch {torch.__version__}\n")
    print("| model | predicted | " + " | ".join(VARIANTS) + " | " + " | ".join(f"{v} - off" for v in list(VARIANTS)[1:]) + " |")
    print("|---" * (2 + 2 * len(VARIANTS) - 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.models.split(","):
            predicted = estimate(path, batch_size=args.batch).peak_bytes
            peaks = {name: measure(path, args.batch, args.steps, v, Path(tmp) / f"{Path(path).stem}-{i}")
                     for i, (name, v) in enumerate(VARIANTS.items())}
            off = peaks["clip off"]
            cells = [format_size(predicted)] + [format_size(p) for p in peaks.values()]
            cells += [f"{peaks[n] - off:+,} B" for n in list(VARIANTS)[1:]]
            print(f"| {Path(path).name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
