"""Trainer overhead: ``memplan.train`` against a hand-written loop doing the same work (CPU).

Per model (digits, tiny_gpt) at a fixed configuration (the model's global batch as the
micro-batch, fp32, no accumulation), three variants run INTERLEAVED in one process, round
after round, the order reversed every other round (A B C, C B A, ...) so that a drift in load
hits every variant alike:

* A ``trainer``: ``memplan.train(task, config, TrainOptions(max_steps=N, ...))``, no guard,
  with ``checkpoint_every=N`` (the checkpoint comes after the last measured step) and the
  task's validation data removed (the hand loop evaluates nothing; tiny_gpt's evaluation
  would add ~7 s a run after the measured steps and only lengthen the benchmark);
* B ``hand loop``: what a careful hand-written loop does per step, the trainer's per-step work
  and no more: the same model (same seed), optimizer (``task.make_optimizer``, same lr) and
  DataLoader (same dataset, collate, shuffled, ``drop_last=False`` -- the trainer's last
  window of an epoch is short too --, same number of workers); per step zero_grad, forward +
  loss, backward, ``float(loss)``, clip_grad_norm_(1.0), ``float(norm)``, a NaN/inf check of
  both, ``optimizer.step()``, zero_grad, a warm-up + cosine LambdaLR step, and one JSON line
  (step, epoch, loss, lr, samples/s, grad norm) written to a metrics file;
* C ``trainer + guard``: A with ``memory_guard=estimators.runtime._guard.MemoryGuard(budget)``.

Both A and B use ``num_workers=0`` (the trainer's default for tiny_gpt's custom Dataset
would be 1 worker). Step time = time between consecutive step ends (data loading included);
trainer step ends are taken by wrapping ``Trainer._after_window`` (timestamp after it
returns), so logging, schedule stepping and the loop's own checks count as trainer cost.
Each run's value is its MEAN step time after the first ``--skip`` steps (warm-up): periodic
costs (the batched metrics writes, epoch boundaries) count at their amortised price. The
overhead is the per-round paired ratio A/B (adjacent in time, so robust to load that comes
and goes); the median over rounds is reported with its interquartile range. One unrecorded
warm-up run of each variant comes first. The 1-minute load average is recorded per round.

Then ``memplan fit examples/digits.py --vram 1GB --out /tmp/digits-run`` and
``memplan fit examples/tiny_gpt.py --vram 2GB --out /tmp/gpt-run [--max-steps K]`` run as
subprocesses; their wall time and final metrics are reported. The overhead part takes about
about 9 minutes on a 2-core CPU, the fits about 8 more.

    python benchmarks/trainer_overhead.py [--rounds-digits 24] [--rounds-gpt 10] [--skip-fit]
        [--skip-overhead] [--models digits,tiny_gpt] [--gpt-max-steps K] [--threads N]
        [--wait-load L [--wait-max S]] [--out FILE]

On a shared 2-core machine, another busy process makes two-thread torch steps several times
slower and wildly variable (threads wait for each other): ``--wait-load 1.5`` waits for a
quieter moment first.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from estimators import TrainConfig, load_task  # noqa: E402
from estimators.runtime._guard import MemoryGuard  # noqa: E402
from memplan.training import _trainer  # noqa: E402
from memplan.training import TrainOptions, train  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "trainer.md"
MODELS = {
    # name: (path, micro-batch, steps per run, guard budget, lockstep (chunk, chunks, runs)).
    # digits: 100 steps (~1.2 s, four epochs with short last windows) so that the trainer's
    # once-a-second log write is inside the measured steps; tiny_gpt: 12 steps (~7 s) a run.
    "digits": (ROOT / "examples" / "digits.py", 64, 100, 1_000_000_000, (10, 20, 6)),
    "tiny_gpt": (ROOT / "examples" / "tiny_gpt.py", 32, 12, 2_000_000_000, (1, 10, 4)),
}
VARIANTS = ("trainer", "hand", "trainer+guard")
WORK = [
    "Per step both do: load a micro-batch through a DataLoader (same dataset and collate, shuffled, "
    "num_workers=0, short last batch of an epoch), zero_grad, forward + loss, backward, `float(loss)`, "
    "`clip_grad_norm_(1.0)`, `float(norm)`, a NaN/inf check, `optimizer.step()`, zero_grad, a warm-up + "
    "cosine lr step, and a JSON metrics line (the hand loop writes it through Python's file buffer; the "
    "trainer queues it and writes at most a second later, at checkpoints and at the end). The trainer "
    "also keeps its data position, counters and throughput, checks for a stop signal, and reads its "
    "peak-memory counter. The trainer runs without validation data (no evaluation) and with its "
    "checkpoint after the last measured step.",
    "",
    "Each run's value is its mean step time (step end to step end, warm-up steps dropped); the overhead is "
    "the median over rounds of the per-round paired ratio trainer / hand loop, which ran next to each other "
    "(order reversed every other round).",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mean_step(stamps: list[float], skip: int) -> float:
    """Mean time between consecutive step ends, the first ``skip`` intervals dropped."""
    return (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip)


def median_ci(xs: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: order statistics ``k`` and
    ``n + 1 - k`` with ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2``."""
    xs, n = sorted(xs), len(xs)
    tail, k = 0.0, 0
    while k < n and tail + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k >= 1 else (xs[0], xs[-1])


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def run_trainer(task, config, steps: int, guard_budget: int | None, tmp: Path) -> list[float]:
    stamps: list[float] = []
    original = _trainer.Trainer._after_window

    def wrapped(self, window, outcome):
        original(self, window, outcome)
        stamps.append(time.perf_counter())

    _trainer.Trainer._after_window = wrapped
    try:
        out = tmp / f"run-{time.monotonic_ns()}"
        opts = TrainOptions(max_steps=steps, out_dir=out, progress=False, num_workers=0, seed=0,
                            checkpoint_every=steps)
        guard = MemoryGuard(guard_budget) if guard_budget else None
        train(task, config, opts, memory_guard=guard)
        shutil.rmtree(out, ignore_errors=True)
    finally:
        _trainer.Trainer._after_window = original
    return stamps


