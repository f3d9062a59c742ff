"""Race consistency: do two configurations come out in the same order every time? (CPU)

The search decides between close configurations by racing them (``estimators.probing._race``: both
built in one probe child, their optimizer steps timed alternately). This measures how often
each way of comparing a pair gives the same verdict, on pairs whose true gap is small:

* probes: the two probed one after the other in separate processes (``estimators.probing._probe``,
  steps=5, warmup=2, as the search probes), ABBA order; the verdict is the ratio of the two
  probes' median step times;
* races: ``estimators.probing._race.race`` with the search's defaults (8 rounds, 2 warm-up steps);
  the verdict is the median of the rounds' ratios;
* two processes (``--lockstep``): each configuration in a process of its own, stepped
  alternately by this script (30 rounds): time-paired like a race, but not in one process;
* alone (``--solo-groups N``): the reference — each configuration trained alone in a fresh
  process for many steps (a probe with ``--solo-steps`` timed steps), in N groups of four
  runs in ABBA order; a group's verdict is the ratio of its two runs' summed median steps.

Each line is (first's step time / second's): above 1, the second is faster. A method whose
verdicts straddle 1 cannot order the pair.

    python benchmarks/race_consistency.py [--models cnn_bn,...] [--repeats 5] [--lockstep]
        [--solo-groups 5] [--solo-steps 36] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from estimators import TrainConfig, load_task  # noqa: E402
from estimators.probing._probe import prestart, probe  # noqa: E402
from estimators.runtime._build import build_for_training  # noqa: E402
from estimators.runtime._planned import PlannedSteps  # noqa: E402
from estimators.probing._race import race  # noqa: E402

MODELS = ROOT / "benchmarks" / "models"
PAIRS = [
    ("gpt_tied", TrainConfig(micro_batch_size=8, grad_accum_steps=4),
     TrainConfig(micro_batch_size=8, grad_accum_steps=4, checkpoint_segments=1)),
    ("cnn_bn", TrainConfig(micro_batch_size=32), TrainConfig(micro_batch_size=16, grad_accum_steps=2)),
    ("mlp", TrainConfig(micro_batch_size=32), TrainConfig(micro_batch_size=32, checkpoint_segments=1)),
]


def probe_pair(path: Path, a: TrainConfig, b: TrainConfig, flip: bool) -> float:
    times = {}
    for c in ((b, a) if flip else (a, b)):
        r = probe(str(path), c, device="cpu", steps=5, warmup=2)
        if not (r.ok and r.estimate and r.estimate.step_time_s):
            raise RuntimeError(f"probe of {c.describe()}: {r.status} {r.message}")
        times[c] = r.estimate.step_time_s
    return times[a] / times[b]


def solo_group(path: Path, a: TrainConfig, b: TrainConfig, steps: int) -> float:
    times: dict[TrainConfig, float] = {a: 0.0, b: 0.0}
    for c in (a, b, b, a):
        r = probe(str(path), c, device="cpu", steps=steps, warmup=4, timeout_s=600)
        if not (r.ok and r.estimate and r.estimate.step_time_s):
            raise RuntimeError(f"probe of {c.describe()}: {r.status} {r.message}")
        times[c] += r.estimate.step_time_s
    return times[a] / times[b]


def _member(path: str, config: TrainConfig, conn) -> None:  # noqa: ANN001 - a Pipe end
    task = load_task(path)
    step = PlannedSteps(task, config, build_for_training(task, config, "cpu"))
    index = 0
    while conn.recv() is not None:
        index += 1
        start = time.perf_counter()
        step(index)
        conn.send(time.perf_counter() - start)


def lockstep(path: Path, a: TrainConfig, b: TrainConfig, rounds: int = 30, warmup: int = 2) -> float:
    ctx = mp.get_context("fork")
    ends, procs = [], []
    for c in (a, b):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_member, args=(str(path), c, theirs))
        p.start()
        ends.append(mine)
        procs.append(p)
    try:
        for _ in range(warmup):
            for end in ends:
                end.send(1)
                end.recv()
        times: list[list[float]] = [[], []]
        for r in range(rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                ends[i].send(1)
                times[i].append(ends[i].recv())
    finally:
        for end in ends:
            end.send(None)
        for p in procs:
            p.join(30)
    return statistics.median(x / y for x, y in zip(*times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lockstep", action="store_true")
    ap.add_argument("--models", default=",".join(name for name, _, _ in PAIRS))
    ap.add_argument("--solo-groups", type=int, default=0)
    ap.add_argument("--solo-steps", type=int, default=36)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "race.md"))
    args = ap.parse_args()
    prestart()
    load = os.getloadavg()
    lines = []
    for name, a, b in PAIRS:
        if name not in args.models.split(","):
            continue
        path = MODELS / f"{name}.py"
        probes, races, locks, solos = [], [], [], []
        t_probe = t_race = 0.0
        for k in range(args.repeats):
            t = time.perf_counter()
            probes.append(probe_pair(path, a, b, flip=k % 2 == 1))
            t_probe += time.perf_counter() - t
            t = time.perf_counter()
            r = race(str(path), (a, b))
            t_race += time.perf_counter() - t
            if not r.ok:
                raise RuntimeError(f"race on {name}: {r.status} {r.message}")
            races.append(r.ratio)
            if args.lockstep:
                locks.append(lockstep(path, a, b))
            print(name, k, f"probes {probes[-1]:.3f} race {races[-1]:.3f}"
                  + (f" lockstep {locks[-1]:.3f}" if locks else ""), flush=True)
        for k in range(args.solo_groups):
            solos.append(solo_group(path, a, b, args.solo_steps))
            print(name, "alone", k, f"{solos[-1]:.3f}", flush=True)
        lines.append((name, a, b, probes, races, locks, solos, t_probe / args.repeats, t_race / args.repeats))

    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        ahead = sum(v > 1 for v in values)
        return (" ".join(f"{v:.3f}" for v in values)
                + f" (second faster in {ahead} of {len(values)})")

    out = ["# Race consistency: the same pair compared again and again (CPU)", "",
           f"Command: `python benchmarks/race_consistency.py --models {args.models} --repeats {args.repeats}"
           + (" --lockstep" if args.lockstep else "")
           + (f" --solo-groups {args.solo_groups} --solo-steps {args.solo_steps}" if args.solo_groups else "") + "`", "",
           f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
           f"- torch {torch.__version__}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
           f"- load average at start: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", "",
           "Each figure is (first's step time / second's): above 1, the second is faster. *probes*: the two probed "
           "one after the other in separate processes (5 timed steps after 2 warm-up steps, alternating which goes "
           "first), ratio of their medians; *race*: one process, steps alternating for 8 rounds, median of the "
           "rounds' ratios; *two processes*: one process per configuration, stepped alternately for 30 rounds; "
           f"*alone* (the reference): each trained alone in a fresh process, {args.solo_steps} timed steps, "
           "groups of four runs in ABBA order, ratio of the summed medians.", "",
           "| model | first | second | probes | race | two processes | alone | wall s per pair of probes / per race |",
           "|---|---|---|---|---|---|---|---|"]
    for name, a, b, probes, races, locks, solos, tp, tr in lines:
        out.append(f"| {name} | {a.describe()} | {b.describe()} | {cell(probes)} | {cell(races)} | {cell(locks)} | "
                   f"{cell(solos)} | {tp:.1f} / {tr:.1f} |")
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
