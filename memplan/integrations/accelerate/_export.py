"""The plan as an ``accelerate launch`` config file (``accelerate launch --config_file F``)."""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING, Any

from .._plan_facts import KEPT_BY_POLICY, checkpointing_caveat, layout

if TYPE_CHECKING:
    from ...planning import Plan

__all__ = ["config", "config_yaml", "caveats"]

_MIXED = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "no", "fp16-true": "no"}


def config(plan: Plan) -> dict[str, Any]:
    """The config's keys, as ``accelerate``'s own loader reads them. The accumulation is not one
    of them: the script passes ``Accelerator(gradient_accumulation_steps=...)`` (``caveats``)."""
    for line in caveats(plan):
        warnings.warn(f"memplan.integrations.accelerate: {line}", UserWarning, stacklevel=2)
    return _config(plan)


def _config(plan: Plan) -> dict[str, Any]:
    lay = layout(plan)
    cpu = lay.device == "cpu"
    if lay.strategy == "fsdp":
        kind = "FSDP"
    elif lay.world_size > 1:
        kind = "MULTI_CPU" if cpu else "MULTI_GPU"
    else:
        kind = "NO"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "mixed_precision": _MIXED[lay.precision],
        "use_cpu": cpu,
        "num_processes": lay.world_size,
        "num_machines": lay.nodes,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "debug": False,
    }
    if kind == "FSDP":
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": lay.cpu_offload,
            "fsdp_activation_checkpointing": bool(lay.checkpoint_segments),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    if lay.compile:
        out["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    return out


def config_yaml(plan: Plan) -> str:
    """:func:`config` as YAML, headed by comments: the accumulation and micro-batch the script
    sets, and what the config cannot express."""
    lay = layout(plan)
    lines = [
        f"# memplan plan: micro-batch {lay.micro_batch} x accumulation {lay.accumulation} x {lay.world_size} "
        f"process(es) = global batch {lay.micro_batch * lay.accumulation * lay.world_size}",
        f"# the config file cannot hold these: Accelerator(gradient_accumulation_steps={lay.accumulation}) and "
        f"DataLoader(batch_size={lay.micro_batch}) in the script",
        *(f"# {line}" for line in caveats(plan)),
    ]
    return "\n".join([*lines, *_yaml(_config(plan), 0)]) + "\n"


def _yaml(value: dict[str, Any], indent: int) -> list[str]:
    # The config holds strings, numbers, booleans and one level of mappings: JSON's scalars
    # are valid YAML, so each is written as JSON writes it.
    out = []
    for key, item in value.items():
        if isinstance(item, dict):
            out.append(" " * indent + f"{key}:")
            out += _yaml(item, indent + 2)
        else:
            out.append(" " * indent + f"{key}: {json.dumps(item)}")
    return out


def caveats(plan: Plan) -> list[str]:
    lay = layout(plan)
    out = []
    if lay.strategy != "fsdp":
        out += checkpointing_caveat(lay, "the script", every="what it checkpoints")
        if lay.checkpoint_segments:
            out.append(f"checkpoint {lay.checkpoint_segments} block(s) in the script (torch.utils.checkpoint, or "
                       "model.gradient_checkpointing_enable() for a transformers model): accelerate has no flag")
    elif lay.checkpoint_policy != "full":
        out.append(f"the plan's {KEPT_BY_POLICY[lay.checkpoint_policy]} has no accelerate setting: "
                   "fsdp_activation_checkpointing checkpoints whole layers (less memory, slower than planned)")
    if lay.precision in ("bf16-true", "fp16-true"):
        out.append(f"{lay.precision}: mixed_precision stays 'no'; cast the model to "
                   f"{'bf16' if lay.precision == 'bf16-true' else 'fp16'} in the script")
    if lay.optimizer_in_backward:
        out.append("the optimizer step in backward has no accelerate setting: the peak is higher than planned")
    if lay.cpu_offload and lay.strategy != "fsdp":
        out.append("the plan offloads the model state to the CPU, which accelerate does under FSDP only "
                   "(fsdp_offload_params)")
    if lay.offload_activations:
        out.append("the plan offloads saved activations: accelerate has no setting for it")
    if lay.nodes > 1:
        out.append(f"set machine_rank and main_process_ip on each of the {lay.nodes} machines")
    return out
