"""Do two trees estimate the same? A refactor must not move a figure.

Estimates every model of ``benchmarks/models/`` (and ``examples/``) at a few configurations,
for the CPU and for a CUDA card (``--gpu``), in this tree and in a git worktree of ``--base``,
each in its own process, and prints one row per estimate: peak bytes (the memory model is exact
and must agree to the byte) and the predicted step time (priced with rates pinned here, so that
the machine's load does not move it).

    python benchmarks/estimates_between.py --base e323936 --out benchmarks/results/estimates_between.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "models").glob("*.py")
                if not p.stem.startswith("bert_large")) + ["examples/digits.py", "examples/tiny_gpt.py"]
"""(BERT-large is left out: a trace of it takes minutes on two cores.)"""

CONFIGS = [
    {"micro_batch_size": 4},
    {"micro_batch_size": 8, "grad_accum_steps": 2, "precision": "bf16-mixed"},
    {"micro_batch_size": 4, "checkpoint_segments": 1},
]

CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from estimators import Estimator, TrainConfig, load_task
from estimators.timing._timing import DeviceRates
try:
    from estimators.estimator import _estimate
except ImportError:  # a tree from before estimators/estimator/
    from estimators import _estimate
# Rates pinned: a step time then depends on the tree only, not on the machine's load.
pinned = DeviceRates("pinned-cpu", {"float32": 8e10, "bfloat16": 1e10, "float16": 3e9}, 2e10, 1.5e-5, {})
_estimate.cpu_rates = lambda *a, **k: pinned
out = []
for path in json.loads(sys.argv[1]):
    task = load_task(path)
    for target in ("cpu", "A100-80GB"):
        est = Estimator(task, device="cpu") if target == "cpu" else Estimator(task, gpu=target)
        for fields in json.loads(sys.argv[2]):
            try:
                e = est.estimate(TrainConfig(**fields))
                out.append([path, target, fields, int(e.peak_bytes), float(e.step_time_s or 0.0)])
            except Exception as exc:  # a configuration a model cannot run: the same in both trees
                out.append([path, target, fields, type(exc).__name__, 0.0])
print(json.dumps(out))
"""


def _run(tree: Path, models: list[str]) -> list[list[object]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           "MEMPLAN_CACHE_DIR": tempfile.mkdtemp(prefix="memplan-between-")}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(models), json.dumps(CONFIGS)], cwd=tree,
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--models", default=None, help="comma-separated model paths (default: all)")
    ap.add_argument("--out", default=None, help="write the table as Markdown here")
    args = ap.parse_args()
    models = args.models.split(",") if args.models else MODELS
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.base], cwd=ROOT, check=True)
        try:
            before = _run(base, models)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    after = _run(ROOT, models)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    lines = [f"| model | target | configuration | peak at {args.base} | peak at {head.strip()} | step s before | "
             "step s after | same |", "|---|---|---|---:|---:|---:|---:|---|"]
    same = 0
    for b, a in zip(before, after):
        equal = b[3] == a[3] and abs(float(b[4]) - float(a[4])) <= 1e-9 * max(abs(float(b[4])), 1e-30)
        same += equal
        config = ", ".join(f"{k}={v}" for k, v in dict(b[2]).items())  # type: ignore[call-overload]
        lines.append(f"| {b[0]} | {b[1]} | {config} | {b[3]} | {a[3]} | {float(b[4]):.6g} | {float(a[4]):.6g} | "
                     f"{'yes' if equal else '**no**'} |")
    summary = f"{same} of {len(before)} estimates identical (peak bytes and pinned-rate step time)"
    print("\n".join(lines))
    print(summary)
    if args.out:
        command = " ".join(["python", "benchmarks/estimates_between.py", *sys.argv[1:]])
        Path(args.out).write_text(
            f"# Estimates before and after: {args.base} against {head.strip()}\n\nCommand: `{command}` "
            f"(torch {_torch()}, CPU rates pinned, one thread).\n\n{summary}.\n\n" + "\n".join(lines) + "\n")
    return 0 if same == len(before) else 1


def _torch() -> str:
    import torch
    return str(torch.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
