"""Trainer overhead: ``memplan.train`` against a hand-written loop doing the same work (CPU).

Per model (digits, tiny_gpt) at a fixed configuration (the model's global batch as the
micro-batch, fp32, no accumulation), three variants run INTERLEAVED in one process, round
after round (A, B, C, A, B, C, ...):

* A ``trainer``: ``memplan.train(task, config, TrainOptions(max_steps=N, ...))``, no guard;
* B ``hand loop``: the same model (same seed), optimizer (``task.make_optimizer``, same lr),
  DataLoader (same collate, shuffled, same number of workers), and per step the same math as
  the trainer: zero_grad, forward + loss, backward, ``float(loss)``, clip_grad_norm_(1.0),
  ``float(norm)``, ``optimizer.step()``, zero_grad, a LambdaLR schedule step;
* C ``trainer + guard``: A with ``memory_guard=estimators._guard.MemoryGuard(budget)``.

Step time = time between consecutive step ends (data loading included), the first
``--skip`` steps of each run dropped (warm-up); the median over all rounds is reported.
Trainer step ends are taken by wrapping ``Trainer._after_window`` (timestamp after it
returns), so logging and schedule stepping count as trainer cost. Both A and B use
``num_workers=0`` so they do the same work (the trainer's default for tiny_gpt's custom
Dataset would be 1 worker).

Then ``memplan fit examples/digits.py --vram 1GB --out /tmp/digits-run`` and
``memplan fit examples/tiny_gpt.py --vram 2GB --out /tmp/gpt-run [--max-steps K]`` run as
subprocesses; their wall time and final metrics are reported.

    python benchmarks/trainer_overhead.py [--rounds 3] [--skip-fit] [--gpt-max-steps K] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from estimators import TrainConfig, load_task  # noqa: E402
from estimators._guard import MemoryGuard  # noqa: E402
from memplan import _trainer  # noqa: E402
from memplan._trainer import TrainOptions, train  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "trainer.md"
MODELS = {
    # name: (path, micro-batch, steps per run, guard budget)
    "digits": (ROOT / "examples" / "digits.py", 64, 20, 1_000_000_000),
    "tiny_gpt": (ROOT / "examples" / "tiny_gpt.py", 32, 8, 2_000_000_000),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def diffs(stamps: list[float], skip: int) -> list[float]:
    d = [b - a for a, b in zip(stamps, stamps[1:])]
    return d[skip:]


def run_trainer(task, config, steps: int, guard_budget: int | None, tmp: Path) -> list[float]:
    stamps: list[float] = []
    original = _trainer.Trainer._after_window

    def wrapped(self, window, outcome):
        original(self, window, outcome)
        stamps.append(time.perf_counter())

    _trainer.Trainer._after_window = wrapped
    try:
        out = tmp / f"run-{time.monotonic_ns()}"
        opts = TrainOptions(max_steps=steps, out_dir=out, progress=False, num_workers=0, seed=0)
        guard = MemoryGuard(guard_budget) if guard_budget else None
        # The trainer also starts the clock at the first window: the first diff starts at step 1's end.
        train(task, config, opts, memory_guard=guard)
        shutil.rmtree(out, ignore_errors=True)
    finally:
        _trainer.Trainer._after_window = original
    return stamps


def run_hand(task, config, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = task.build_model()
    model.train()
    opt = task.make_optimizer(model)
    lr = task.settings.get("lr")
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = float(lr)
    total = steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    loader = DataLoader(task.dataset(), batch_size=config.micro_batch_size, shuffle=True, collate_fn=task.collate,
                        num_workers=0, generator=torch.Generator().manual_seed(0), drop_last=True)
    stamps: list[float] = []
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        opt.zero_grad(set_to_none=True)
        with contextlib.nullcontext():  # fp32: no autocast
            loss = task.compute_loss(model, batch)
        loss.backward()
        loss_value = float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        del batch, loss
        stamps.append(time.perf_counter())
        _ = (loss_value, norm)
    return stamps


def overhead_section(names, rounds: int, skip: int) -> tuple[list[str], dict]:
    tmp = Path(tempfile.mkdtemp(prefix="memplan-trainer-bench-"))
    lines = []
    summary = {}
    for name in names:
        path, micro, steps, budget = MODELS[name]
        task = load_task(str(path))
        config = TrainConfig(micro_batch_size=micro, precision="fp32")
        per = {"trainer": [], "hand": [], "trainer+guard": []}
        per_round = {k: [] for k in per}
        for r in range(rounds):
            for variant in ("trainer", "hand", "trainer+guard"):
                if variant == "trainer":
                    st = run_trainer(task, config, steps, None, tmp)
                elif variant == "hand":
                    st = run_hand(task, config, steps)
                else:
                    st = run_trainer(task, config, steps, budget, tmp)
                d = diffs(st, skip)
                per[variant] += d
                per_round[variant].append(statistics.median(d) if d else float("nan"))
                log(f"[{name}] round {r + 1} {variant}: median step {per_round[variant][-1] * 1e3:.1f} ms (n={len(d)})")
        med = {k: statistics.median(v) for k, v in per.items() if v}
        ovh = 100 * (med["trainer"] / med["hand"] - 1)
        guard = 100 * (med["trainer+guard"] / med["trainer"] - 1)
        # Paired per round (A and B adjacent in time), a load-robust view.
        paired = [100 * (a / b - 1) for a, b in zip(per_round["trainer"], per_round["hand"])]
        summary[name] = {"med": med, "overhead_pct": ovh, "guard_pct": guard, "paired": paired}
        lines += [f"### {name} (micro-batch {micro}, fp32, {steps} steps per run, first {skip} dropped, {rounds} rounds)", "",
                  "| variant | median step ms (pooled) | per-round medians ms |", "|---|---|---|"]
        for k in per:
            lines.append(f"| {k} | {med[k] * 1e3:.1f} | {', '.join(f'{x * 1e3:.1f}' for x in per_round[k])} |")
        lines += ["", f"- trainer vs hand loop: **{ovh:+.1f}%** (goal <= 3%); per-round paired: "
                      f"{', '.join(f'{p:+.1f}%' for p in paired)} (median {statistics.median(paired):+.1f}%)",
                  f"- memory guard cost (trainer+guard vs trainer): **{guard:+.1f}%** (budget {budget / 1e9:.0f} GB)", ""]
    shutil.rmtree(tmp, ignore_errors=True)
    return lines, summary


def run_fit(model: str, vram: str, out: str, extra: list[str]) -> tuple[list[str], dict]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [shutil.which("memplan") or "memplan", "fit", model, "--vram", vram, "--out", out, *extra]
    shown = f"memplan fit {model} --vram {vram} --out {out}" + (" " + " ".join(extra) if extra else "")
    env = dict(os.environ)
    env["MEMPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="memplan-fit-bench-")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    info = {"cmd": shown, "rc": proc.returncode, "wall_s": wall}
    summ = Path(out) / "summary.json"
    if summ.is_file():
        info["summary"] = json.loads(summ.read_text())
    lines = [f"`{shown}` (fresh MEMPLAN_CACHE_DIR): "
             f"exit {proc.returncode}, wall {wall:.1f} s"]
    s = info.get("summary", {})
    if s:
        keys = ("final_metrics", "best_metric", "steps", "wall_s", "config", "peak_memory_bytes",
                "measured_peak_bytes", "predicted_peak_bytes", "target", "target_reached")
        for k in keys:
            if k in s:
                lines.append(f"- {k}: `{json.dumps(s[k])}`")
        if not any(k in s for k in ("config",)):
            lines.append(f"- summary keys: {sorted(s)}")
    if proc.returncode != 0:
        lines.append(f"- stderr tail: `{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}`")
    tail = [l for l in proc.stdout.strip().splitlines() if l.strip()][-12:]
    lines += ["", "```", *tail, "```", ""]
    return lines, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="digits,tiny_gpt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--gpt-max-steps", default=None)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    load_start = os.getloadavg()
    outp = Path(args.out)

    def head(done: bool) -> list[str]:
        la = os.getloadavg()
        h = ["# Trainer overhead and end-to-end fits (CPU)", "", f"Command: `{cmd}`", "",
             f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- torch {torch.__version__}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
             f"- load average (1/5/15 min) at start: {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}",
             f"- load average at end (or at this write): {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}", ""]
        if not done:
            h += ["**PARTIAL: the run had not finished when this was written.**", ""]
        return h

    body: list[str] = []
    if not args.skip_overhead:
        lines, _ = overhead_section(args.models.split(","), args.rounds, args.skip)
        body += ["## Step time: trainer vs hand-written loop (interleaved)", "", *lines]
        outp.write_text("\n".join(head(False) + body) + "\n")
    if not args.skip_fit:
        body += ["## memplan fit", ""]
        lines, _ = run_fit("examples/digits.py", "1GB", "/tmp/digits-run", [])
        body += ["### digits (goal: val_accuracy >= 0.97 in < 2 min)", "", *lines]
        outp.write_text("\n".join(head(False) + body) + "\n")
        extra = ["--max-steps", args.gpt_max_steps] if args.gpt_max_steps else []
        lines, _ = run_fit("examples/tiny_gpt.py", "2GB", "/tmp/gpt-run", extra)
        body += ["### tiny_gpt (settings: max_steps 300, target val_loss <= 2.0)", "", *lines]
    outp.write_text("\n".join(head(True) + body) + "\n")
    log(f"wrote {outp}")


if __name__ == "__main__":
    main()
