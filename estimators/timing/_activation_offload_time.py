"""The time activation offloading adds: the host link's copies, overlapped with compute.

Each micro-batch copies its offloaded activations device -> host in forward and the same bytes
host -> device in backward (every saved tensor is brought back once). The copies run on a side
stream (``runtime._offload``) while the GPU works through its queued kernels, so a pass takes
``max(compute, transfer)``: what offloading adds is the part of each pass's transfer that its
compute does not hide. The bytes are those of the trace's host copies (``Category.OFFLOADED``)
born in each steady-state forward.

The link: the card's PCIe link to the host. The spec table's ``interconnect_bytes_per_s`` is
that link for cards without NVLink (its convention); NVLink cards still reach the host over
PCIe, whose generation follows the architecture (Volta/Turing gen3, Ampere/Ada gen4, Hopper and
later gen5). Pinned-memory copies reach about 80% of a link's theoretical rate (the 128b/130b
encoding and the packets' headers take the rest: ~25-26 GB/s of gen4 x16's 32 in CUDA's
``bandwidthTest``), hence :data:`LINK_EFFICIENCY`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..hardware._gpus import GPUSpec
from ..memory._prepare import Prepared
from ..tracing._recorder import Category
from ._timing import DeviceRates, _work_per_op, costs_of

__all__ = ["LINK_EFFICIENCY", "OffloadTime", "host_link_bytes_per_s", "activation_offload_time"]

LINK_EFFICIENCY = 0.8
"""Fraction of the PCIe link's theoretical rate pinned host <-> device copies reach."""

_PCIE_BY_ARCH = {7: 16e9, 8: 32e9}  # compute capability major -> x16 bytes/s, one direction
_PCIE_LATEST = 64e9  # gen5: Hopper (9.x) and later
_PCIE_MAX = 64e9  # a table interconnect above this is NVLink, not the host link


@dataclass(frozen=True)
class OffloadTime:
    bytes_per_micro: int
    """Bytes copied each way per steady-state micro-batch (the first micro-batch's)."""
    link_bytes_per_s: float
    total_s: float
    """All copies of one optimizer step, both directions."""
    exposed_s: float
    """The part of ``total_s`` the passes' compute does not hide."""


def host_link_bytes_per_s(spec: GPUSpec) -> float:
    """The achievable rate of pinned copies between ``spec``'s card and its host, one direction."""
    link = spec.interconnect_bytes_per_s
    if link > _PCIE_MAX:  # NVLink to the other cards; the host hangs off PCIe
        major = spec.compute_capability[0]
        link = _PCIE_BY_ARCH.get(major, _PCIE_LATEST if major >= 9 else _PCIE_BY_ARCH[7])
    return link * LINK_EFFICIENCY


def activation_offload_time(
    p: Prepared, grad_accum_steps: int, rates: DeviceRates, spec: GPUSpec | None
) -> OffloadTime | None:
    """The transfers of one optimizer step of ``p``'s configuration, or None when nothing is
    offloaded (a CPU target, or offloading off)."""
    if spec is None:
        return None
    offloaded = _offloaded_per_phase(p)
    if not offloaded.any():
        return None
    link = host_link_bytes_per_s(spec)
    compute = _compute_per_phase(p, rates)
    labels = p.phase_labels
    total = exposed = 0.0
    first_bytes = None
    for i, weight in _steady_forwards(labels, grad_accum_steps):
        moved = float(offloaded[i])
        if first_bytes is None:
            first_bytes = int(moved)
        seconds = moved / link
        backward = _matching_backward(labels, i)
        hidden_fwd = compute[i]
        hidden_bwd = compute[backward] if backward is not None else 0.0
        total += weight * 2 * seconds
        exposed += weight * (max(0.0, seconds - hidden_fwd) + max(0.0, seconds - hidden_bwd))
    return OffloadTime(first_bytes or 0, link, total, exposed)


def _offloaded_per_phase(p: Prepared) -> np.ndarray:
    """Bytes of host copies made in each phase."""
    born = (p.event_sign > 0) & (p.alloc_category[p.event_alloc] == int(Category.OFFLOADED))
    return np.bincount(
        p.event_phase[born],
        weights=p.alloc_bytes[p.event_alloc[born]].astype(np.float64),
        minlength=len(p.phase_labels),
    )


def _compute_per_phase(p: Prepared, rates: DeviceRates) -> np.ndarray:
    """Uncalibrated seconds of each phase's kernels (roofline work plus per-op overhead)."""
    costs = costs_of(p)
    per_op = _work_per_op(costs, p.phase_labels, rates) + rates.op_overhead_s
    return (
        np.bincount(costs.phase, weights=per_op, minlength=len(p.phase_labels))
        if len(per_op)
        else np.zeros(len(p.phase_labels))
    )


def _steady_forwards(labels: Sequence[str], grad_accum_steps: int) -> list[tuple[int, float]]:
    """Step 2's forward phases and how many micro-batches of a window each stands for (as
    ``_timing._steady_state_weights``: the first micro-batch once, an accumulating one A - 1 times)."""
    forwards = [i for i, label in enumerate(labels) if label.startswith("step 2") and label.endswith("forward")]
    if len(forwards) == 1:
        return [(forwards[0], float(grad_accum_steps))]
    if not forwards:
        return []
    return [(forwards[0], 1.0), (forwards[-1], float(max(grad_accum_steps - 1, 0)))]


def _matching_backward(labels: Sequence[str], forward: int) -> int | None:
    want = labels[forward].removesuffix("forward") + "backward"
    return next((i for i, label in enumerate(labels) if label == want), None)
