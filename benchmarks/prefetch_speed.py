"""Estimating a whole search space with and without the up-front trace prefetch.

For each model and target, the space ``memplan plan`` enumerates (the model file's global
batch; fp32 and bf16 for an A100, fp32 for the CPU) is estimated by a fresh ``Estimator``
twice per round: once after ``expect(space)`` (traces made as the configurations are asked,
the worker used only for anchor pairs of traces over a second) and once after
``expect(space, prefetch=True)`` (a forked worker takes a queue of fake traces while this
process runs its share). Rounds alternate the order. Reported: wall time of all the
estimates, per round, and whether the two gave the same estimates.

    python benchmarks/prefetch_speed.py [--models gpt_tied,cnn_bn] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.runtime._checkpoint import max_checkpoint_segments  # noqa: E402
from memplan.planning._inputs import meta_model  # noqa: E402
from memplan.planning._space import build_space  # noqa: E402

MODELS = {
    "gpt_tied": ROOT / "benchmarks" / "models" / "gpt_tied.py",
    "cnn_bn": ROOT / "benchmarks" / "models" / "cnn_bn.py",
    "digits": ROOT / "examples" / "digits.py",
}
TARGETS = {"A100-80GB": (None, "A100-80GB", ("fp32", "bf16-mixed")), "cpu": ("cpu", None, ("fp32",))}


def run_once(path: Path, device: str | None, gpu: str | None, precisions: tuple[str, ...], prefetch: bool):
    task = load_task(str(path))
    estimator = Estimator(task, device=device, gpu=gpu)
    space = build_space(dataset_size=task.dataset_size(), global_batch=int(task.settings["global_batch"]),
                        precisions=precisions, max_segments=max_checkpoint_segments(meta_model(task),
                                                                                      task.checkpoint_blocks),
                        max_micro_batch=None)
    start = time.perf_counter()
    estimator.expect(space, prefetch=prefetch)
    estimates = {c: estimator.estimate(c) for c in space}
    wall = time.perf_counter() - start
    estimator.close()
    return wall, len(space), {c: (e.peak_bytes, e.step_time_s) for c, e in estimates.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt_tied,cnn_bn,digits")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefetch.md"))
    args = ap.parse_args()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    load = os.getloadavg()
    # Warm imports and dispatch caches once, outside the timings.
    Estimator(load_task(str(MODELS["digits"])), device="cpu").estimate(TrainConfig(micro_batch_size=4))
    rows = []
    for name in args.models.split(","):
        for target, (device, gpu, precisions) in TARGETS.items():
            times: dict[bool, list[float]] = {False: [], True: []}
            same = True
            n = 0
            for r in range(args.rounds):
                results = {}
                for prefetch in ((False, True) if r % 2 == 0 else (True, False)):
                    wall, n, got = run_once(MODELS[name], device, gpu, precisions, prefetch)
                    times[prefetch].append(wall)
                    results[prefetch] = got
                    print(f"[{name} {target}] round {r + 1} prefetch={prefetch}: {wall:.1f} s", file=sys.stderr, flush=True)
                same = same and results[False] == results[True]
            rows.append((name, target, n, times, same))
    out = ["# Estimating a search space with and without the trace prefetch", "",
           f"Command: `{cmd}`", "",
           f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
           f"- torch {torch.__version__}, {os.cpu_count()} cores; load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
           "- each cell: wall time of estimating every configuration of the space with a fresh estimator, "
           "per round (rounds alternate which goes first), then the median", "",
           "| model | target | configurations | traced as asked (s) | prefetched (s) | speed-up (medians) | same estimates |",
           "|---|---|---|---|---|---|---|"]
    for name, target, n, times, same in rows:
        a, b = statistics.median(times[False]), statistics.median(times[True])
        out.append(f"| {name} | {target} | {n} | {', '.join(f'{t:.1f}' for t in times[False])} (median {a:.1f}) | "
                   f"{', '.join(f'{t:.1f}' for t in times[True])} (median {b:.1f}) | {a / b:.2f}x | {'yes' if same else 'NO'} |")
    Path(args.out).write_text("\n".join(out) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
