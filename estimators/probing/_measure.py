"""The reference: what the CPU allocator really hands out during real training steps.

``torch.profiler`` with ``profile_memory=True`` sees every allocation and free made through
PyTorch's CPU allocator — tensors *and* kernel scratch buffers — so the running sum of its
allocation events is the allocator's live-byte count. The model's parameters and buffers
exist before profiling starts, so they are added as a baseline.

:func:`measure_distributed_peaks` does the same on every rank of a real ``ddp`` or ``fsdp``
run: W processes with the gloo backend, wrapped by ``estimators.runtime._parallel`` exactly as the
trainer wraps. What wrapping allocates or frees (DDP's buckets, FSDP2's sharding) is profiled
too and counted in the baseline; the peak is taken over the training steps. Blocks that other
threads allocate there (gloo's collective scratch, on its worker threads, at timing-dependent
moments; NCCL has none) are left out: the figure is the training step's own memory.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._config import TrainConfig
from .._step_options import StepOptions
from ..runtime._build import BuiltModel, build_for_training
from ..runtime._planned import PlannedSteps
from ..runtime._step import make_step_parts, train_step
from ..task._shapes import dataset_length
from ..task._task import Task
from ..tracing._profiler import event_tree, walk_events
from ..tracing._simulated_ranks import local_tensor
from ._messages import ConfigDict

if TYPE_CHECKING:
    from torch._C._profiler import _ExtraFields_Allocation, _ProfilerEvent
    from torch.profiler import profile

__all__ = ["CpuMeasurement", "measure_cpu_peak", "measure_epoch_peak", "measure_distributed_peaks", "storage_bytes"]


@dataclass(frozen=True, slots=True)
class CpuMeasurement:
    peak_bytes: int
    baseline_bytes: int
    """Bytes alive before the steps: parameters and buffers (sharded under fsdp), DDP's
    gradient buckets."""


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once; a
    DTensor's local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = local_tensor(t).untyped_storage()  # a DTensor's memory is its shard's
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _profiled() -> profile:
    from ..tracing._profiler import memory_profile

    return memory_profile()


_STEPS_MARK = "memplan::steps"


def _allocation_levels(prof: profile, *, from_mark: str | None = None) -> tuple[int, int]:
    """(peak, level at the start) of the running sum of a profile's allocation events; with
    ``from_mark``, the peak is taken from the start of that ``record_function`` range on and
    the level is the running sum when it starts."""
    from torch._C._profiler import _ExtraFields_Allocation

    events: list[tuple[_ProfilerEvent, _ExtraFields_Allocation]] = []
    marks: list[int] = []
    main_tid: int | None = None
    for n in walk_events(event_tree(prof)):
        if isinstance(n.extra_fields, _ExtraFields_Allocation):
            events.append((n, n.extra_fields))
        elif from_mark is not None and n.name == from_mark:
            marks.append(n.start_time_ns)
            main_tid = n.start_tid
    events.sort(key=lambda e: e[0].start_time_ns)
    start = min(marks) if marks else None
    running = peak = level = 0
    # Blocks allocated by other threads than the one that runs the steps: gloo's worker
    # threads allocate scratch of their own during collectives, at moments that depend on
    # thread timing (NCCL has none); the estimate describes the training step's own memory.
    # Such a block is skipped, and so is its release, on whatever thread that happens; so is
    # one allocated inside the process group's own call (``c10d::_allgather_base_``): gloo
    # gathers into a scratch copy of the output and reduce-scatters through a scratch copy of
    # the input, where NCCL works in the buffers the functional collective allocated (and the
    # trace records) before it calls the process group.
    foreign: set[int] = set()
    for e, fields in events:
        if start is not None and e.start_time_ns >= start and level is not None:
            level, peak = running, running
            start = None
        size, ptr = fields.alloc_size, fields.ptr
        if size > 0 and ((main_tid is not None and e.start_tid != main_tid) or _in_process_group_call(e)):
            foreign.add(ptr)
            continue
        if size < 0 and ptr in foreign:
            foreign.discard(ptr)
            continue
        running += size
        peak = max(peak, running)
    if from_mark is not None and start is not None:  # nothing allocated during the steps
        level = peak = running
    return peak, level


def _in_process_group_call(event: _ProfilerEvent) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name.startswith("c10d::"):
            return True
        parent = parent.parent
    return False


def measure_cpu_peak(task: Task, config: TrainConfig, *, steps: int = 2, model: nn.Module | None = None,
                     batch_offset: int = 0, options: StepOptions | None = None) -> CpuMeasurement:
    """Run ``steps`` real optimizer steps on the CPU and return the allocator's peak.

    The batches are those the estimate is made for (``Task.real_batch``: the planned batch of
    varying-shape data); ``batch_offset`` starts them elsewhere (the draw a data-dependent
    model's estimate names in ``Estimate.batch_shapes``). ``options``: the step's clipping,
    EMA, ... (:class:`~estimators._step_options.StepOptions`; ``task.step`` when None).

    ``ddp``/``fsdp`` configurations need an initialised default process group (see
    :func:`measure_distributed_peaks`); the model is then built and wrapped, as the trainer
    wraps it, inside the profiled region: the profiler does not report the release of memory
    allocated before it started, and wrapping releases some (FSDP2 drops the unsharded
    parameters, DDP its first buckets when it rebuilds them). The peak is taken over the steps.
    """
    task.batch_template()  # build the dataset outside the profiled region

    def run(built: BuiltModel) -> None:
        steps_of = PlannedSteps(task, config, built, options=options, batch_offset=batch_offset)
        for i in range(1, steps + 1):
            steps_of(i)

    if config.strategy != "single" or config.pp > 1:
        with _profiled() as prof:
            if model is None:
                model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
            built = build_for_training(task, config, "cpu", model=model)
            # A pipeline's process keeps its stages only; the rest of the model goes, as in training.
            model = None
            with torch.profiler.record_function(_STEPS_MARK):
                run(built)
        peak, level = _allocation_levels(prof, from_mark=_STEPS_MARK)
        return CpuMeasurement(peak_bytes=peak, baseline_bytes=level)
    if model is None:
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
    built = build_for_training(task, config, "cpu", model=model)
    baseline = storage_bytes([*model.parameters(), *model.buffers()])
    with _profiled() as prof:
        run(built)
    peak, _ = _allocation_levels(prof)
    return CpuMeasurement(peak_bytes=baseline + peak, baseline_bytes=baseline)


def measure_epoch_peak(task: Task, config: TrainConfig, *, seed: int = 0,
                       options: StepOptions | None = None) -> tuple[CpuMeasurement, int]:
    """The allocator's peak over one real epoch of ``config`` on the CPU: the dataset in a
    seeded random order (``torch.randperm``, as ``DistributedSampler`` draws it), cut into
    windows of ``config.global_batch`` items and those into micro-batches, each collated by
    the task's collate and stepped by :func:`~estimators.runtime._step.train_step`, as the
    trainer steps it. What a plan made for varying shapes must never fall below. Returns the
    measurement and the number of micro-batches."""
    data = task.dataset()
    if data is None or config.strategy != "single":
        raise ValueError("measure_epoch_peak needs a dataset and a one-device configuration")
    n = dataset_length(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
    built = build_for_training(task, config, "cpu", model=model)
    baseline = storage_bytes([*model.parameters(), *model.buffers()])
    micro_batches = 0
    with _profiled() as prof:
        parts = make_step_parts(task, config, built.model, built.wrapped, device=torch.device("cpu"),
                                options=options if options is not None else task.step)
        for step, start in enumerate(range(0, n - config.global_batch + 1, config.global_batch), 1):
            window = order[start:start + config.global_batch]
            chunks = [window[k:k + config.micro_batch_size] for k in range(0, len(window), config.micro_batch_size)]
            batches = (task.collate([data[i] for i in chunk]) for chunk in chunks)
            train_step(parts, batches, [len(c) / len(window) for c in chunks], step=step)
            micro_batches += len(chunks)
    peak, _ = _allocation_levels(prof)
    return CpuMeasurement(peak_bytes=baseline + peak, baseline_bytes=baseline), micro_batches


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, model_path: str, configs: list[ConfigDict],
               steps: int, out_dir: str) -> None:
    import torch.distributed as dist

    from ..task._task import load_task

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        task = load_task(model_path)
        results = []
        for data in configs:
            # The previous configuration's model and optimizer (FSDP2's hooks hold reference
            # cycles) must not be collected in the middle of this one's profile.
            gc.collect()
            dist.barrier()
            torch.manual_seed(0)
            m = measure_cpu_peak(task, TrainConfig.from_dict(data), steps=steps)
            results.append([m.peak_bytes, m.baseline_bytes])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_distributed_peaks(model_path: str, configs: Sequence[TrainConfig], *, steps: int = 2) -> list[list[CpuMeasurement]]:
    """Each configuration trained for real by ``world_size`` CPU processes (gloo), wrapped by
    ``estimators.runtime._parallel``; per configuration, each rank's measurement (rank order).

    All configurations must share one number of ranks (``TrainConfig.ranks``: ``world_size``
    times ``tp``); they run one after the other in the
    same processes (spawned once: a model file path, not a ``Task``, since the task is loaded
    in each process).

    >>> measure_distributed_peaks("examples/digits.py",
    ...     [TrainConfig(micro_batch_size=32, strategy="ddp", world_size=2)])   # doctest: +SKIP
    [[CpuMeasurement(peak_bytes=..., baseline_bytes=...), CpuMeasurement(...)]]
    """
    import torch.multiprocessing as mp

    sizes = {c.ranks for c in configs}
    if len(sizes) != 1:
        raise ValueError(f"configurations of one run must share a number of ranks, got {sorted(sizes)}")
    world_size = sizes.pop()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main,
            args=(
                world_size,
                _free_port(),
                os.path.abspath(model_path),
                [c.to_dict() for c in configs],
                steps,
                out_dir,
            ),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return [[CpuMeasurement(*per_rank[r][i]) for r in range(world_size)] for i in range(len(configs))]
