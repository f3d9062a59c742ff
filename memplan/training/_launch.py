"""Distributed training: launch the ranks in-process with ``torch.distributed`` and recover
from an out-of-memory error on any of them by relaunching all of them one rung down.

``memplan train MODEL.py --plan plan.json --nproc 2`` (and ``fit``) call :func:`launch_training`
in the process that holds the plan. It starts the ranks with torchrun's own machinery
(``torch.distributed.launcher.api.elastic_launch``: the same rendezvous options, ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-backend``); each rank
(:func:`_rank_main`, module-level so that it pickles) initialises the process group (gloo on
CPU, NCCL on CUDA with its local rank's device), builds the task from the model file, enforces
the budget with a :class:`~estimators.MemoryGuard` and runs the
:class:`~memplan.training.Trainer` with the plan's configuration (:mod:`memplan.training._rank`).

Why OOM recovery leaves the process group instead of agreeing inside it: an OOM mid-forward on
one FSDP rank leaves the other ranks blocked in an all-gather that rank will never join, and
any collective "shall we switch?" afterwards is matched against the wrong collective and
desynchronises (pytorch#44353). So the failing rank writes an :class:`OOMRecord` (step, phase,
configuration, peak) -- under DDP, whose state is replicated and still that of the window's
start, also a checkpoint -- and exits; its exit closes its gloo connections, so the others'
pending collectives fail at once and they exit too, writing nothing. This process then reads
the records, takes the next configuration of the ladder (same global batch, same strategy and
world size, the rule of the single-process ``InProcessRecovery``), logs the switch and
launches every rank again, resuming from the checkpoint: all ranks agree because they all read
the one decision, and they replay the failed step together. FSDP2 ranks cannot write a
window-start checkpoint alone (each holds only its shards), so an FSDP run resumes from its last
checkpoint and redoes the steps since. On NCCL a peer's death does not fail the others'
collectives at once; torchrun's agent stops the remaining workers when one fails.

Every other failure stops the run with a one-line :class:`TrainingError` naming the rank and
its error (not the secondary "connection closed" errors of the ranks it took down).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from estimators import ConfigError, TrainConfig, TrainingError, format_size

from ._options import TrainOptions
from ._out_dir import HELD_ENV, run_holds
from ._rank import _clear_failures, _failure_message, _rank_main, _RankJob
from ._recovery import OOMRecord, RecoveryEvent, ladder_configs, ladder_peaks, pick_rung
from ._state import TrainResult

__all__ = ["LaunchSpec", "launch_training", "distributed_ladder"]

log = logging.getLogger("memplan.launch")

StartMethod = Literal["spawn", "fork", "forkserver"]

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "estimators", "memplan.training._trainer",
            "memplan.training._launch"]
"""What the forkserver imports once for all ranks (DDP and FSDP2 import torch._dynamo: seconds)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """How many processes, on how many machines, meeting where (torchrun's options)."""

    nproc_per_node: int = 1
    """Processes (devices) on this machine."""
    nnodes: int = 1
    """Machines; each runs the same command with its own ``node_rank``."""
    node_rank: int = 0
    """This machine's rank (used by the ``static`` rendezvous)."""
    rdzv_endpoint: str | None = None
    """``host:port`` where the machines meet. ``None``: this machine, a free port (one node only)."""
    rdzv_id: str | None = None
    """The job's id, the same on every machine. ``None``: a fresh one (one node only)."""
    rdzv_backend: str = "c10d"
    """``c10d`` (torchrun's default) or ``static`` (fixed node ranks)."""
    start_method: StartMethod = "forkserver"
    """How ranks are started. ``forkserver`` (default): a server process imports torch once and
    forks every rank from it -- safe with CUDA, as ``spawn`` is (the server never touches the
    GPU), but a relaunch after an OOM starts in under a second instead of re-importing torch in
    every rank (~10 s on a busy machine). ``fork`` forks this process (only where it has no
    other threads: the agent's own threads can deadlock a forked child)."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers (how fast a failure is noticed)."""
    timeout_s: float | None = None
    """How long a collective (and the process group's start) may wait for the other ranks before
    it fails. ``None``: torch's default (30 minutes on gloo, 10 on NCCL)."""

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and (self.rdzv_endpoint is None or self.rdzv_id is None):
            raise ConfigError("training on several machines needs --rdzv-endpoint HOST:PORT and --rdzv-id ID, "
                              "the same on every machine")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigError(f"start_method must be spawn, fork or forkserver, got {self.start_method!r}")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def distributed_ladder(ladder: Sequence[Any] | None, config: TrainConfig) -> list[TrainConfig]:
    """The rungs a distributed run can step down to: ``config``'s global batch, strategy, world
    size and tensor-parallel degree (a relaunch keeps the processes it has and the checkpoint
    format it wrote)."""
    return [c for c in ladder_configs(ladder, config)
            if c.strategy == config.strategy and c.world_size == config.world_size and c.tp == config.tp
            and c.sequence_parallel == config.sequence_parallel and c.dp_replicate == config.dp_replicate]


