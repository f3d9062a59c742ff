"""``memplan.search``: the fastest configuration that fits the memory budget.

The pipeline, one module per step: the task, its estimator and the budget (``._inputs``);
the space (``._space``); the model's own states against the budget, refused before any trace
(``._refusal``); an Optuna study over the space (``._study``) whose objective is each
configuration's static estimate, the budget a constraint with a margin (``._objective``;
configurations that cannot be traced are kept in ``._failures``); the nearest miss when
nothing fits (``._refusal``); the best few confirmed on the real device when planning for
the device at hand — the two best raced step against step (``._races``), the others probed
(``._probes``); the ranking, measured figures first, and the ``Plan`` (``._ranking``,
``._plan``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypedDict

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from estimators import ConfigError, Estimate, Estimator, Task, TrainConfig, prestart
from estimators._types import Batch, Item
from estimators.task._task_data import structure_fingerprint

from ._compile import evaluate_compile
from ._coverage import coverage_of
from ._effort import COMPILE_COST_S, DEFAULT_SEARCH_EFFORT, MeasuredBudget, check_search_effort, training_seconds
from ._inputs import (
    budget_for,
    can_probe,
    estimator_for,
    host_budget_for,
    meta_model,
    resolve_task,
    vram_beyond_device,
)
from ._objective import Objective, optimize
from ._plan import Plan
from ._probes import probe_best
from ._races import ProbeFn, RaceFn
from ._ranking import build_plan, rank_predicted
from ._refusal import StateFloor, no_fit, refuse_from_lower_bound, state_floor
from ._shared import SharedStudy, run_shared, shares_storage
from ._space import (
    SearchSpace,
    frugal_space,
    layouts_for,
    optimizer_in_backward_excluded,
    pipeline_layouts,
    space_for,
    tensor_parallel_layouts,
)
from ._study import (
    DEFAULT_TRIALS,
    ENUMERATE_LIMIT,
    MirroredStudy,
    check_storage,
    enqueue_ascending,
    enqueue_corners,
    open_study,
)

__all__ = ["search", "SearchInterrupted"]


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search's study: its completed trials are kept in the study (its storage),
    and the same search run again continues from them. A ``KeyboardInterrupt``, so that code
    stopping on Ctrl-C stops on it too; no plan is made from a part of the study."""

    def __init__(self, trials: int) -> None:
        self.trials = trials
        super().__init__(
            f"search interrupted after {trials} trial{'s' if trials != 1 else ''}, kept in its study; "
            "run the same command again to continue the search"
        )


class _StudyOptions(TypedDict):
    """What every study of one search shares (``_run_study``'s keywords)."""

    budget: int
    margin: float
    trials: int
    enumerate_limit: int
    seed: int | None
    storage: str | None
    progress: bool
    floor: StateFloor | None
    host_limit: int | None
    shared: bool
    study_name: str | None


