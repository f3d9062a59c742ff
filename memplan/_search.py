"""``memplan.search``: the fastest configuration that fits the memory budget.

An Optuna study over the space. Every trial gets the static estimate (cached per
configuration: a resumed or repeated configuration is never re-estimated); the budget is a
constraint (``trial.set_constraint``, ≤ 0 feasible) with a safety margin, so an infeasible
configuration is a *completed* infeasible trial the sampler learns from, never a FAIL. When
the space is small the study enumerates it (``BruteForceSampler``), else a seeded TPE sampler
explores it. Afterwards the best few feasible configurations are probed on the real device
(when planning for the device at hand): the two best are raced step against step
(``estimators.probing._race``), a race won along one axis (micro-batch, checkpoint segments) is
followed a step or two further, and the winner's memory is probed; measured times refit the
time model, an OOM marks the configuration infeasible, and the final ranking prefers
measured figures. Where no race can run, each is probed on its own.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
import torch
import torch.nn as nn

from estimators import (
    ConfigError, Estimate, Estimator, MemplanError, NoFeasiblePlanError, Task, TrainConfig, format_size,
    load_task, parse_size,
)
from estimators.runtime._checkpoint import max_checkpoint_segments
from estimators._config import Precision

from ._plan import RACED_NOTE, Plan, PlanEntry, provenance
from ._failures import Failures as _Failures, summarize_failures
from ._space import SearchSpace, build_space, layouts_for
from ._study import MirroredStudy

__all__ = ["search", "resolve_task", "estimator_for", "default_budget", "default_storage"]

ProbeFn = Callable[[Task, TrainConfig, int], Any]
# (task, (predicted best or a race's winner, its rival)) -> an estimators.probing._race.RaceResult
RaceFn = Callable[[Task, tuple[TrainConfig, TrainConfig]], Any]


_ESTIMATORS: "weakref.WeakKeyDictionary[Task, dict[tuple[str | None, str | None], Estimator]]" = weakref.WeakKeyDictionary()


def estimator_for(task: Task, *, device: str | None, gpu: str | None) -> Estimator:
    """One estimator per task and target, kept while the task lives: searching the same task
    again (another budget, another global batch) reuses its traces."""
    per_task = _ESTIMATORS.setdefault(task, {})
    key = (device, gpu)
    if key not in per_task:
        per_task[key] = Estimator(task, device=device, gpu=gpu)
    return per_task[key]


def resolve_task(model: Task | str | os.PathLike[str] | nn.Module, sample: Any = None, **module_parts: Any) -> Task:
    """The task of a model file, a ``Task``, or an ``nn.Module`` with ``sample`` and/or the
    ``module_parts`` of :meth:`Task.from_module` (``loss``, ``optimizer``, ``train_data``,
    ``val_data``, ``collate``, ``settings``)."""
    parts = {k: v for k, v in module_parts.items() if v is not None}
    if isinstance(model, Task):
        if sample is not None or parts:
            raise ConfigError(f"{', '.join(['sample', *parts])} go with an nn.Module; a Task carries its own")
        return model
    if isinstance(model, nn.Module):
        if sample is None and parts.get("train_data") is None:
            raise ConfigError(f"search({type(model).__name__}) needs batches: pass sample= (a batch, or a callable "
                              "batch_size -> batch) or train_data= (a Dataset)")
        return Task.from_module(model, sample, **parts)
    if sample is not None or parts:
        raise ConfigError(f"{', '.join(['sample', *parts])} go with an nn.Module; a model file defines its own "
                          "(loss(), optimizer(), train_data(), ...)")
    return load_task(model)


def default_budget(estimator: Estimator) -> tuple[int, str]:
    """The budget when --vram is not given, and where it came from."""
    if estimator.device == "cuda":
        if torch.cuda.is_available() and _local_matches(estimator):
            free, _total = torch.cuda.mem_get_info()
            return int(free), "free memory of the local GPU"
        assert estimator.spec is not None
        return estimator.spec.memory_bytes, f"memory of {estimator.spec.name}"
    # CPU: half of what the machine has available now, so the OS and other work keep room.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2, "half of the available RAM"
    except OSError:
        pass
    return 8 * 10**9, "a default of 8 GB"


def _local_matches(estimator: Estimator) -> bool:
    from estimators import detect_local_gpu
    local = detect_local_gpu()
    return local is not None and estimator.spec is not None and local.name == estimator.spec.name


def default_storage() -> str:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memplan")
    Path(root).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{os.path.join(root, 'studies.db')}"


def _precisions(estimator: Estimator, wanted: Sequence[str] | None) -> tuple[Precision, ...]:
    if estimator.device == "cuda":
        supported: list[Precision] = ["fp32", "fp16-mixed"]
        if estimator.spec is not None and estimator.spec.bf16:
            supported.append("bf16-mixed")
    else:
        # fp16 autocast runs ~50x slower than bf16 on CPUs: never the fastest, so not searched.
        supported = ["fp32", "bf16-mixed"]
    if wanted is None:
        if "bf16-mixed" in supported and "fp16-mixed" in supported:
            # Where the card has bf16, fp16 runs at the same tensor-core rate with the same
            # two-byte activations, plus a GradScaler's unscale and inf checks every step: it
            # is never the faster plan, so it is searched only when asked for (--precision).
            return tuple(p for p in supported if p != "fp16-mixed")
        return tuple(supported)
    from estimators import normalize_precision
    chosen = tuple(normalize_precision(p) for p in wanted)
    refused = [p for p in chosen if p not in supported]
    if refused:
        raise ConfigError(f"precision {', '.join(refused)} is not available on {estimator.spec.name if estimator.spec else estimator.device}; choose from {', '.join(supported)}")
    return chosen


def _study_name(task: Task, estimator: Estimator, budget: int, margin: float, space: SearchSpace) -> str:
    key = "|".join(str(x) for x in (
        task.source_hash or task.name, estimator.device, estimator.spec.name if estimator.spec else "",
        budget, margin, space.global_batch, space.micro_batch_sizes, space.precisions,
        space.checkpoint_segments, tuple(layout.key for layout in space.layouts), torch.__version__,
        # Only a non-default policy names itself, so that existing studies keep their names.
        *((task.shape_policy,) if task.shape_policy != "max" else ()),
        *((space.grouping,) if space.grouping != (False,) else ()),
    ))
    return f"memplan-{task.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def search(
    model: Task | str | os.PathLike[str] | nn.Module,
    *,
    vram: int | str | None = None,
    sample: Any = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    train_data: Any = None,
    global_batch: int | None = None,
    device: str | None = None,
    gpu: str | None = None,
    trials: int = 60,
    probe_top: int = 2,
    seed: int | None = 0,
    storage: str | None = None,
    margin: float = 0.10,
    precisions: Sequence[str] | None = None,
    max_micro_batch: int | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpoint_segments: Sequence[int] | None = None,
    progress: bool = False,
    probe_fn: ProbeFn | None = None,
    race_fn: RaceFn | None = None,
    gpus: int = 1,
    nodes: int = 1,
    strategies: Sequence[str] | None = None,
    plot: str | os.PathLike[str] | None = None,
    shape_policy: str = "max",
) -> Plan:
    """Search the configuration space and return the ranked :class:`Plan`.

    ``model`` is a model-file path, a :class:`Task`, or an ``nn.Module`` with ``sample`` (a
    batch, or a callable ``batch_size -> batch``) or ``train_data`` (a ``Dataset``), and
    optionally ``loss(model, batch) -> Tensor`` and ``optimizer(parameters) -> Optimizer``.
    ``vram`` is the memory budget (``"12GB"``, ``"12GiB"`` or bytes); by default the free
    memory of the local GPU, the card's memory for ``gpu=``, or half the available RAM on CPU.
    ``margin`` is the share of the budget kept free. ``probe_top`` configurations are measured
    with real steps when the target is the device at hand (not for a ``gpu=`` card that is
    absent): from two on, the two best are raced against each other and the winner's memory
    is probed. Raises :class:`NoFeasiblePlanError` when nothing fits.

    ``gpus`` devices per node on ``nodes`` machines: one device searches single-device
    training; more search DDP and FSDP2 over all of them (``strategies`` narrows that), with
    ``vram`` the budget of each device and the global batch split over the ranks. Distributed
    configurations are ranked by prediction (a probe runs one process).

    ``plot`` writes every trial's predicted peak against samples/s to that image file
    (``memplan[plots]``) and stores the figure as user attributes of the study.
    ``shape_policy``: when the dataset's items vary in shape, every configuration is estimated
    (and probed) at the largest padded batch the data loader can form at its micro-batch size
    (``"max"``), or at the 99th percentile of an epoch's batches (``"p99"``: a rarer, larger
    batch is left to OOM recovery). Fixed-shape data is unaffected.

    ``probe_fn`` and ``race_fn`` replace the real probe and race (tests); with ``probe_fn``
    alone the best are probed, and probes that overturn the prediction are confirmed by
    probing again, not by a race.

    >>> plan = search("examples/digits.py", vram="1GB", trials=20)   # doctest: +SKIP
    >>> plan.config.micro_batch_size                                  # doctest: +SKIP
    64
    """
    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {margin}")
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    task = resolve_task(model, sample, loss=loss, optimizer=optimizer, train_data=train_data).with_shape_policy(shape_policy)
    estimator = estimator_for(task, device=device, gpu=gpu)
    if vram is None:
        budget, _source = default_budget(estimator)
    else:
        budget = parse_size(vram, what="--vram")
        if budget <= 0:
            raise ConfigError("--vram must be more than 0 bytes; e.g. --vram 12GB")
    limit = int(budget * (1 - margin))
    fixed_batch = global_batch if global_batch is not None else task.settings.get("global_batch")
    blocks_model = _meta_model(task)
    space = build_space(
        dataset_size=task.dataset_size() if task.train_data is not None else None,
        global_batch=int(fixed_batch) if fixed_batch is not None else None,
        precisions=_precisions(estimator, precisions),
        max_segments=max_checkpoint_segments(blocks_model, task.checkpoint_blocks),
        max_micro_batch=max_micro_batch,
        layouts=layouts_for(gpus, nodes, tuple(strategies) if strategies else None),
        micro_batch_sizes=tuple(micro_batch_sizes) if micro_batch_sizes else None,
        checkpoint_segments=tuple(checkpoint_segments) if checkpoint_segments is not None else None,
        # Length-grouped batching pads less; it needs every item's size to order the data.
        grouping=(False, True) if task.train_data is not None and task.shapes().groupable else (False,),
    )
    _refuse_from_lower_bound(task, blocks_model, space, budget, limit, estimator)

    if probe_top > 0 and probe_fn is None and _can_probe(estimator, gpu) and all(
            layout.strategy == "single" for layout in space.layouts):
        # The probe server imports torch while the estimates run, not when the first probe
        # waits — after the machine's rates are known: measuring them while the server's
        # import competes for the cores would cache wrong rates for good.
        estimator.rates()
        from estimators.probing._probe import prestart
        prestart()

    cache: dict[TrainConfig, Estimate] = {}
    failures = _Failures(space)

    def evaluate(config: TrainConfig) -> Estimate | None:
        if config not in cache and config not in failures.reasons:
            try:
                cache[config] = estimator.estimate(config)
            except MemplanError as exc:
                failures.add(config, exc)
        return cache.get(config)

    # Optuna's own warnings (a trial cut short by Ctrl-C) are not the user's business.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    exhaustive = len(space) <= trials
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler: optuna.samplers.BaseSampler = (
            optuna.samplers.BruteForceSampler(seed=seed) if exhaustive else optuna.samplers.TPESampler(seed=seed)
        )
    mirrored = MirroredStudy(name=_study_name(task, estimator, budget, margin, space),
                             storage=storage or default_storage(), sampler=sampler, tuned_sqlite=storage is None)
    study = mirrored.study
    # A resumed study's trials answer their configurations without re-estimating.
    for t in mirrored.resumed():
        if "estimate" in t.user_attrs:
            est = Estimate.from_dict(t.user_attrs["estimate"])
            cache.setdefault(est.config, est)
        elif "failed" in t.user_attrs:
            failures.resume(t.params, str(t.user_attrs["failed"]))
    done = {est.config for est in cache.values()} | set(failures.reasons)
    for corner in space.smallest():
        if corner not in done:
            study.enqueue_trial({"layout": _layout_key(corner), "micro_batch_size": corner.micro_batch_size,
                                 "precision": corner.precision, "checkpoint_segments": corner.checkpoint_segments},
                                skip_if_exists=True)

    def objective(trial: optuna.Trial) -> float:
        layout = trial.suggest_categorical("layout", [layout.key for layout in space.layouts])
        micro = trial.suggest_categorical("micro_batch_size", list(space.micro_batch_sizes))
        precision = trial.suggest_categorical("precision", list(space.precisions))
        segments = trial.suggest_categorical("checkpoint_segments", list(space.checkpoint_segments))
        grouped = (bool(trial.suggest_categorical("length_grouped", list(space.grouping)))
                   if len(space.grouping) > 1 else False)
        config = space.config(int(micro), str(precision), int(segments), str(layout), grouped)
        est = evaluate(config)
        if est is None:
            # A configuration that cannot be traced is a completed, infeasible trial (as an OOM
            # is): the sampler learns from it, and the search goes on without it.
            trial.set_user_attr("failed", failures.reasons[config])
            trial.set_constraint("memory", max(limit, 1) / 1e9)
            if not cache and failures.shared(evaluate):
                trial.study.stop()  # every configuration fails alike: the model itself is broken
            return 0.0
        need = _need(est)
        trial.set_user_attr("estimate", est.to_dict())
        # Constraint in GB keeps the numbers readable in optuna-dashboard; <= 0 is feasible.
        trial.set_constraint("memory", (need - limit) / 1e9)
        return float(est.samples_per_s or 0.0)

    remaining = max(0, min(trials, len(space)) - len([c for c in done if c in set(space)]))
    # An enumerated space asks every configuration: its traces start now, on both cores.
    estimator.expect(space, prefetch=exhaustive and remaining > 0)
    interrupted = False
    if remaining:
        try:
            mirrored.optimize(objective, n_trials=remaining, progress=progress)
        except KeyboardInterrupt:
            interrupted = True  # completed trials are in the storage; plan from them
        finally:
            estimator.close()  # its trace worker, if a large model started one

    estimates = [e for c, e in cache.items() if c in set(space)]
    failed = failures.in_space()
    if not estimates and failed:
        raise failures.first_error()
    feasible = [e for e in estimates if _need(e) <= limit]
    if not feasible:
        raise _no_fit(estimates, budget, limit, estimator)
    # Equal predictions (checkpointing a block whose backward needs only its inputs costs
    # nothing) rank the simpler configuration first: fewer checkpoints, fewer micro-batches.
    feasible.sort(key=lambda e: (-(e.samples_per_s or 0.0), e.config.checkpoint_segments, e.config.grad_accum_steps))
    entries = [PlanEntry(config=e.config, predicted=e) for e in feasible]
    notes: list[str] = []
    if interrupted:
        notes.append("search interrupted; plan built from the trials completed so far")
    tried = len(estimates) + len(failed)
    if any(e.config.strategy != "single" for e in entries):
        notes.append("distributed configurations are ranked by prediction: a probe runs one process")
    if probe_top > 0 and _can_probe(estimator, gpu) and all(e.config.strategy == "single" for e in entries):
        # Configurations whose step raised when run for real join those that could not be traced.
        entries, probe_notes = _probe_best(task, estimator, entries, probe_top, limit, probe_fn, race_fn, failed)
        notes.extend(probe_notes)
        if not entries:
            raise _no_fit(estimates, budget, limit, estimator, measured=True)
    summary = summarize_failures(failed)
    if summary:
        notes.append(summary)
    plan = Plan(
        entries=tuple(entries),
        budget_bytes=budget,
        margin=margin,
        device=estimator.device,
        gpu=estimator.spec.name if estimator.spec else None,
        global_batch=space.global_batch,
        trials=tried,
        failures=failed,
        provenance=provenance(device=estimator.device, gpu=estimator.spec.name if estimator.spec else None,
                              source_hash=task.source_hash, source_path=task.source_path),
        notes=tuple(notes),
    )
    if plot is not None:
        from ._plots import record_plan_plot
        record_plan_plot(plan, estimates, plot, mirrored.persistent)
    return plan


def _need(estimate: Estimate) -> int:
    """The memory a configuration needs against the budget: its peak and the CUDA context."""
    return estimate.peak_bytes + estimate.context_bytes


def _layout_key(config: TrainConfig) -> str:
    from ._space import Layout
    return Layout(config.strategy, config.world_size, config.nodes).key


def _meta_model(task: Task) -> nn.Module:
    if task.prebuilt is not None:
        return task.prebuilt
    try:
        with torch.device("meta"):
            return task.build_model()
    except Exception:  # noqa: BLE001 - some models only build for real
        return task.build_model()


def _can_probe(estimator: Estimator, gpu: str | None) -> bool:
    if estimator.device == "cpu":
        return True
    return torch.cuda.is_available() and (gpu is None or _local_matches(estimator))


def _probe_best(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int, limit: int,
                probe_fn: ProbeFn | None, race_fn: RaceFn | None,
                failed: dict[TrainConfig, str]) -> tuple[list[PlanEntry], list[str]]:
    """Measure the best ``top`` feasible configurations; re-rank with what was measured.

    The two best are raced (``_race_best``) when a race can run: their times come from the
    race, and only the one it puts first has its memory probed. Otherwise, and for any
    further ``top``, each is probed (a few timed steps and its memory) in its own process.
    """
    if probe_fn is None:
        from estimators.probing._probe import probe as real_probe
        from estimators.probing._race import race as real_race

        def probe_fn(t: Task, c: TrainConfig, budget: int) -> Any:
            return real_probe(t, c, device=estimator.device, budget_bytes=budget)

        def memory_fn(t: Task, c: TrainConfig, budget: int) -> Any:
            # Its time comes from a race: one timed step after the memory steps is enough.
            return real_probe(t, c, device=estimator.device, budget_bytes=budget, steps=1, warmup=0)

        if race_fn is None:
            def race_fn(t: Task, pair: tuple[TrainConfig, TrainConfig]) -> Any:
                return real_race(t, pair, device=estimator.device)
    else:
        memory_fn = probe_fn
    notes: list[str] = []
    probed: list[PlanEntry] = []
    rest = _probe_order(entries)
    wanted = top
    raced: list[PlanEntry] | None = None  # raced, left unmeasured (not probed again)
    if top >= 2 and race_fn is not None and len(rest) >= 2 and _fit_together(estimator.device, rest[0], rest[1]):
        outcome = _race_best(task, estimator, rest, limit, memory_fn, race_fn, notes, failed)
        if outcome is not None:
            probed, raced, rest = outcome
            # The race measured two. Should both be dropped, the next are probed in their place;
            # a memory probe that failed (not for lack of memory) stops the probing, as below.
            failed = any(e.probe_status is not None for e in raced)
            wanted = top - 2 + len(probed) if probed or failed else top
    while rest and len(probed) < wanted:
        entry = rest.pop(0)
        result = probe_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        if status == "ok" and result.estimate is not None:
            measured: Estimate = result.estimate
            if measured.step_time_s:
                estimator.calibrate(entry.config, measured.step_time_s, predicted=entry.predicted)
            if _need(measured) > limit:
                notes.append(f"{entry.config.describe()}: measured {format_size(measured.peak_bytes)} is over the budget; dropped")
                continue
            probed.append(PlanEntry(config=entry.config, predicted=entry.predicted, measured=measured, probe_status="ok"))
        elif status == "oom":
            notes.append(f"{entry.config.describe()}: ran out of memory when probed; dropped")
        elif getattr(result, "raised", False):
            # Its step raised when run for real: it cannot run, as one that cannot be traced.
            failed[entry.config] = str(getattr(result, "message", ""))
            notes.append(f"{entry.config.describe()}: failed when probed ({failed[entry.config]}); dropped")
        else:
            notes.append(f"{entry.config.describe()}: probe {status} ({getattr(result, 'message', '')}); kept unmeasured")
            rest.insert(0, PlanEntry(config=entry.config, predicted=entry.predicted, probe_status=status))
            break
    kept: tuple[TrainConfig, TrainConfig] | None = None
    if len(probed) >= 2 and raced is None:
        probed, kept = _confirm_overturn(task, estimator, probed, limit, probe_fn, notes)
    rest = (raced or []) + rest
    # Unprobed configurations get the time model refitted by the probes and races (from
    # their predictions' stored parts: a resumed study's configurations are not traced again).
    timed_by_race = {e.config for e in raced or [] if e.source == "raced"}
    refreshed = [e if e.config in timed_by_race else
                 PlanEntry(config=e.config, predicted=estimator.recalibrated(e.predicted), probe_status=e.probe_status)
                 for e in rest]
    measured_sorted = sorted(probed, key=lambda e: -e.samples_per_s)
    if kept is not None:
        # The confirmation kept the predicted order against figures that could not tell the
        # two apart: the first goes just above the second, and no further (the figures shown
        # stay as measured).
        upper, lower = (next(e for e in measured_sorted if e.config == c) for c in kept)
        if measured_sorted.index(upper) > measured_sorted.index(lower):
            measured_sorted.remove(upper)
            measured_sorted.insert(measured_sorted.index(lower), upper)
    best_measured = measured_sorted[0].samples_per_s if measured_sorted else 0.0
    # Measured figures come first; an unmeasured configuration ranks above them only if its
    # (calibrated) prediction beats the best measurement.
    ahead = [e for e in refreshed if e.samples_per_s > best_measured and not measured_sorted]
    behind = [e for e in refreshed if e not in ahead]
    ranking = ahead + measured_sorted + sorted(behind, key=lambda e: -e.samples_per_s)
    return ranking, notes


# A race decided by less than this share is a tie; the prediction breaks it.
_RACE_TIE = 0.01


def _race_best(task: Task, estimator: Estimator, rest: list[PlanEntry], limit: int, memory_fn: ProbeFn,
               race_fn: RaceFn, notes: list[str],
               failed: dict[TrainConfig, str]) -> tuple[list[PlanEntry], list[PlanEntry], list[PlanEntry]] | None:
    """Race the two best predicted configurations (``rest[0]``, ``rest[1]``); follow a clear
    win along its axis (``_follow_trend``); probe the memory of the one put first. Returns the
    measured entry (none when each raced one failed its memory probe), the raced ones left
    unmeasured, and the rest, or None when the race did not finish (the caller then probes them instead).

    Why a race rather than a probe of each: a probe's few steps run in one fresh process,
    and on a shared machine the same configuration measures 20-40% apart from one probe to
    the next (its speed drifts over seconds), while the predicted best and its runner-up are
    often predicted within a few percent of each other. A race (``estimators.probing._race``) times
    their steps alternately in one process, so each pair of steps sees the same machine, and
    the median ratio over the rounds decides; a tie (under ``_RACE_TIE``) keeps the
    prediction's order. Each raced configuration takes the race's median step time as its
    figure (and refits the time model with it). The memory only the one that will be
    trained needs measured, by a probe of one step.
    """
    first, rival = rest[0], rest[1]
    result = race_fn(task, (first.config, rival.config))
    if not getattr(result, "ok", False):
        notes.append(f"the race of {first.config.describe()} against {rival.config.describe()} did not finish "
                     f"({getattr(result, 'status', 'error')}: {getattr(result, 'message', '')}); both are probed instead")
        return None
    rest = rest[2:]
    rounds = len(result.step_times[0])
    ratio = float(result.ratio)  # > 1: the rival's steps are the shorter
    timed: dict[TrainConfig, tuple[float, int, TrainConfig]] = {}  # step s, rounds, raced against
    for i, (entry, other) in enumerate(((first, rival), (rival, first))):
        step = float(result.median_step_s(i))
        estimator.calibrate(entry.config, step, predicted=entry.predicted)
        timed[entry.config] = (step, rounds, other.config)
    wins = int(result.second_wins)
    if ratio > 1 + _RACE_TIE:
        notes.append(f"raced step against step, {rival.config.describe()} was faster than the predicted best "
                     f"({first.config.describe()}) in {wins} of {rounds} rounds (by {ratio - 1:.0%} on the median): "
                     "it goes above the predicted best")
        order = [rival, first]
        if ratio >= 1 + _TREND_MIN:
            rest = _follow_trend(task, estimator, order, rest, timed, race_fn, notes)
    else:
        verdict = (f"tied with {rival.config.describe()}" if ratio >= 1 - _RACE_TIE else
                   f"was faster than {rival.config.describe()} in {rounds - wins} of {rounds} rounds "
                   f"(by {1 / ratio - 1:.0%} on the median)")
        notes.append(f"raced step against step, the predicted best ({first.config.describe()}) {verdict}: "
                     "the predicted order is kept")
        order = [first, rival]
    probed, unmeasured = _check_memory(task, order, timed, limit, memory_fn, notes, failed)
    return probed, unmeasured, rest


def _check_memory(task: Task, order: list[PlanEntry], timed: dict[TrainConfig, tuple[float, int, TrainConfig]],
                  limit: int, memory_fn: ProbeFn, notes: list[str],
                  failed: dict[TrainConfig, str]) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """Probe the memory of the raced configurations, fastest first, until one fits: it is
    measured (its time the race's), one that runs out of memory or over the budget is
    dropped, and the others stay unmeasured (their races refitted their predictions)."""
    for i, entry in enumerate(order):
        result = memory_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        measured = getattr(result, "estimate", None)
        if status == "ok" and measured is not None and _need(measured) <= limit:
            step, rounds, other = timed[entry.config]
            entry = replace(entry, measured=_raced(measured, entry.config, step, rounds, other), probe_status="ok")
            # The others were timed by the race too: that is their figure, not the time model's.
            losers = [replace(e, predicted=_raced(e.predicted, e.config, *timed[e.config])) for e in order[i + 1:]]
            return [entry], losers
        if status == "oom":
            notes.append(f"{entry.config.describe()} raced fastest but ran out of memory when probed; dropped")
        elif status == "ok" and measured is not None:
            notes.append(f"{entry.config.describe()} raced fastest but measured {format_size(measured.peak_bytes)}, "
                         "over the budget; dropped")
        elif getattr(result, "raised", False):
            failed[entry.config] = str(getattr(result, "message", ""))
            notes.append(f"{entry.config.describe()} raced fastest but failed when probed "
                         f"({failed[entry.config]}); dropped")
        else:
            notes.append(f"{entry.config.describe()}: memory probe {status} ({getattr(result, 'message', '')}); "
                         "kept unmeasured")
            return [], [replace(entry, probe_status=status), *order[i + 1:]]
    return [], []


def _confirm_overturn(task: Task, estimator: Estimator, probed: list[PlanEntry], limit: int, probe_fn: ProbeFn,
                      notes: list[str]) -> tuple[list[PlanEntry], tuple[TrainConfig, TrainConfig] | None]:
    """When separate probes overturn the predicted order of the top configuration (no race
    could be run), probe the two again before believing them.

    Both are probed again in the other order and each keeps the mean of its two
    measurements; the lead then stands only if it is larger than either configuration's two
    probes differ. Returns the entries, and the pair (upper, lower) when the figures alone
    would not order the two as decided.
    """
    predicted_first = probed[0]  # probes run in predicted order
    rival = max(probed[1:], key=lambda e: e.samples_per_s)
    if predicted_first.samples_per_s >= rival.samples_per_s:
        return probed, None
    notes.append(f"the probes put {rival.config.describe()} ahead of the predicted best "
                 f"({predicted_first.config.describe()})")
    return _reprobe(task, estimator, probed, predicted_first, rival, limit, probe_fn, notes)


def _fit_together(device: str, a: PlanEntry, b: PlanEntry) -> bool:
    """Can both configurations live on the device at once, as a race needs? On cuda their
    measured (else predicted) peaks must fit in the free memory (a race that runs out of it would
    only cost its time); a CPU's RAM holds two configurations of a budget that defaults to
    half of it."""
    if not device.startswith("cuda"):
        return True
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    need = sum((e.measured or e.predicted).peak_bytes for e in (a, b))
    return need <= free


def _raced(measured: Estimate, config: TrainConfig, step: float, rounds: int, other: TrainConfig) -> Estimate:
    """A probe's figures with the time a race measured in its place."""
    return replace(measured, step_time_s=step, samples_per_s=config.global_batch / step,
                   notes=(*measured.notes, f"{RACED_NOTE} {rounds} steps raced step against step "
                                           f"with {other.describe()} in one process"))


# How many configurations beyond a race's winner the search follows its trend.
_TREND_STEPS = 2
# The least lead of a race's winner over the predicted best that is followed further: a
# smaller one says the time model misjudged that axis by little, so one step further would
# likely gain less than the 5% the plan may be off anyway, for a race's cost.
_TREND_MIN = 0.05


def _follow_trend(task: Task, estimator: Estimator, order: list[PlanEntry], rest: list[PlanEntry],
                  timed: dict[TrainConfig, tuple[float, int, TrainConfig]], race_fn: RaceFn,
                  notes: list[str]) -> list[PlanEntry]:
    """A race put ``order[0]`` above the predicted best ``order[1]`` by ``_TREND_MIN`` or
    more, and if the two differ along one axis (the micro-batch size, or the checkpoint
    segments) the time model misjudged that axis, and the same misjudgement likely holds one
    step further. So the next feasible configuration beyond the winner along that axis is
    raced against it; if it wins, it goes first in ``order`` (and ``timed`` gets its figure),
    and the search looks one step further again (at most ``_TREND_STEPS``) if this step too
    won by ``_TREND_MIN``. The first race it loses, a win by less, or a configuration that is
    not there, ends the walk. Returns ``rest`` without the configurations put in ``order``.

    A CPU's caches, for one, make a smaller micro-batch's steps faster per sample than a
    roofline of its work predicts; one probe of a neighbour is not evidence enough (probes
    of one configuration lie 20-40% apart here), a race is.
    """
    winner, loser = order[0], order[1]
    for _ in range(_TREND_STEPS):
        candidate = _next_along(winner.config, loser.config, rest)
        if candidate is None or not _fit_together(estimator.device, winner, candidate):
            break
        result = race_fn(task, (winner.config, candidate.config))
        if not getattr(result, "ok", False):
            notes.append(f"{candidate.config.describe()}, one step further, was not raced "
                         f"({getattr(result, 'status', 'error')}: {getattr(result, 'message', '')})")
            break
        rounds = len(result.step_times[0])
        ratio = float(result.ratio)  # > 1: the candidate's steps are the shorter
        step = float(result.median_step_s(1))
        estimator.calibrate(candidate.config, step, predicted=candidate.predicted)
        if ratio <= 1 + _RACE_TIE:
            notes.append(f"one step further, {candidate.config.describe()} raced {winner.config.describe()} and was "
                         f"not faster (median ratio {ratio:.2f}): the walk stops")
            break
        notes.append(f"one step further, {candidate.config.describe()} raced {winner.config.describe()}: faster in "
                     f"{int(result.second_wins)} of {rounds} rounds (by {ratio - 1:.0%} on the median): it goes above")
        rest = [e for e in rest if e is not candidate]
        order.insert(0, candidate)
        timed[candidate.config] = (step, rounds, winner.config)
        winner, loser = candidate, winner
        if ratio < 1 + _TREND_MIN:
            break  # the gain is flattening out: a step further would likely gain less still
    return rest


def _next_along(winner: TrainConfig, loser: TrainConfig, candidates: list[PlanEntry]) -> PlanEntry | None:
    """The candidate one step beyond ``winner``, away from ``loser``, along the one axis the
    two differ in (the micro-batch size, its accumulation following it, or the checkpoint
    segments); None when they differ in more, or nothing lies beyond."""
    fixed = ("precision", "strategy", "world_size", "nodes")
    if any(getattr(winner, f) != getattr(loser, f) for f in fixed):
        return None
    if winner.checkpoint_segments == loser.checkpoint_segments and winner.micro_batch_size != loser.micro_batch_size:
        axis, same = "micro_batch_size", ("checkpoint_segments",)
    elif winner.micro_batch_size == loser.micro_batch_size and winner.grad_accum_steps == loser.grad_accum_steps:
        axis, same = "checkpoint_segments", ("micro_batch_size", "grad_accum_steps")
    else:
        return None
    step = getattr(winner, axis) - getattr(loser, axis)
    beyond = [e for e in candidates
              if all(getattr(e.config, f) == getattr(winner, f) for f in (*fixed, *same))
              and (getattr(e.config, axis) - getattr(winner, axis)) * step > 0
              and e.config.global_batch == winner.global_batch and e.probe_status is None]
    return min(beyond, key=lambda e: abs(getattr(e.config, axis) - getattr(winner, axis)), default=None)


def _reprobe(task: Task, estimator: Estimator, probed: list[PlanEntry], predicted_first: PlanEntry,
             leader: PlanEntry, limit: int, probe_fn: ProbeFn,
             notes: list[str]) -> tuple[list[PlanEntry], tuple[TrainConfig, TrainConfig] | None]:
    steps: dict[TrainConfig, tuple[float, float]] = {}
    confirmed: dict[TrainConfig, PlanEntry | None] = {}  # None: dropped
    for entry in (leader, predicted_first):
        first = entry.measured
        if first is None or not first.step_time_s:
            continue
        result = probe_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        second: Estimate | None = result.estimate if status == "ok" else None
        if status == "oom":
            notes.append(f"{entry.config.describe()}: ran out of memory when probed again; dropped")
            confirmed[entry.config] = None
            continue
        if second is None or not second.step_time_s:
            notes.append(f"{entry.config.describe()}: second probe {status}; the first kept")
            continue
        estimator.calibrate(entry.config, second.step_time_s, predicted=entry.predicted)
        steps[entry.config] = (first.step_time_s, second.step_time_s)
        step = (first.step_time_s + second.step_time_s) / 2
        higher = max((first, second), key=_need)
        if _need(higher) > limit:
            notes.append(f"{entry.config.describe()}: measured {format_size(higher.peak_bytes)} is over the budget; dropped")
            confirmed[entry.config] = None
            continue
        merged = replace(higher, step_time_s=step, samples_per_s=entry.config.global_batch / step,
                         notes=(*higher.notes, f"time: mean of two probes ({first.step_time_s:.4g} s, "
                                               f"{second.step_time_s:.4g} s)"))
        confirmed[entry.config] = replace(entry, measured=merged)
    notes.append("both were probed again")
    out = [confirmed[e.config] if e.config in confirmed else e for e in probed]
    kept = None
    # Both kept (not dropped) means both were measured twice.
    if confirmed.get(leader.config) and confirmed.get(predicted_first.config):
        mean = {c: (a + b) / 2 for c, (a, b) in steps.items()}
        spread = max(abs(a - b) / mean[c] for c, (a, b) in steps.items())
        lead = mean[predicted_first.config] / mean[leader.config] - 1
        if 0 < lead <= spread:
            kept = (predicted_first.config, leader.config)
            notes.append(f"{leader.config.describe()} led by {lead:.0%} on the means, less than one "
                         f"configuration's two probes differ ({spread:.0%}): the predicted order is kept")
    return [e for e in out if e is not None], kept


def _probe_order(entries: list[PlanEntry]) -> list[PlanEntry]:
    """The best configuration first, then the best of each other precision, then the rest;
    a configuration predicted exactly like one before it goes last.

    Probes calibrate the time model per precision: a bf16 step's speed on a CPU depends on
    kernels an fp32 probe says nothing about, so one probe of each precision keeps the
    unprobed configurations' predictions honest. A configuration the estimator cannot tell
    from one already probed (same step time, same peak) would measure only the machine's
    noise: a probe is better spent on a configuration that differs.
    """
    if not entries:
        return []
    seen_estimates: set[tuple[float | None, int]] = set()
    distinct: list[PlanEntry] = []
    twins: list[PlanEntry] = []
    for e in entries:
        key = (e.predicted.step_time_s, _need(e.predicted))
        (twins if key in seen_estimates else distinct).append(e)
        seen_estimates.add(key)
    first: list[PlanEntry] = [distinct[0]]
    seen = {distinct[0].config.precision}
    for e in distinct[1:]:
        if e.config.precision not in seen:
            first.append(e)
            seen.add(e.config.precision)
    return first + [e for e in distinct if e not in first] + twins


def _model_state_floor(model: nn.Module, space: SearchSpace) -> tuple[int, int, int]:
    """(bytes, parameters, shards): the least any configuration of ``space`` can hold per
    device before a single activation or optimizer state — every parameter and the gradient
    of every trainable one, in the dtypes the model is built in (mixed precision keeps fp32
    weights; a ``TrainConfig`` has no lower-precision weights), split over the ranks when FSDP2
    is searched (shared parameters counted once)."""
    seen: set[int] = set()
    states = params = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        states += p.numel() * p.element_size() * (2 if p.requires_grad else 1)
    shards = max((layout.world_size for layout in space.layouts if layout.strategy == "fsdp"), default=1)
    return states // shards, params, shards


def _more_memory_hint(need: int, budget: int, limit: int, estimator: Estimator) -> str:
    """The budget (its margin kept) that ``need`` would fit in, as a fix to suggest."""
    gb = math.ceil(need * budget / limit / 1e9)
    return f"a card with >= {gb} GB" if estimator.device == "cuda" else f"--vram {gb}GB or more"


def _refuse_from_lower_bound(task: Task, model: nn.Module, space: SearchSpace, budget: int, limit: int,
                             estimator: Estimator) -> None:
    """Say at once, without a trace, that nothing fits when the model's own states do not: a
    3B-parameter model on a 2 GB card is refused in the time it takes to build it on meta,
    not after a search's traces."""
    floor, params, shards = _model_state_floor(model, space)
    if floor <= limit:
        return
    where = f" per device over {shards} FSDP2 ranks" if shards > 1 else ""
    hints = [_more_memory_hint(floor, budget, limit, estimator)]
    devices = max(2, 2 * shards)
    hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    hints.append("a smaller model, or frozen parts (no gradients)")
    raise NoFeasiblePlanError(
        f"nothing fits in {format_size(budget)} (keeping {format_size(budget - limit)} free): {task.name}'s "
        f"{params:,} parameters and their gradients alone need {format_size(floor)}{where}, before any activation "
        f"or optimizer state — try {', '.join(hints)}",
        nearest=None, needed_bytes=floor, budget_bytes=budget,
    )


def _no_fit(estimates: list[Estimate], budget: int, limit: int, estimator: Estimator, *, measured: bool = False) -> NoFeasiblePlanError:
    nearest = min(estimates, key=_need)
    need = _need(nearest)
    parts = sorted(nearest.breakdown.items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{k} {format_size(v)}" for k, v in parts if v > 0)
    if nearest.context_bytes:
        detail += f", CUDA context {format_size(nearest.context_bytes)}"
    hints = [_more_memory_hint(need, budget, limit, estimator)]
    if nearest.config.strategy == "fsdp":
        hints.append(f"FSDP over more devices (--gpus {2 * nearest.config.world_size})")
    else:
        # FSDP2 shards parameters, gradients and optimizer state over the ranks.
        devices = max(2, 2 * nearest.config.world_size)
        hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    hints.append("a smaller model")
    what = "nothing fits" if not measured else "nothing that was probed fits"
    return NoFeasiblePlanError(
        f"{what} in {format_size(budget)} (keeping {format_size(budget - limit)} free); the smallest plan "
        f"({nearest.config.describe()}) needs {format_size(need)}: {detail} — try {', '.join(hints)}",
        nearest=nearest, needed_bytes=need, budget_bytes=budget,
    )