def run_hand(task, config, steps: int, tmp: Path) -> list[float]:
    gen = hand_steps(task, config, steps, tmp)
    next(gen)  # set up
    return list(gen)


def hand_steps(task, config, steps: int, tmp: Path) -> Iterator[float | None]:
    """The hand-written loop: yields None once set up, then each step's end time."""
    torch.manual_seed(0)
    model = task.build_model()
    model.train()
    opt = task.make_optimizer(model)
    lr = task.settings.get("lr")
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = float(lr)
    warmup, total = int(task.settings.get("warmup_steps", 0)), steps

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(max((s - warmup) / max(1, total - warmup), 0.0), 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    loader = DataLoader(task.dataset(), batch_size=config.micro_batch_size, shuffle=True, collate_fn=task.collate,
                        num_workers=0, generator=torch.Generator().manual_seed(0), drop_last=False)
    epoch, it = 0, iter(loader)
    with open(tmp / f"hand-{time.monotonic_ns()}.jsonl", "w") as metrics:
        yield None
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                epoch, it = epoch + 1, iter(loader)
                batch = next(it)
            opt.zero_grad(set_to_none=True)
            loss = task.compute_loss(model, batch)
            loss.backward()
            n = len(batch[0])
            del batch
            loss_value = float(loss.detach())
            del loss
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            step_lr = sched.get_last_lr()[0]
            if math.isfinite(loss_value) and math.isfinite(norm):
                opt.step()
                sched.step()
            opt.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            metrics.write(json.dumps({"type": "step", "step": step, "epoch": epoch, "loss": loss_value, "lr": step_lr,
                                      "samples_per_s": n / seconds, "grad_norm": norm}) + "\n")
            yield time.perf_counter()


def run_lockstep(task, config, chunk: int, chunks: int, tmp: Path) -> list[tuple[float, float]]:
    """The trainer and the hand loop taking turns, ``chunk`` steps each, inside one trainer run
    (the hand loop's steps run from the trainer's step-end hook): pairs of chunks a fraction
    of a second apart, so that load which comes and goes hits both alike. Returns
    ``(trainer chunk s, hand chunk s)`` per turn; the first turn (one step each) is warm-up.
    The trainer's chunk is everything from the end of the hand's chunk to the end of its own
    ``chunk``-th step; the hand's chunk is its ``chunk`` steps."""
    hand = hand_steps(task, config, 1 + chunk * chunks, tmp)
    next(hand)  # set up before the trainer starts
    pairs: list[tuple[float, float]] = []
    state = {"steps": 0, "mark": 0.0}
    original = _trainer.Trainer._after_window

    def wrapped(self, window, outcome):
        original(self, window, outcome)
        now = time.perf_counter()
        state["steps"] += 1
        i = state["steps"]
        if i == 1 or (i - 1) % chunk == 0:
            trainer_s = now - state["mark"]
            h0 = time.perf_counter()
            for _ in range(1 if i == 1 else chunk):
                next(hand)
            hand_s = time.perf_counter() - h0
            if i > 1:
                pairs.append((trainer_s, hand_s))
            state["mark"] = time.perf_counter()

    _trainer.Trainer._after_window = wrapped
    try:
        out = tmp / f"lock-{time.monotonic_ns()}"
        opts = TrainOptions(max_steps=1 + chunk * chunks, out_dir=out, progress=False, num_workers=0, seed=0,
                            checkpoint_every=1 + chunk * chunks)
        train(task, config, opts)
        shutil.rmtree(out, ignore_errors=True)
    finally:
        _trainer.Trainer._after_window = original
        hand.close()
    return pairs


def overhead_section(names, rounds_of: dict[str, int], skip: int) -> tuple[list[str], dict]:
    tmp = Path(tempfile.mkdtemp(prefix="memplan-trainer-bench-"))
    lines = []
    summary = {}
    for name in names:
        path, micro, steps, budget, (chunk, chunks, lock_runs) = MODELS[name]
        rounds = rounds_of[name]
        # No validation data: no evaluation, which the hand loop does not do either.
        task = dataclasses.replace(load_task(str(path)), val_data=None)
        config = TrainConfig(micro_batch_size=micro, precision="fp32")

        def run(variant: str, n: int) -> list[float]:
            if variant == "trainer":
                return run_trainer(task, config, n, None, tmp)
            if variant == "hand":
                return run_hand(task, config, n, tmp)
            return run_trainer(task, config, n, budget, tmp)

        for variant in VARIANTS:  # warm-up: lazy imports, first-time kernel set-up
            run(variant, skip + 2)
        per_round: dict[str, list[float]] = {k: [] for k in VARIANTS}
        loads: list[float] = []
        t_model = time.perf_counter()
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                per_round[variant].append(mean_step(run(variant, steps), skip))
            log(f"[{name}] round {r + 1}/{rounds} (load {loads[-1]:.2f}): "
                + ", ".join(f"{k} {per_round[k][-1] * 1e3:.2f} ms" for k in VARIANTS)
                + f"; trainer/hand {100 * (per_round['trainer'][-1] / per_round['hand'][-1] - 1):+.1f}%")
        lock: list[float] = []
        for _ in range(lock_runs):
            lock += [100 * (t / h - 1) for t, h in run_lockstep(task, config, chunk, chunks, tmp)[1:]]
        log(f"[{name}] lockstep: {len(lock)} pairs, median trainer/hand {statistics.median(lock):+.2f}%")
        minutes = (time.perf_counter() - t_model) / 60
        paired = [100 * (a / b - 1) for a, b in zip(per_round["trainer"], per_round["hand"])]
        guard = [100 * (a / b - 1) for a, b in zip(per_round["trainer+guard"], per_round["trainer"])]
        pq, gq, lq = quartiles(paired), quartiles(guard), quartiles(lock)
        pci, lci = median_ci(paired), median_ci(lock)
        slower = sum(p > 0 for p in paired)
        summary[name] = {"per_round": per_round, "paired_pct": paired, "guard_pct": guard, "loads": loads,
                         "lockstep_pct": lock}
        lines += [f"### {name} (micro-batch {micro}, fp32, {steps} steps per run, first {skip} dropped, "
                  f"{rounds} rounds, {minutes:.1f} min)", "",
                  "| variant | mean step ms, median over rounds | interquartile range ms |", "|---|---|---|"]
        for k in VARIANTS:
            q1, q2, q3 = quartiles(per_round[k])
            lines.append(f"| {k} | {q2 * 1e3:.2f} | {q1 * 1e3:.2f} - {q3 * 1e3:.2f} |")
        lines += ["",
                  f"- **trainer vs hand loop: {pq[1]:+.1f}%** (median of the {rounds} per-round paired ratios; "
                  f"95% confidence interval of the median {pci[0]:+.1f}% .. {pci[1]:+.1f}%; interquartile range "
                  f"{pq[0]:+.1f}% .. {pq[2]:+.1f}%, min {min(paired):+.1f}%, max {max(paired):+.1f}%; "
                  f"trainer slower in {slower} of {rounds} rounds). Goal: <= +3%.",
                  f"- **lockstep, trainer vs hand loop: {lq[1]:+.1f}%** (median of {len(lock)} paired turns of {chunk} "
                  f"step{'s' if chunk > 1 else ''} each, taking turns inside {lock_runs} trainer runs of "
                  f"{1 + chunk * chunks} steps, the first turn of each dropped; 95% confidence interval of the median {lci[0]:+.1f}% .. {lci[1]:+.1f}%; "
                  f"interquartile range {lq[0]:+.1f}% .. {lq[2]:+.1f}%)",
                  f"- memory guard cost (trainer+guard vs trainer): **{gq[1]:+.1f}%** "
                  f"(interquartile range {gq[0]:+.1f}% .. {gq[2]:+.1f}%; budget {budget / 1e9:.0f} GB)",
                  f"- 1-minute load average at the start of each round (this benchmark's own threads count "
                  f"too): median {statistics.median(loads):.2f}, min {min(loads):.2f}, max {max(loads):.2f}",
                  f"- per-round paired trainer/hand: {', '.join(f'{p:+.1f}%' for p in paired)}", ""]
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
    ap.add_argument("--rounds-digits", type=int, default=24)
    ap.add_argument("--rounds-gpt", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--gpt-max-steps", default=None)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--wait-load", type=float, default=None, metavar="L",
                    help="first wait (up to --wait-max seconds) until the 1-minute load average is below L")
    ap.add_argument("--wait-max", type=float, default=900.0)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    waited = 0.0
    if args.wait_load is not None:
        t_wait = time.perf_counter()
        while os.getloadavg()[0] >= args.wait_load and time.perf_counter() - t_wait < args.wait_max:
            log(f"load {os.getloadavg()[0]:.2f} >= {args.wait_load}: waiting")
            time.sleep(20)
        waited = time.perf_counter() - t_wait
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    load_start = os.getloadavg()
    outp = Path(args.out)

    def head(done: bool) -> list[str]:
        la = os.getloadavg()
        h = ["# Trainer overhead and end-to-end fits (CPU)", "", f"Command: `{cmd}`", "",
             f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- torch {torch.__version__}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
             f"- load average (1/5/15 min) at start: {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}",
             f"- load average at end (or at this write): {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}"]
        if args.wait_load is not None:
            h.append(f"- waited {waited:.0f} s for the 1-minute load to drop below {args.wait_load}")
        h.append("")
        if not done:
            h += ["**PARTIAL: the run had not finished when this was written.**", ""]
        return h

    body: list[str] = []
    if not args.skip_overhead:
        rounds = {"digits": args.rounds_digits, "tiny_gpt": args.rounds_gpt}
        lines, _ = overhead_section(args.models.split(","), rounds, args.skip)
        body += ["## Step time: trainer vs hand-written loop (interleaved)", "", *WORK, "", *lines]
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
