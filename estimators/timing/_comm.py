"""Communication time of data-parallel training, and how much of it backward hides.

Collectives are priced with the ring algorithm's cost (what NCCL and gloo use for large
messages): for W ranks and a message of N bytes (the full, unsharded size),

* all-reduce moves ``2 (W-1)/W · N`` bytes per rank in ``2 (W-1)`` steps;
* all-gather and reduce-scatter move ``(W-1)/W · N`` bytes per rank in ``W-1`` steps;

at the slowest link of the ring, plus a fixed latency per step. Within a node the link is
the GPU's ``interconnect_bytes_per_s`` (NVLink, else PCIe) from the spec table; a ring over
several nodes crosses the network, at :data:`INTER_NODE_BYTES_PER_S` per GPU.

Overlap, as the engines schedule it:

* DDP all-reduces each gradient bucket as soon as backward has filled it, so only the last
  bucket's all-reduce is exposed — unless the all-reduces together outlast backward's compute,
  and then the excess is exposed too. Micro-batches under ``no_sync`` communicate nothing.
* FSDP2 all-gathers each unit's parameters before its forward and again before its
  backward (blocks are resharded after forward; the root is not), and reduce-scatters each
  unit's gradients after its backward (every micro-batch: gradients stay sharded). The first
  all-gather of a pass waits for nothing to overlap with and the last reduce-scatter has
  nothing left to hide behind: both are exposed; the rest overlaps compute, and whatever
  exceeds the pass's compute is exposed.

HSDP (``TrainConfig.dp_replicate``) runs FSDP2's gathers and reduce-scatters within a group of
``world_size / dp_replicate`` neighbouring ranks and all-reduces each unit's gradient shard
across the groups after its reduce-scatter, overlapped as the reduce-scatters are.

Tensor parallelism (``TrainConfig.tp``) communicates inside each block's forward and
backward: its collectives are the trace's own ops (``_c10d_functional.*``, at the shard's
sizes), priced one by one over the ``tp`` ranks of a node (:func:`tensor_parallel_comm`); the
next op needs each one's result, so eager training hides none of them. Under FSDP2 x TP the
data-parallel ring has ``world_size`` ranks and each unit moves ``1/tp`` of its parameters (the
split linears, which hold nearly all of a block's).

Assumptions (not validated on a multi-GPU machine): the link rates below, the latencies, and
perfect overlap up to the compute time. CPU targets communicate through gloo over loopback.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._config import TrainConfig
from ..hardware._gpus import GPUSpec

__all__ = [
    "INTER_NODE_BYTES_PER_S", "GLOO_LOOPBACK_BYTES_PER_S", "RING_STEP_LATENCY_S", "CommTime",
    "ring_bandwidth", "all_reduce_s", "all_gather_s", "reduce_scatter_s", "ddp_comm", "fsdp_comm",
    "COLLECTIVE_PREFIX", "tensor_parallel_comm",
]

COLLECTIVE_PREFIX = "_c10d_functional."
"""The traced ops that are collectives (DTensor's), not kernels of the device."""

INTER_NODE_BYTES_PER_S = 25e9
"""Network bandwidth per GPU between nodes, one direction: a 200 Gb/s NIC per GPU (InfiniBand
HDR/NDR-200 or 200 GbE RoCE), the common rate of GPU clusters."""

GLOO_LOOPBACK_BYTES_PER_S = 2e9
"""Assumed rate of gloo collectives between processes of one machine (TCP over loopback,
one copy per hop): an assumption, of the order measured on commodity servers."""

RING_STEP_LATENCY_S = {"nvlink": 5e-6, "network": 15e-6, "gloo": 50e-6}
"""Fixed cost of one ring step: NCCL's per-hop latency within a node and across nodes, and
gloo's (a TCP round trip on loopback)."""


@dataclass(frozen=True, slots=True)
class CommTime:
    total_s: float
    """Time all collectives of one optimizer step take, overlapped or not."""
    exposed_s: float
    """The part that adds to the step time."""


def ring_bandwidth(spec: GPUSpec | None, nodes: int) -> tuple[float, float]:
    """(bytes/s, seconds per ring step) of the slowest link of a ring over ``nodes`` nodes."""
    if spec is None:
        return GLOO_LOOPBACK_BYTES_PER_S, RING_STEP_LATENCY_S["gloo"]
    if nodes > 1:
        return min(spec.interconnect_bytes_per_s, INTER_NODE_BYTES_PER_S), RING_STEP_LATENCY_S["network"]
    return spec.interconnect_bytes_per_s, RING_STEP_LATENCY_S["nvlink"]


def all_reduce_s(nbytes: float, world_size: int, link: tuple[float, float]) -> float:
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return 2 * (world_size - 1) / world_size * nbytes / bw + 2 * (world_size - 1) * lat


def all_gather_s(nbytes: float, world_size: int, link: tuple[float, float]) -> float:
    """``nbytes``: the gathered (unsharded) size."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return (world_size - 1) / world_size * nbytes / bw + (world_size - 1) * lat


reduce_scatter_s = all_gather_s
"""Same volume and steps as an all-gather of the unsharded size."""


def ddp_comm(bucket_bytes: list[int] | tuple[int, ...], backward_s: float, config: TrainConfig,
             link: tuple[float, float]) -> CommTime:
    """One optimizer step's all-reduces of DDP's buckets (in all-reduce order)."""
    times = [all_reduce_s(b, config.world_size, link) for b in bucket_bytes]
    total = sum(times)
    if not times:
        return CommTime(0.0, 0.0)
    exposed = max(times[-1], total - backward_s)
    return CommTime(total, exposed)


def tensor_parallel_comm(names: list[str], bytes_moved: list[float], runs: list[float], tp: int,
                         link: tuple[float, float]) -> CommTime:
    """One optimizer step's tensor-parallel collectives: per traced collective, its name, the
    bytes it read and wrote (a rank's), and how many times a step runs it."""
    total = 0.0
    for name, moved, n in zip(names, bytes_moved, runs):
        op = name[len(COLLECTIVE_PREFIX):].split(".")[0]
        if op.startswith("all_reduce"):
            seconds = all_reduce_s(moved / 2, tp, link)  # in and out: the message twice
        elif op.startswith(("all_gather", "reduce_scatter")):
            # The full message is the gathered output (the scattered input): tp of tp + 1 parts.
            seconds = all_gather_s(moved * tp / (tp + 1), tp, link)
        elif op.startswith("all_to_all"):
            seconds = all_gather_s(moved / 2, tp, link)
        else:  # wait_tensor, broadcast of a scalar: no volume of their own
            seconds = 0.0
        total += n * seconds
    return CommTime(total, total)


def fsdp_comm(units: list[int] | tuple[int, ...], root: int, param_bytes: int, grad_bytes: int,
              forward_s: float, backward_s: float, config: TrainConfig,
              link: tuple[float, float], replicate_link: tuple[float, float] | None = None) -> CommTime:
    """One optimizer step of FSDP2: ``units`` are the blocks' parameter counts, ``root`` the
    root's; parameters are gathered in ``param_bytes`` per element, gradients reduced in
    ``grad_bytes``. Under HSDP the gathers and reduce-scatters run within a shard group (on
    ``link``) and each unit's gradient shard is then all-reduced across the ``dp_replicate``
    groups (on ``replicate_link``), behind the next unit's backward as the scatters are."""
    w = config.shard_size
    if config.world_size <= 1:
        return CommTime(0.0, 0.0)
    gathers_fwd = [all_gather_s(n * param_bytes, w, link) for n in (root, *units) if n]
    # Backward re-gathers the blocks (resharded after forward), last block first.
    gathers_bwd = [all_gather_s(n * param_bytes, w, link) for n in reversed(units) if n]
    scatters = [reduce_scatter_s(n * grad_bytes, w, link)
                + all_reduce_s(n * grad_bytes / w, config.dp_replicate, replicate_link or link)
                for n in (*reversed(units), root) if n]
    micro = config.grad_accum_steps
    # Every micro-batch reduce-scatters its gradients (``_parallel.gradient_sync``: FSDP2
    # accumulates sharded gradients, never unsharded ones).
    total = micro * (sum(gathers_fwd) + sum(gathers_bwd) + sum(scatters))
    if not gathers_fwd:
        return CommTime(0.0, 0.0)

    def pass_exposed(comms: list[float], compute_s: float, first: bool, last: bool) -> float:
        if not comms:
            return 0.0
        head = comms[0] if first else 0.0
        tail = comms[-1] if last else 0.0
        hidden = sum(comms) - head - tail
        return head + tail + max(0.0, hidden - compute_s)

    fwd = pass_exposed(gathers_fwd, forward_s, True, False)
    bwd = pass_exposed(gathers_bwd + scatters, backward_s, False, True)
    exposed = micro * (fwd + bwd)
    return CommTime(total, exposed)


def pipeline_time(compute_s: float, config: TrainConfig, send_bytes: int, link: tuple[float, float]) -> CommTime:
    """What a pipeline adds to one process's compute (``compute_s``, the busiest stage's
    forward and backward over the step's micro-batches): the bubble, in which a stage waits for
    the first micro-batch to reach it and the last to come back (``(pp - 1) / (v * m)`` of the
    compute for ``m`` micro-batches and ``v`` stages a process, as Megatron-LM and torchtitan
    count it; the same for GPipe and 1F1B, which differ in memory), and the transfers between
    stages: each micro-batch's activations forward and their gradients back, ``send_bytes``
    each way per micro-batch and stage. A transfer overlaps the next micro-batch's compute,
    except those on the fill and drain path, one each way per stage boundary."""
    from ..runtime._pipeline import VIRTUAL_STAGES

    v = VIRTUAL_STAGES[config.pp_schedule]
    m = config.pp_microbatches
    bubble = compute_s * (config.pp - 1) / (v * m)
    bw, lat = link
    one = send_bytes / bw + lat if send_bytes else 0.0
    total = 2 * m * v * one
    exposed = 2 * (config.pp - 1) * one
    return CommTime(total_s=total + bubble, exposed_s=exposed + bubble)
