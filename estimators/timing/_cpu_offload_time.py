"""The time CPU offload adds to a step: host<->device copies over PCIe and the optimizer on the CPU.

Under FSDP2's ``CPUOffloadPolicy`` every micro-batch copies each unit's parameter shards to
the device before its all-gather (in forward, and again in backward for the blocks, which are
resharded after forward; the root is not), and each unit's reduced gradients back to the
host; gradients of later micro-batches are added to the host's on the CPU. The optimizer
steps on the CPU, over host memory.

* Copies overlap compute: FSDP2 issues a unit's copy and gather on their own stream while
  the previous unit computes, so a pass costs the larger of its compute and its copies.
  Host-to-device and device-to-host use the two directions of the link at once.
* The link: the card's PCIe link to the host at the rate pinned copies reach
  (``_activation_offload_time.host_link_bytes_per_s``, which activation offloading uses too).
* The CPU's work is memory-bound: the bytes the trace's optimizer-phase ops move (and the
  gradient additions) over :data:`HOST_BANDWIDTH`, an assumption about the host (not
  measured: a plan for a card that is not here cannot know its host), said in the estimate's
  notes. PyTorch's multi-tensor CPU AdamW runs ~0.5-1 billion parameters a second on a
  server socket, ~25 GB/s of the ~40-60 bytes a parameter its ops move.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._config import TrainConfig
from ..hardware._gpus import GPUSpec
from ..memory._facts import ModelFacts
from ..runtime._precision import weight_dtype
from ._activation_offload_time import host_link_bytes_per_s

__all__ = ["HOST_BANDWIDTH", "CpuOffloadTime", "cpu_offload_time"]

HOST_BANDWIDTH = 25e9
"""Bytes per second the host's memory moves for the CPU optimizer step (an assumption)."""


@dataclass(frozen=True)
class CpuOffloadTime:
    copy_s: float
    """PCIe seconds per optimizer step (both directions, summed)."""
    exposed_copy_s: float
    """The part compute does not hide."""
    host_s: float
    """The CPU's seconds: the optimizer step and the gradient additions of accumulation."""

    @property
    def added_s(self) -> float:
        return self.exposed_copy_s + self.host_s

    def note(self) -> str:
        return (f"CPU offload: {self.copy_s * 1e3:.1f} ms of PCIe copies per step "
                f"({self.exposed_copy_s * 1e3:.1f} ms not hidden by compute), {self.host_s * 1e3:.1f} ms on the "
                f"CPU (optimizer step; host memory assumed to move {HOST_BANDWIDTH / 1e9:.0f} GB/s)")


def cpu_offload_time(config: TrainConfig, facts: ModelFacts, spec: GPUSpec, *, forward_s: float,
                     backward_s: float, optimizer_bytes: int) -> CpuOffloadTime:
    """What offload adds to one optimizer step of ``config``; ``forward_s``/``backward_s``: one
    micro-batch's compute; ``optimizer_bytes``: the bytes the optimizer phase's ops move."""
    w = config.world_size
    low = weight_dtype(config.precision) is not None
    stored = 2 if low else 4  # the shards' dtype: the model's (fp32 under mixed precision)
    reduced = 2 if low else 4  # gradients reach the host in the reduce dtype (fp32 when mixed)
    blocks = sum(facts.units.block_numels)
    link = host_link_bytes_per_s(spec)
    to_device_fwd = (blocks + facts.units.root_numel) * stored / w / link
    to_device_bwd = blocks * stored / w / link
    to_host = facts.trainable * reduced / w / link
    micro = config.grad_accum_steps
    exposed = max(0.0, to_device_fwd - forward_s) + max(0.0, max(to_device_bwd, to_host) - backward_s)
    copies = to_device_fwd + to_device_bwd + to_host
    # Later micro-batches' gradients are added to the host's: read both, write one.
    accumulate = (micro - 1) * 3 * facts.trainable * reduced / w
    host = (optimizer_bytes + accumulate) / HOST_BANDWIDTH
    return CpuOffloadTime(copies * micro, exposed * micro, host)