def search(
    model: Task | str | os.PathLike[str] | nn.Module,
    *,
    vram: int | str | None = None,
    sample: Batch | Callable[[int], Batch] | None = None,
    loss: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    train_data: Dataset[Item] | None = None,
    global_batch: int | None = None,
    device: str | None = None,
    gpu: str | None = None,
    trials: int | None = None,
    probe_top: int = 2,
    compile_top: int = 1,
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
    compile_fn: ProbeFn | None = None,
    gpus: int = 1,
    nodes: int = 1,
    strategies: Sequence[str] | None = None,
    plot: str | os.PathLike[str] | None = None,
    shape_policy: str = "max",
    host_memory: int | str | None = None,
    seq_len: int | None = None,
    shared: bool | None = None,
    study_name: str | None = None,
    search_effort: float = DEFAULT_SEARCH_EFFORT,
) -> Plan:
    """Search the configuration space and return the ranked :class:`Plan`.

    ``model`` is a model-file path, ``"hf:<repo id | directory | config.json>"`` (a Hugging Face
    model planned from its config, at ``seq_len`` tokens; ``estimators.hf_task`` for its other
    options: head, LoRA), a :class:`Task`, or an ``nn.Module`` with ``sample`` (a
    batch, or a callable ``batch_size -> batch``) or ``train_data`` (a ``Dataset``), and
    optionally ``loss(model, batch) -> Tensor`` and ``optimizer(parameters) -> Optimizer``.
    ``vram`` is the memory budget (``"12GB"``, ``"12GiB"`` or bytes); by default the free
    memory of the local GPU, the card's memory for ``gpu=``, or half the available RAM on CPU.
    ``margin`` is the share of the budget kept free. ``global_batch`` (else the model file's
    ``settings["global_batch"]``, else ``DEFAULT_GLOBAL_BATCH``, 32: a training
    hyper-parameter, not a memory setting) is fixed; the search chooses how it is reached
    (micro-batch x accumulation x ranks). ``trials`` caps the configurations estimated: by
    default 60, and a space of up to 200 left once the model states alone rule some out is
    estimated whole; given, a larger space than ``trials`` is sampled (the plan says how much
    of it was estimated). ``probe_top`` configurations are measured
    with real steps when the target is the device at hand (not for a ``gpu=`` card that is
    absent): from two on, the two best are raced against each other and the winner's memory
    is probed, and each further one races the measured best; every samples/s of the plan is on
    one basis, the measured best's (``Plan.table`` names each row's). Raises :class:`NoFeasiblePlanError` when nothing fits. Then ``compile_top``
    of the best (0: none) are probed compiled: ``plan.compile`` says whether torch.compile was
    measured faster (``._compile``).

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

    ``host_memory``: the host RAM a GPU plan may fill with what it offloads (``"64GB"``; by
    default this machine's RAM). When nothing fits otherwise, the search widens to bf16-true,
    selective checkpointing and, on a GPU, FSDP2's CPU offload (one device included).

    ``storage``: the Optuna storage URL of the study (default: SQLite in the cache folder).
    ``shared``: several processes, on one machine or many, share the study and split its
    configurations, each estimated by one of them; every process waits for the others and
    returns the same plan (ranked by prediction: nothing is probed). By default a study is
    shared on a database server (``postgresql://``, ``mysql://``), not in SQLite; ``False``: one
    process, which reuses the study's estimates (and probes, on the device at hand).
    ``study_name`` names the study (default: a hash of the inputs); a named study refuses
    other inputs. See ``docs/shared_studies.md``.

    ``search_effort``: the share of the predicted training time (the model's settings' epochs or
    max_steps at the best prediction's speed) that the measured part (probes, races, compiled
    probes) may take, at least a few seconds; what it leaves out is said in the notes (``._effort``).

    ``probe_fn`` and ``race_fn`` replace the real probe and race (tests); with ``probe_fn``
    alone the best are probed, and probes that overturn the prediction are confirmed by
    probing again, not by a race.

    >>> plan = search("examples/digits.py", vram="1GB", trials=20)   # doctest: +SKIP
    >>> plan.config.micro_batch_size                                  # doctest: +SKIP
    64
    """
    # Longer than ~60 lines for the signature and the docstring of the public API; the body
    # is the pipeline: inputs, space, lower bound, study, refusal, probes and races, Plan.
    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {margin}")
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    search_effort = check_search_effort(search_effort)
    check_storage(storage)  # a bad URL is one line now, not a traceback after the estimates
    task = resolve_task(model, sample, loss=loss, optimizer=optimizer, train_data=train_data, seq_len=seq_len).with_shape_policy(
        shape_policy
    )
    estimator = estimator_for(task, device=device, gpu=gpu)
    budget = budget_for(estimator, vram)
    limit = int(budget * (1 - margin))
    if limit < 1:
        raise ConfigError(f"--vram {budget} B leaves nothing once the {margin:.0%} margin is kept; "
                          "give the device's memory, e.g. --vram 12GB")
    notes: list[str] = []
    beyond = vram_beyond_device(estimator, budget, gpu) if vram is not None else None
    if beyond is not None:  # planned as asked (a bigger machine may be meant), but said
        logging.getLogger("memplan").warning(beyond)
        notes.append(beyond)
    blocks_model = meta_model(task)
    structure = structure_fingerprint(blocks_model)  # before anything the search does to the model
    space = space_for(
        task,
        estimator,
        blocks_model,
        global_batch=global_batch,
        precisions=precisions,
        max_micro_batch=max_micro_batch,
        layouts=layouts_for(gpus, nodes, tuple(strategies) if strategies else None),
        micro_batch_sizes=micro_batch_sizes,
        checkpoint_segments=checkpoint_segments,
        notes=notes,
    )
    # The bound of the most frugal space the search may widen to: nothing it could try fits.
    tp_layouts, tp_refused = tensor_parallel_layouts(space, task, blocks_model)
    if tp_refused is not None:
        notes.append(f"tensor parallelism was not searched: {tp_refused}")
    pp_layouts, pp_refused = pipeline_layouts(space, task, blocks_model)
    if pp_refused is not None:
        notes.append(f"pipeline parallelism was not searched: {pp_refused}")
    tp_layouts = (*tp_layouts, *pp_layouts)
    frugal = frugal_space(space, estimator, precisions_pinned=precisions is not None, tp_layouts=tp_layouts)
    floor = state_floor(task, blocks_model)
    host_limit = host_budget_for(host_memory) if estimator.device == "cuda" else None
    refuse_from_lower_bound(task, floor, frugal or space, budget, limit, estimator, host_limit)
    shared = shares_storage(storage, shared)
    if shared and (probe_top > 0 or compile_top > 0) and can_probe(estimator, gpu):
        # A probe measures the machine it runs on; every process of a shared study makes the
        # same plan, from the shared estimates.
        notes.append("a shared study's plan is ranked by prediction, the same for every process: nothing was "
                     "probed (a probe measures one machine); on the machine that trains, the same search with "
                     "--no-shared (shared=False) reuses the study's estimates and probes the best")
        probe_top = compile_top = 0
    if (
        probe_top > 0
        and probe_fn is None
        and can_probe(estimator, gpu)
        and all(layout.strategy == "single" and layout.ranks == 1 for layout in space.layouts)
    ):
        # The probe server imports torch while the estimates run, not when the first probe
        # waits — after the machine's rates are known: measuring them while the server's
        # import competes for the cores would cache wrong rates for good.
        estimator.rates()
        prestart()

    study = _StudyOptions(
        budget=budget,
        margin=margin,
        trials=DEFAULT_TRIALS if trials is None else trials,
        # Not given, the budget is the default's and a space of up to ENUMERATE_LIMIT
        # configurations is enumerated; given, it is the user's limit (a quick search).
        enumerate_limit=ENUMERATE_LIMIT if trials is None else trials,
        seed=seed,
        storage=storage,
        progress=progress,
        floor=floor,
        host_limit=host_limit,
        shared=shared,
        study_name=study_name,
    )
    objective, mirrored, interrupted, wider = _study_then_widen(task, estimator, space, frugal, limit, study, notes)
    estimates, failed = objective.results()
    if interrupted:
        # What a cut-short search found is an accident of where Ctrl-C fell (the least-memory
        # corners are asked first: the slowest configurations). Nothing is probed, returned or
        # trained from it; the study keeps its trials for the next run.
        raise SearchInterrupted(len(estimates) + len(failed))
    feasible = [e for e in estimates if objective.fits(e)]
    if not feasible:
        if not estimates:  # every configuration was known not to fit without a trace
            refuse_from_lower_bound(task, floor, wider or space, budget, limit, estimator, host_limit)
        # Offloaded configurations set aside untraced for the host's limit alone: the refusal
        # says how much host memory would let them be tried.
        host_short = [floor.host(c) for c in objective.pruned if c.cpu_offload and host_limit is not None
                      and floor.device(c) <= limit and floor.host(c) > host_limit]
        raise no_fit(estimates, budget, limit, estimator, host_limit=host_limit,
                     host_needed=min(host_short) if host_short else None)
    entries = rank_predicted(feasible)
    tried = len(estimates) + len(failed)  # before the probes add the configurations that raised
    searched = wider or space
    coverage = coverage_of(objective, searched, enumerated=objective.enumerated)
    if coverage.note() is not None:
        notes.append(str(coverage.note()))
    if any(e.config.ranks > 1 or e.config.strategy != "single" for e in entries):
        notes.append("distributed configurations are ranked by prediction: a probe runs one process")
    # The measured part is budgeted against the predicted training time (its clock starts here).
    effort = MeasuredBudget(search_effort, training_seconds(task, entries[0], space.global_batch))
    if probe_top > 0 and can_probe(estimator, gpu) and all(e.config.strategy == "single" and e.config.ranks == 1
                                                            for e in entries):
        # Configurations whose step raised when run for real join those that could not be traced.
        entries, probe_notes = probe_best(task, estimator, entries, probe_top, limit, probe_fn, race_fn, failed)
        notes.extend(probe_notes)
        if not entries:
            raise no_fit(estimates, budget, limit, estimator, measured=True)
    compile_top = compile_top if probe_top > 0 else 0
    if (compile_top > 0 and compile_fn is None and probe_fn is None and can_probe(estimator, gpu)
            and not effort.allows("the compiled probe (torch.compile)", COMPILE_COST_S)):
        compile_top = 0
    entries, compiled = evaluate_compile(task, estimator, entries, compile_top, limit, probe_fn, compile_fn, gpu, notes)
    if effort.note() is not None:
        notes.append(str(effort.note()))
    plan = build_plan(
        task,
        estimator,
        entries,
        budget=budget,
        margin=margin,
        global_batch=space.global_batch,
        tried=tried,
        failed=failed,
        notes=notes,
        compile=compiled,
        structure=structure,
        coverage=coverage.to_dict(),
    )
    if plot is not None:
        from ._plot import record_plan_plot

        record_plan_plot(plan, estimates, os.fspath(plot), mirrored.persistent)
    return plan


