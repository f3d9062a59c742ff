"""The reference: what the CPU allocator really hands out during real training steps.

``torch.profiler`` with ``profile_memory=True`` sees every allocation and free made through
PyTorch's CPU allocator — tensors *and* kernel scratch buffers — so the running sum of its
allocation events is the allocator's live-byte count. The model's parameters and buffers
exist before profiling starts, so they are added as a baseline.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn

from . import _checkpoint
from ._config import TrainConfig
from ._task import Task
from ._trace import run_steps

__all__ = ["CpuMeasurement", "measure_cpu_peak", "storage_bytes"]


@dataclass(frozen=True, slots=True)
class CpuMeasurement:
    peak_bytes: int
    baseline_bytes: int
    """Parameters and buffers alive before the steps."""


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def measure_cpu_peak(task: Task, config: TrainConfig, *, steps: int = 2, model: nn.Module | None = None) -> CpuMeasurement:
    """Run ``steps`` real optimizer steps on the CPU and return the allocator's peak."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if model is None:
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
    model.train()
    _checkpoint.apply_checkpointing(model, config.checkpoint_segments, task.checkpoint_blocks)
    baseline = storage_bytes([*model.parameters(), *model.buffers()])
    task.batch_template()  # build the dataset outside the profiled region
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_steps(task, config, model, batch_size=config.micro_batch_size, real=True, steps=steps)
    events: list[Any] = []

    def walk(nodes: Iterable[Any]) -> None:
        for n in nodes:
            if n.tag == _EventType.Allocation:
                events.append(n)
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort(key=lambda e: e.start_time_ns)
    running = peak = 0
    for e in events:
        running += e.extra_fields.alloc_size
        peak = max(peak, running)
    return CpuMeasurement(peak_bytes=baseline + peak, baseline_bytes=baseline)
