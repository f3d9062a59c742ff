"""Races: two configurations timed step against step in one process.

Two probes of the same configuration, a few seconds apart, can measure 20-40% apart on a
shared machine: the machine's speed drifts over seconds (other tenants, the host), while the
steps of one probe agree to a few percent. Two configurations probed one after the other are
therefore compared across that drift, and a true 5-10% difference can come out reversed.

A race takes the drift out of the comparison. One child process (a probe child, forked by the
same server) builds both configurations — a model, optimizer and, for fp16, a GradScaler
each —, runs ``warmup`` optimizer steps of each, then ``rounds`` rounds of one optimizer step
of each, alternating which goes first (ABBA…), so that each pair of steps sees the same
machine a fraction of a second apart, in the same process. The comparison is the median over
the rounds of the two steps' ratio.

A race measures time only: the two configurations are alive together, so memory is the
probes' business, and a race runs without a memory budget. On cuda the two must fit on the
device together; the search races a pair only if their measured peaks fit in the free memory
together, and a race that runs out of memory all the same says so (status ``oom``).

Measured on this 2-core machine (``benchmarks/race_consistency.py``, results in
``benchmarks/results/race.md``), 5 comparisons of each pair:

* gpt_tied, micro-batch 8 x4, plain against one checkpoint segment: races put plain ahead 5
  times in 5 (by 4-12%), and so did the two configurations stepped alternately in two
  processes (7-10%); separate probes 4 times in 5;
* cnn_bn, micro-batch 32 against 16 x2: races put 16 x2 ahead 4 times in 5 (up to 12%), two
  processes put 32 ahead 5 times in 5 (5-16%), separate probes put 16 x2 ahead 3 times in 5.
  Trained alone (fresh processes of 36 timed steps, ABBA; ``--solo-groups``,
  ``benchmarks/results/race_alone.md``) the two came within 6% of each other, either way
  (earlier such runs: 32 ahead by ~13% in 4 groups of 5): a near tie that no method here
  orders reliably, and a race may carry a bias of a few percent from sharing one process;
* mlp, micro-batch 32 plain against one checkpoint segment: races, two processes and probes
  put plain ahead 4 times in 5.

A race of two ~0.2 s steps costs 4-5 s here, a pair of probes 6 s.

Example:
    >>> r = race("examples/digits.py", (TrainConfig(micro_batch_size=64),
    ...                                  TrainConfig(micro_batch_size=8, grad_accum_steps=8)))  # doctest: +SKIP
    >>> r.status, r.ratio > 1   # the first's steps take longer than the second's?       # doctest: +SKIP
    ('ok', False)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._config import TrainConfig
from .._errors import ConfigError
from ..task._task import Task
from ._messages import Reply, Request
from ._probe import Prober, check_warmup_and_timeout

__all__ = ["RaceResult", "race"]


@dataclass(frozen=True, kw_only=True)
class RaceResult:
    """The outcome of a race between two configurations.

    ``step_times[i]`` are the timed optimizer steps of ``configs[i]`` (seconds, one per
    round); empty unless ``status`` is ``ok``. ``message`` explains any other status in one
    line, as for a probe.
    """

    status: str
    configs: tuple[TrainConfig, TrainConfig]
    step_times: tuple[tuple[float, ...], ...] = ()
    message: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok" and len(self.step_times) == 2 and bool(self.step_times[0])

    def median_step_s(self, index: int) -> float:
        """The median step time of ``configs[index]``."""
        return statistics.median(self.step_times[index])

    @property
    def ratio(self) -> float:
        """Median over the rounds of (first's step time / second's): above 1, the second is
        faster."""
        return statistics.median(a / b for a, b in zip(*self.step_times))

    @property
    def second_wins(self) -> int:
        """Rounds in which the second configuration's step was the faster."""
        return sum(1 for a, b in zip(*self.step_times) if b < a)


def check_race_args(configs: Sequence[TrainConfig], rounds: int, warmup: int,
                    timeout_s: float, compiled: tuple[bool, bool] | None = None) -> tuple[TrainConfig, TrainConfig]:
    pair = tuple(configs)
    if len(pair) != 2 or not all(isinstance(c, TrainConfig) for c in pair):
        raise ConfigError("a race needs exactly two TrainConfigs")
    if compiled is not None and (len(compiled) != 2 or not all(isinstance(c, bool) for c in compiled)):
        raise ConfigError(f"compiled must be two booleans (one per configuration), got {compiled!r}")
    if pair[0] == pair[1] and (compiled is None or compiled[0] == compiled[1]):
        raise ConfigError(f"a race needs two different configurations; both are {pair[0].describe()}")
    for c in pair:
        if c.strategy != "single":
            raise ConfigError(f"races run one process (strategy single); got strategy {c.strategy!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be a whole number >= 1, got {rounds!r}")
    check_warmup_and_timeout(warmup, timeout_s)
    return pair[0], pair[1]