def _study_then_widen(
    task: Task,
    estimator: Estimator,
    space: SearchSpace,
    frugal: SearchSpace | None,
    limit: int,
    study: _StudyOptions,
    notes: list[str],
) -> tuple[Objective, MirroredStudy | SharedStudy, bool, SearchSpace | None]:
    """The study of ``space``; when nothing in it fits, the study of ``frugal`` (the techniques
    that trade speed or precision for memory), the estimates made so far kept. Returns the
    last study's objective, its storage, whether Ctrl-C cut it short, and the widened space
    (None when not widened); says what it widened to in ``notes``."""
    objective, mirrored, interrupted = _run_study(task, estimator, space, limit, **study)
    if interrupted:
        return objective, mirrored, interrupted, None
    estimates, failed = objective.results()
    if not estimates and failed:
        raise objective.failures.first_error()
    if any(objective.fits(e) for e in estimates) or frugal is None:
        return objective, mirrored, interrupted, None
    if study["study_name"] is not None:  # the wider space's study is another study
        study = study.copy()
        study["study_name"] = f"{study['study_name']}-wider"
    objective, mirrored, interrupted = _run_study(task, estimator, frugal, limit, cache=objective.cache, **study)
    added = ([p for p in frugal.precisions if p not in space.precisions] + [t.name for t in frugal.techniques]
             + [layout.key for layout in frugal.layouts if layout not in space.layouts])
    notes.append(f"nothing fit with the standard configurations; searched again with {', '.join(added)}")
    excluded = optimizer_in_backward_excluded(task)
    if excluded is not None:
        notes.append(f"the optimizer step in backward was not searched: {excluded}")
    return objective, mirrored, interrupted, frugal


