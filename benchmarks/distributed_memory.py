"""Per-rank memory of ddp and fsdp: predicted at W = 1, 2, 4, 8, measured at W = 1 and 2.

For each model file, ONE ``Estimator(task, device="cpu")`` predicts the per-rank peak
(allocated bytes, the CPU allocator's count) of a fixed configuration under DDP and FSDP2 at
world sizes 1, 2, 4 and 8, each simulated in this process on a fake process group. The same
configurations are then run for real at W = 1 and W = 2 (gloo, one process per rank, wrapped
by ``estimators.runtime._parallel`` as the trainer wraps them) and each rank's peak is measured with
``torch.profiler``'s allocation events (``estimators.probing._measure``).

    python benchmarks/distributed_memory.py [--models a,b] [--batch N] [--out FILE]

The report (Markdown) goes to ``--out`` (default ``benchmarks/results/distributed.md``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, format_size, load_task  # noqa: E402
from estimators.probing._measure import measure_distributed_peaks  # noqa: E402

MODELS = {
    "gpt_tied": "benchmarks/models/gpt_tied.py",
    "vit": "benchmarks/models/vit.py",
    "digits": "examples/digits.py",
}
PREDICTED_W = (1, 2, 4, 8)
MEASURED_W = (1, 2)
STRATEGIES = ("ddp", "fsdp")


def run_model(name: str, path: str, batch: int) -> list[dict]:
    task = load_task(str(ROOT / path))
    estimator = Estimator(task, device="cpu")
    rows: dict[tuple[str, int], dict] = {}
    for strategy in STRATEGIES:
        for w in PREDICTED_W:
            config = TrainConfig(micro_batch_size=batch, strategy=strategy, world_size=w)
            t0 = time.perf_counter()
            est = estimator.estimate(config, exact=True)
            rows[(strategy, w)] = {"model": name, "strategy": strategy, "world_size": w,
                                   "predicted": est.peak_allocated_bytes, "method": est.method,
                                   "estimate_s": time.perf_counter() - t0, "measured": None}
            print(f"{name} {strategy} W={w}: {format_size(est.peak_allocated_bytes)}", file=sys.stderr)
    for w in MEASURED_W:
        configs = [TrainConfig(micro_batch_size=batch, strategy=s, world_size=w) for s in STRATEGIES]
        for config, ranks in zip(configs, measure_distributed_peaks(str(ROOT / path), configs)):
            rows[(config.strategy, w)]["measured"] = [m.peak_bytes for m in ranks]
    return list(rows.values())


def report(rows: list[dict], command: str, batch: int, seconds: float) -> str:
    lines = [
        "# Per-rank memory of DDP and FSDP2: predicted vs measured",
        "",
        f"Command: `{command}`",
        "",
        f"Run {_dt.date.today().isoformat()} on {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; {seconds:.0f} s in all.",
        "",
        f"Configuration: micro-batch {batch}, fp32, no accumulation, no checkpointing, AdamW. "
        "Predicted: `Estimator(task, device=\"cpu\").estimate(config, exact=True)`, rank 0 of W "
        "simulated in one process on a fake process group. Measured: W real gloo processes, "
        "each rank's peak of the CPU allocator (`torch.profiler` allocation events) over two "
        "optimizer steps. Error = predicted vs the highest measured rank.",
        "",
        "gloo allocates buffers of its own on its worker thread during collectives (up to one "
        "FSDP unit's gathered size, at timing-dependent moments); NCCL does not, and the "
        "prediction leaves them out, so ranks may measure above it by that much.",
        "",
        "| model | strategy | W | predicted / rank | measured / rank | error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = r["measured"]
        if measured:
            top = max(measured)
            meas = " / ".join(format_size(m) for m in measured)
            err = f"{(r['predicted'] - top) / top * 100:+.2f}%"
        else:
            meas, err = "—", "—"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['world_size']} | {format_size(r['predicted'])} "
                     f"| {meas} | {err} |")
    lines += [
        "",
        "## Plan for a 7B model on 8 x 80 GB",
        "",
        "filled by benchmarks/distributed_plan.py",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/distributed.md"))
    args = parser.parse_args(argv)
    command = "python benchmarks/distributed_memory.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    t0 = time.perf_counter()
    rows: list[dict] = []
    for name in args.models.split(","):
        rows.extend(run_model(name, MODELS[name], args.batch))
    text = report(rows, command, args.batch, time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
