"""torch.compile evaluated by probes (``memplan.planning._compile``): figures and cost (CPU).

Part 1: per model, one configuration probed eager and then compiled (``evaluate_compile`` with
the real probes, ``--repeats`` times, each pair in fresh probe children): the measured peaks, the
samples/s, the compile time (the compiled probe's first step beyond its second), the compiled
probe's wall time and the decision (True: compiled more than 5% faster and within the budget).

Part 2: what the evaluation adds to a search: ``search(model, device="cpu")`` with
``compile_top=0`` and with ``compile_top=1`` (default trials, ``probe_top`` 2), wall time and
``plan.compile``.

    PYTHONPATH=. python benchmarks/compile_probe.py [--models ...] [--repeats 2] [--no-search]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estimators import Estimator, TrainConfig, format_size, load_task  # noqa: E402
from memplan import search  # noqa: E402
from memplan.planning._compile import evaluate_compile  # noqa: E402
from memplan.planning._plan import PlanEntry  # noqa: E402

MODELS = {"examples/digits.py": 64, "benchmarks/models/mlp.py": 32, "benchmarks/models/gpt_tied.py": 8}


def probe_rows(path: str, batch: int, repeats: int) -> list[str]:
    task = load_task(str(ROOT / path))
    estimator = Estimator(task, device="cpu")
    config = TrainConfig(micro_batch_size=batch)
    rows = []
    for i in range(repeats):
        entries = [PlanEntry(config=config, predicted=estimator.estimate(config))]
        notes: list[str] = []
        t0 = time.monotonic()
        ranked, compiled = evaluate_compile(task, estimator, entries, 1, 2**34, None, None, None, notes)
        wall = time.monotonic() - t0
        note = next((n for n in notes if n.startswith("torch.compile of")), "; ".join(notes))
        rows.append(f"| {Path(path).name} | {batch} | {i + 1} | {note.split(': ', 1)[-1]} | {wall:.1f} s | {compiled} |")
        print(rows[-1], flush=True)
    return rows


def search_rows(path: str) -> list[str]:
    rows = []
    for top in (0, 1):
        t0 = time.monotonic()
        plan = search(str(ROOT / path), device="cpu", compile_top=top, storage="sqlite:///:memory:")
        wall = time.monotonic() - t0
        best = plan.best
        rows.append(f"| {Path(path).name} | {top} | {wall:.1f} s | {plan.compile} | {best.config.describe()} | "
                    f"{format_size(best.peak_bytes)} | {best.samples_per_s:,.1f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-search", action="store_true")
    args = ap.parse_args()
    print("| model | micro-batch | run | compiled against eager (measured) | evaluation wall | compile |")
    print("|---|---|---|---|---|---|")
    for path in args.models:
        probe_rows(path, MODELS.get(path, 8), args.repeats)
    if not args.no_search:
        print("\n| model | compile_top | search wall | plan.compile | chosen | peak | samples/s |")
        print("|---|---|---|---|---|---|---|")
        for path in args.models[:1]:
            search_rows(path)


if __name__ == "__main__":
    main()