def _run_study(
    task: Task,
    estimator: Estimator,
    space: SearchSpace,
    limit: int,
    *,
    budget: int,
    margin: float,
    trials: int,
    enumerate_limit: int,
    seed: int | None,
    storage: str | None,
    progress: bool,
    floor: StateFloor | None = None,
    host_limit: int | None = None,
    cache: Mapping[TrainConfig, Estimate] | None = None,
    shared: bool = False,
    study_name: str | None = None,
) -> tuple[Objective, MirroredStudy | SharedStudy, bool]:
    """The study of ``space``: resumed, its least-memory corners asked first, run to ``trials``
    (a shared study: this process's share of it, and then the others' awaited)."""
    objective = Objective(space, estimator, limit, floor=floor, host_limit=host_limit)
    if cache:
        objective.cache.update(cache)
    survivors = [c for c in space if objective.under_floor(c) is None]
    mirrored, exhaustive = open_study(
        task, estimator, budget=budget, margin=margin, space=space, trials=trials, seed=seed, storage=storage,
        shared=shared, study_name=study_name, survivors=len(survivors), enumerate_limit=enumerate_limit,
        host_limit=host_limit,
    )
    objective.enumerated = exhaustive
    if isinstance(mirrored, SharedStudy):
        return objective, mirrored, run_shared(mirrored, objective, trials=trials, exhaustive=exhaustive,
                                               progress=progress)
    objective.resume(mirrored.resumed())
    enqueue_corners(mirrored.study, space, objective.done())
    if exhaustive:
        enqueue_ascending(mirrored.study, space, survivors, objective.done())
    interrupted = optimize(mirrored, objective, trials=trials, exhaustive=exhaustive, progress=progress)
    return objective, mirrored, interrupted
