"""The plan as ``lightning.Trainer`` keyword arguments.

The batch size is not a ``Trainer`` argument: ``MemplanCallback`` sets it where Lightning's
batch size finder would (the module's or the datamodule's ``batch_size``), or use
``plan.config.micro_batch_size`` in the ``DataLoader``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .._plan_facts import checkpointing_caveat, layout

if TYPE_CHECKING:
    from ...planning import Plan

__all__ = ["trainer_kwargs", "caveats", "PRECISION"]

PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "bf16-true": "bf16-true",
             "fp16-true": "16-true"}
"""memplan's precisions as Lightning's ``precision=`` values."""


def trainer_kwargs(plan: Plan) -> dict[str, Any]:
    """``Trainer(**trainer_kwargs(plan), ...)``: accelerator, devices, nodes, strategy,
    precision and accumulation. What Lightning cannot express is warned of (``caveats``)."""
    for line in caveats(plan):
        warnings.warn(f"memplan.integrations.lightning: {line}", UserWarning, stacklevel=2)
    lay = layout(plan)
    out: dict[str, Any] = {
        "accelerator": "cpu" if lay.device == "cpu" else "gpu",
        "devices": lay.per_node,
        "num_nodes": lay.nodes,
        "precision": PRECISION[lay.precision],
        "accumulate_grad_batches": lay.accumulation,
    }
    if lay.strategy == "ddp":
        out["strategy"] = "ddp"
    elif lay.strategy == "fsdp":
        out["strategy"] = "fsdp"
    return out


def caveats(plan: Plan) -> list[str]:
    lay = layout(plan)
    out = checkpointing_caveat(lay, "Lightning", every="the layers your module checkpoints")
    if lay.checkpoint_segments:
        out.append(f"Lightning's Trainer has no activation-checkpointing flag outside FSDP: checkpoint "
                   f"{lay.checkpoint_segments} block(s) in the module (torch.utils.checkpoint), or with "
                   "FSDPStrategy(activation_checkpointing_policy=...)")
    if lay.strategy == "fsdp":
        out.append("strategy='fsdp' is Lightning's FSDPStrategy (FSDP1); the plan was estimated for FSDP2, which "
                   "Lightning runs as ModelParallelStrategy with fully_shard in configure_model")
    if lay.optimizer_in_backward:
        out.append("the optimizer step in backward has no Lightning setting: the peak is higher than planned")
    if lay.cpu_offload:
        out.append("the plan offloads the model state to the CPU: FSDPStrategy(cpu_offload=True) is the nearest")
    if lay.offload_activations:
        out.append("the plan offloads saved activations: Lightning has no setting (torch.autograd.graph."
                   "save_on_cpu in training_step is the nearest)")
    if lay.compile:
        out.append("the plan trains compiled: torch.compile the module in configure_model")
    return out
