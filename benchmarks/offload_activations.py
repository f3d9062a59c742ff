"""Activation offloading (``TrainConfig.offload_activations``): memory, transfers and loss.

Part 1, CPU: per model and micro-batch, the estimate (``Estimator(task).estimate``) against
the real CPU peak (``measure_cpu_peak``) with offloading on; on a CPU device nothing moves, so
both must equal the plain step's.

Part 2, CUDA targets (modelled, no GPU here): the predicted device peak (reserved), the host
memory the offloaded activations take (``Estimate.host_bytes``) and the step time of plain,
offloaded, checkpointed, and checkpointed + offloaded configurations.

Part 3, training: ``--train-steps`` steps of examples/digits.py through the runtime's
``train_step`` with the copies a GPU run makes (host copy in forward, device copy in backward,
made for real on CPU tensors under ``simulated_transfers``) against the plain run, from the
same weights on the same batches.

    python benchmarks/offload_activations.py [--skip-llama] [--train-steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from estimators import Estimator, TrainConfig, load_task  # noqa: E402
from estimators.probing._measure import measure_cpu_peak  # noqa: E402
from estimators.runtime._build import build_for_training  # noqa: E402
from estimators.runtime._activation_offload import simulated_transfers  # noqa: E402
from estimators.runtime._planned import PlannedSteps  # noqa: E402

CPU_MODELS = ("examples/digits.py", "benchmarks/models/gpt_tied.py", "benchmarks/models/vit.py")


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def cpu_rows(batches: list[int]) -> list[str]:
    lines = ["| model | micro-batch | estimate (offloaded) | measured (offloaded) | error | measured plain |",
             "|---|---|---|---|---|---|"]
    for path in CPU_MODELS:
        task = load_task(str(ROOT / path))
        est = Estimator(task, device="cpu")
        for b in batches:
            c = TrainConfig(micro_batch_size=b, offload_activations=True)
            e = est.estimate(c).peak_bytes
            m = measure_cpu_peak(task, c).peak_bytes
            plain = measure_cpu_peak(task, c.replace(offload_activations=False)).peak_bytes
            lines.append(f"| {Path(path).stem} | {b} | {_mb(e)} | {_mb(m)} | {(e - m) / m:+.3%} | {_mb(plain)} |")
    return lines


def _cuda_configs(base: TrainConfig, segments: int) -> list[tuple[str, TrainConfig]]:
    return [("plain", base), ("offloaded", base.replace(offload_activations=True)),
            (f"checkpoint {segments}", base.replace(checkpoint_segments=segments)),
            (f"checkpoint {segments} + offloaded", base.replace(checkpoint_segments=segments, offload_activations=True))]


def cuda_rows(llama: bool) -> list[str]:
    lines = ["| model / card | configuration | device peak (reserved) | host bytes | step time | trace s | offload note |",
             "|---|---|---|---|---|---|---|"]
    cases = [("gpt_tied", lambda: load_task(str(ROOT / "benchmarks/models/gpt_tied.py")), "A100-80GB",
              TrainConfig(micro_batch_size=32), 2),
             ("vit", lambda: load_task(str(ROOT / "benchmarks/models/vit.py")), "A100-80GB",
              TrainConfig(micro_batch_size=64, precision="bf16-mixed"), 2)]
    if llama:
        from models_large import llama3_task
        cases.append(("Llama 3.2-1B seq 2048", lambda: llama3_task("1b", 2048), "A100-80GB",
                      TrainConfig(micro_batch_size=4, precision="bf16-true"), 16))
    for name, make, gpu, base, segments in cases:
        task = make()
        est = Estimator(task, gpu=gpu)
        for label, c in _cuda_configs(base, segments):
            t0 = time.perf_counter()
            e = est.estimate(c, exact=True)
            seconds = time.perf_counter() - t0
            note = next((n.removeprefix("activation offload: ") for n in e.notes if n.startswith("activation offload:")), "")
            lines.append(f"| {name} / {gpu} | {c.describe()} ({label}) | {e.peak_bytes / 1e9:.3f} GB "
                         f"| {e.host_bytes / 1e9:.3f} GB | {e.step_time_s * 1e3:.2f} ms | {seconds:.1f} | {note} |")
    return lines


def loss_rows(steps: int) -> list[str]:
    task = load_task(str(ROOT / "examples/digits.py"))
    config = TrainConfig(micro_batch_size=64)
    runs = {}
    for label, offload in (("plain", False), ("offloaded, copies made", True)):
        torch.manual_seed(0)
        c = config.replace(offload_activations=offload)
        built = build_for_training(task, c, "cpu")
        run = PlannedSteps(task, c, built)
        with simulated_transfers() if offload else _Nothing():
            losses = [float(run(i).loss_sum) for i in range(1, steps + 1)]
        runs[label] = (losses, {k: v.detach().clone() for k, v in built.model.state_dict().items()})
    (a, wa), (b, wb) = runs.values()
    diff = max(abs(x - y) for x, y in zip(a, b))
    wdiff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    return [f"{steps} steps of digits.py, batch 64: first loss {a[0]:.6f}, final loss plain {a[-1]:.6f}, "
            f"offloaded {b[-1]:.6f}; largest per-step loss difference {diff:g}; largest weight difference {wdiff:g}."]


class _Nothing:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--train-steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python benchmarks/offload_activations.py" + (" --skip-llama" if args.skip_llama else "")
    out = [f"# Activation offloading ({started})", "", f"Command: `PYTHONPATH=. {cmd}`; torch {torch.__version__}, "
           "one thread, a shared 2-core machine.", "", "## CPU: estimate against the allocator", "",
           *cpu_rows([8, 32]), "", "## CUDA targets (modelled)", "", *cuda_rows(not args.skip_llama), "",
           "## Training with the copies", "", *loss_rows(args.train_steps), ""]
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
