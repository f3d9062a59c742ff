"""The plan as ``key=value`` overrides of a torchtune recipe's config (``tune run RECIPE --config C KEY=VALUE ...``).

The keys are those of torchtune's full and LoRA fine-tune recipes (``batch_size``,
``gradient_accumulation_steps``, ``dtype``, ``enable_activation_checkpointing``,
``enable_activation_offloading``, ``optimizer_in_bwd``, ``compile``, ``fsdp_cpu_offload``,
``tokenizer.max_seq_len``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .._plan_facts import checkpointing_caveat, layout, seq_len

if TYPE_CHECKING:
    from ...planning import Plan

__all__ = ["overrides", "caveats"]


def overrides(plan: Plan) -> list[str]:
    """One ``key=value`` per setting the plan decides. torchtune has no mixed precision: its
    ``dtype`` is the weights' own (``caveats``)."""
    for line in caveats(plan):
        warnings.warn(f"memplan.integrations.torchtune: {line}", UserWarning, stacklevel=2)
    lay = layout(plan)
    out = [
        f"batch_size={lay.micro_batch}",
        f"gradient_accumulation_steps={lay.accumulation}",
        f"dtype={'fp32' if lay.precision == 'fp32' else 'bf16'}",
        f"enable_activation_checkpointing={_bool(bool(lay.checkpoint_segments))}",
        f"enable_activation_offloading={_bool(lay.offload_activations)}",
        f"optimizer_in_bwd={_bool(lay.optimizer_in_backward)}",
    ]
    if lay.compile is not None:
        out.append(f"compile={_bool(bool(lay.compile))}")
    if lay.strategy == "fsdp":
        out.append(f"fsdp_cpu_offload={_bool(lay.cpu_offload)}")
    tokens = seq_len(plan)
    if tokens is not None:
        out.append(f"tokenizer.max_seq_len={tokens}")
    return out


def _bool(value: bool) -> str:
    return "True" if value else "False"


def caveats(plan: Plan) -> list[str]:
    lay = layout(plan)
    out = checkpointing_caveat(lay, "torchtune", every="every layer")
    if lay.precision in ("bf16-mixed", "fp16-mixed"):
        out.append(f"torchtune has no mixed precision: dtype=bf16 trains bf16 weights (bf16-true), below the "
                   f"plan's {lay.precision} peak and with other numerics; dtype=fp32 is the plan's fp32")
    if lay.precision == "fp16-true":
        out.append("torchtune trains bf16 or fp32, not fp16: dtype=bf16 is exported")
    if lay.cpu_offload and lay.strategy != "fsdp":
        out.append("the plan offloads the model state to the CPU, which torchtune does under FSDP only")
    if lay.world_size > 1:
        out.append(f"launch with tune run --nproc_per_node {lay.per_node} (a *_distributed recipe)"
                   + (f" on each of {lay.nodes} machines" if lay.nodes > 1 else ""))
    return out