def launch_training(
    model_path: str | os.PathLike[str],
    config: TrainConfig,
    options: TrainOptions,
    *,
    spec: LaunchSpec,
    budget_bytes: int | None = None,
    ladder: Sequence[Any] | None = None,
) -> TrainResult | None:
    """Train ``config`` on ``spec.world_size`` processes; returns rank 0's result (``None`` on
    the machines that do not hold rank 0).

    ``budget_bytes`` is each device's budget (enforced in each rank as in single-device runs);
    ``ladder`` the configurations OOM recovery may step down to (``Plan.ladder()``).

    Example:
        >>> launch_training("model.py", TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2),
        ...                 TrainOptions(max_steps=10), spec=LaunchSpec(nproc_per_node=2))  # doctest: +SKIP
    """
    _check_launch(config, spec)
    out_dir = Path(options.out_dir)
    # The machine of rank 0 holds the folder for every attempt; its ranks find the claim in
    # their environment (HELD_ENV) and leave the folder to it.
    with run_holds(out_dir, options, holder=spec.node_rank == 0):
        return _launch_attempts(model_path, config, options, spec, budget_bytes, ladder)


def _launch_attempts(model_path: str | os.PathLike[str], config: TrainConfig, options: TrainOptions,
                     spec: LaunchSpec, budget_bytes: int | None,
                     ladder: Sequence[Any] | None) -> TrainResult | None:
    """Launch the ranks; after an OOM, again on the next rung, resuming (see launch_training)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rungs = distributed_ladder(ladder, config)
    peaks = ladder_peaks(ladder)
    recoveries: list[dict[str, Any]] = []
    tried = [config]
    recovery_state: dict[str, Any] | None = None
    run_id = spec.rdzv_id or uuid.uuid4().hex[:12]
    threads = max(1, (os.cpu_count() or 1) // spec.nproc_per_node)
    if spec.start_method == "forkserver":
        _preload_forkserver()
    attempt = 0
    while True:
        OOMRecord.clear(out_dir)
        _clear_failures(out_dir)
        job = _RankJob(
            model_path=str(Path(model_path).resolve()),
            config=config.to_dict(),
            options=options,
            budget_bytes=budget_bytes,
            ladder=[c.to_dict() for c in rungs],
            recovery_state=recovery_state,
            threads=threads,
            timeout_s=spec.timeout_s,
            log_level=logging.getLogger("memplan").getEffectiveLevel(),
            env={**os.environ, HELD_ENV: os.path.abspath(out_dir)},
        )
        try:
            with _quiet_agent():
                results = elastic_launch(_launch_config(spec, f"{run_id}-{attempt}"), _rank_main)(job)
        except ChildFailedError as exc:
            records = OOMRecord.read_all(out_dir)
            if not records:
                raise TrainingError(_failure_message(exc, out_dir)) from None
            config, event = _step_down(records, rungs, peaks, budget_bytes, tried, spec, out_dir)
            recoveries.append(event)
            options = replace(options, resume=True)
            recovery_state = {
                "recoveries": recoveries,
                "tried": [c.to_dict() for c in tried],
                "failed_at": records[0].time,
            }
            attempt += 1
            continue
        OOMRecord.clear(out_dir)
        result = results.get(0)
        return result if isinstance(result, TrainResult) else None


def _check_launch(config: TrainConfig, spec: LaunchSpec) -> None:
    """The configuration runs on the processes the launch asks for."""
    if config.ranks != spec.world_size:
        raise ConfigError(
            f"the configuration ({config.describe()}) runs on {config.ranks} processes but "
            f"{spec.nproc_per_node} x {spec.nnodes} node(s) = {spec.world_size} were asked for; "
            f"use --nproc {config.ranks} or plan for {spec.world_size}"
        )
    if config.strategy == "single" and config.tp == 1 and config.pp == 1:
        raise ConfigError("strategy 'single' runs in this process; launch only ddp, fsdp, tp or pp configurations")
    if config.nodes != spec.nnodes:
        log.warning(
            "the configuration was planned for %d machine(s) and runs on %d: its predicted step time "
            "assumed another network",
            config.nodes,
            spec.nnodes,
        )


def _preload_forkserver() -> None:
    """Effective when the server starts (the first launch of this process); later launches,
    the relaunches of OOM recovery among them, fork from the warm server."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def _launch_config(spec: LaunchSpec, run_id: str) -> Any:
    """torchrun's launch options for one attempt (a fresh rendezvous id per attempt: every
    machine counts the same attempts)."""
    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs: dict[str, Any] = {"rank": spec.node_rank} if spec.rdzv_backend == "static" else {}
    return LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        rdzv_backend=spec.rdzv_backend,
        rdzv_endpoint=spec.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs=rdzv_configs,
        run_id=run_id,
        max_restarts=0,
        start_method=spec.start_method,
        monitor_interval=spec.monitor_interval,
    )