def race(task_ref: Task | str | os.PathLike[str], configs: Sequence[TrainConfig], *, device: str = "cpu",
         rounds: int = 8, warmup: int = 2, timeout_s: float = 120,
         compiled: tuple[bool, bool] | None = None, guard_bytes: int | None = None) -> RaceResult:
    """Time ``configs[0]`` against ``configs[1]``, step against step, in one child process.

    Args:
        task_ref: As for :func:`~estimators.probing._probe.probe`.
        configs: Two different single-device configurations.
        device: ``cpu`` or ``cuda``.
        rounds: Timed rounds; each times one optimizer step of each configuration.
        warmup: Un-timed optimizer steps of each before the rounds.
        timeout_s: Wall-clock limit of the whole race, process start included.
        compiled: Whether each side's forward runs through ``torch.compile`` (default: as the
            task's ``step.compile``); one configuration eager against itself compiled is a race.
        guard_bytes: On cpu, build and step both under one
            :class:`~estimators.runtime._guard.MemoryGuard` of this budget, as the CPU trainer
            runs: its dispatch mode changes what ``torch.compile`` captures (nearly nothing).

    Returns:
        A :class:`RaceResult`; what happens in the child never raises here.
    """
    pair = check_race_args(configs, rounds, warmup, timeout_s, compiled)
    prober = Prober(task_ref, device=device)
    request = prober.request(kind="race", configs=[c.to_dict() for c in pair], rounds=rounds, warmup=warmup,
                             compiled=list(compiled) if compiled is not None else None, guard_bytes=guard_bytes)
    names = [c.describe() + (" compiled" if compiled and compiled[i] else "") for i, c in enumerate(pair)]
    what = f"{names[0]} against {names[1]}"
    status, message, reply, wall = prober.exchange(request, timeout_s, what)
    times = tuple(tuple(float(t) for t in ts) for ts in reply.get("step_times", ())) if reply else ()
    return RaceResult(status=status, configs=pair, step_times=times if status == "ok" else (),
                      message=message, wall_s=wall)


# --------------------------------------------------------------------------- the child side

def serve_race(task: Task, msg: Request) -> Reply:
    """The probe server's handler of a race request."""
    return run_race(task, [TrainConfig.from_dict(c) for c in msg["configs"]], device=msg["device"],
                    rounds=msg["rounds"], warmup=msg["warmup"], compiled=msg.get("compiled"),
                    guard_bytes=msg.get("guard_bytes"))


def run_race(task: Task, configs: list[TrainConfig], *, device: str, rounds: int, warmup: int,
             compiled: Sequence[bool] | None = None, guard_bytes: int | None = None) -> Reply:
    """In the probe child: build both configurations, warm them up, time the rounds."""
    import contextlib

    import torch

    from ..runtime._guard import MemoryGuard

    cpu = torch.device(device).type == "cpu"
    task.batch_template()  # the dataset is built outside the guard, as the trainer builds it
    with MemoryGuard(guard_bytes) if guard_bytes is not None and cpu else contextlib.nullcontext():
        return _race_steps(task, configs, device=device, rounds=rounds, warmup=warmup, compiled=compiled)


def _race_steps(task: Task, configs: list[TrainConfig], *, device: str, rounds: int, warmup: int,
                compiled: Sequence[bool] | None) -> Reply:
    import torch

    from ..runtime._build import build_for_training
    from ..runtime._planned import PlannedSteps

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is not None:
        torch.cuda.set_device(dev)
    task.batch_template()  # the dataset is built outside the timed steps
    flags = list(compiled) if compiled is not None else [task.step.compile] * len(configs)
    steppers = [PlannedSteps(task, config, build_for_training(task, config, dev, compile=flag), device=dev)
                for config, flag in zip(configs, flags)]
    t0 = time.monotonic()
    index = 0
    for _ in range(warmup):
        index += 1
        for step in steppers:
            step(index)
    times: list[list[float]] = [[] for _ in steppers]
    for r in range(rounds):
        index += 1
        # ABBA: a step that follows the other configuration's (its caches, its allocator
        # state) is first half the time.
        order = range(len(steppers)) if r % 2 == 0 else reversed(range(len(steppers)))
        for i in order:
            if cuda:
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            steppers[i](index)
            if cuda:
                torch.cuda.synchronize(dev)
            times[i].append(time.perf_counter() - start)
    return {"status": "ok", "message": "", "step_times": times, "steps_s": time.monotonic() - t0}
