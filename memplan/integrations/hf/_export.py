"""The plan as ``transformers.TrainingArguments`` keyword arguments."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .._plan_facts import Layout, checkpointing_caveat, layout

if TYPE_CHECKING:
    from ...planning import Plan

__all__ = ["training_args", "caveats"]


def _major() -> int:
    """transformers' major version (5 when it is not installed: the export targets the newest)."""
    try:
        import transformers
    except ImportError:
        return 5
    return int(transformers.__version__.split(".")[0])


def training_args(plan: Plan) -> dict[str, Any]:
    """``TrainingArguments(**training_args(plan), output_dir=...)`` trains the plan's configuration:
    per-device batch, accumulation, mixed precision, activation checkpointing, FSDP2 and
    ``torch_compile``. The world size is the launcher's (``torchrun --nproc-per-node``). What
    the Trainer cannot express is warned of (``caveats``)."""
    for line in caveats(plan):
        warnings.warn(f"memplan.integrations.hf: {line}", UserWarning, stacklevel=2)
    return _args(layout(plan))


def _args(lay: Layout) -> dict[str, Any]:
    new = _major() >= 5
    out: dict[str, Any] = {
        "per_device_train_batch_size": lay.micro_batch,
        "gradient_accumulation_steps": lay.accumulation,
        "bf16": lay.precision == "bf16-mixed",
        "fp16": lay.precision == "fp16-mixed",
    }
    if lay.checkpoint_segments:
        ckpt = "activation_checkpointing" if new else "gradient_checkpointing"
        if lay.strategy == "fsdp":
            pass  # FSDP checkpoints inside its config (below): the training argument would gather twice
        else:
            out[ckpt] = True
            out[f"{ckpt}_kwargs"] = {"use_reentrant": False}
    if lay.strategy == "fsdp":
        out["fsdp"] = True if new else "full_shard auto_wrap"
        config: dict[str, Any] = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
        if lay.checkpoint_segments:
            config["activation_checkpointing"] = True
        if lay.cpu_offload:
            config["cpu_offload"] = True
        out["fsdp_config"] = config
    if lay.compile is not None:
        out["torch_compile"] = bool(lay.compile)
    if lay.device == "cpu":
        out["use_cpu"] = True
    return out


def caveats(plan: Plan) -> list[str]:
    """What of the plan ``TrainingArguments`` cannot express, with what is exported instead."""
    lay = layout(plan)
    out = checkpointing_caveat(lay, "the Trainer")
    if lay.precision == "bf16-true":
        out.append("bf16-true has no TrainingArguments flag: load the model in bf16 "
                   "(from_pretrained(..., dtype=torch.bfloat16)); bf16 mixed precision stays off")
    if lay.precision == "fp16-true":
        out.append("fp16-true has no TrainingArguments flag: load the model in fp16; fp16 mixed precision stays off")
    if lay.optimizer_in_backward:
        out.append("the optimizer step in backward has no Trainer setting: it keeps every gradient, so the peak is "
                   "higher than planned; plan without it (memplan plan ... excludes it unless nothing else fits)")
    if lay.cpu_offload and lay.strategy != "fsdp":
        out.append("the plan offloads the model state to the CPU, which the Trainer does only under FSDP: the state "
                   "stays on the device, above the plan's peak")
    if lay.offload_activations:
        out.append("the plan offloads saved activations to the CPU: the Trainer's activation_checkpointing_kwargs "
                   "{'offload': True} (transformers 5) is the nearest; without it the peak is higher than planned")
    if lay.length_grouped:
        out.append("the plan groups batches by length: pass a length-grouped sampler to the Trainer, else batches "
                   "pad further than planned")
    if lay.strategy in ("ddp", "fsdp"):
        out.append(f"launch {lay.world_size} processes ({lay.per_node} per machine on {lay.nodes}): "
                   f"torchrun --nproc-per-node {lay.per_node} --nnodes {lay.nodes} train.py")
    return out