def _step_down(
    records: list[OOMRecord],
    rungs: list[TrainConfig],
    peaks: dict[TrainConfig, int],
    budget_bytes: int | None,
    tried: list[TrainConfig],
    spec: LaunchSpec,
    out_dir: Path,
) -> tuple[TrainConfig, dict[str, Any]]:
    """The ranks' OOM records -> the rung every rank relaunches on and the recovery event (the
    rule of the single-process ``InProcessRecovery``); a ``TrainingError`` when none is left."""
    first = records[0]
    old = TrainConfig.from_dict(first.config)
    peak = max((r.peak_at_failure for r in records if r.peak_at_failure is not None), default=None)
    if not rungs:
        raise _exhausted(first, records, old, tried, peak, out_dir) from None
    new, skipped = pick_rung(rungs, peaks, budget_bytes)
    tried.append(new)
    event = RecoveryEvent(
        step=first.step,
        phase=first.phase,
        from_config=old.to_dict(),
        to_config=new.to_dict(),
        peak_at_failure=peak,
        seconds=0.0,
        error=f"rank {first.rank}: {first.error}",
        skipped=[c.to_dict() for c in skipped],
    ).to_dict()
    event.update(
        ranks=sorted({r.rank for r in records}),
        resume_step=first.resume_step,
        window_start_checkpoint=first.window_start_checkpoint,
    )
    log.warning(
        "out of memory on rank(s) %s at step %d in %s with %s; relaunching all %d ranks with %s from %s",
        ",".join(map(str, event["ranks"])),
        first.step,
        first.phase,
        old.describe(),
        spec.world_size,
        new.describe(),
        f"the checkpoint of step {first.resume_step}" if first.resume_step is not None else "the start",
    )
    return new, event


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """torchrun's agent logs every failed worker with its whole traceback; an OOM that is being
    recovered is not an error, and any other failure is reported once, in one line, with the
    traceback in the rank's ``failure-rank<R>.json``."""
    agent_logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [lg.level for lg in agent_logs]
    for lg in agent_logs:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(agent_logs, levels):
            lg.setLevel(level)


def _exhausted(
    first: OOMRecord,
    records: list[OOMRecord],
    old: TrainConfig,
    tried: list[TrainConfig],
    peak: int | None,
    out_dir: Path,
) -> TrainingError:
    where = (
        f"the last good checkpoint is {out_dir / 'checkpoint.pt'} (step {first.resume_step})"
        if first.resume_step is not None
        else "no checkpoint was written"
    )
    measured = f"measured peak at failure {format_size(peak)}" if peak is not None else "peak at failure unknown"
    if first.budget is not None:
        measured += f" of budget {format_size(first.budget)}"
    ranks = ",".join(str(r) for r in sorted({r.rank for r in records}))
    return TrainingError(
        f"ran out of memory at step {first.step} in {first.phase} on rank(s) {ranks} with {old.describe()} "
        f"({first.error}); no smaller configuration with the same global batch of {old.global_batch}, strategy "
        f"and world size is left (tried: {'; '.join(t.describe() for t in tried)}); {where}; {measured} "
        "-- raise --vram or reduce the model"
    )
