"""What every export reads of a plan: its layout, and what other tools cannot express of it.

The caveats are the plan's techniques a tool has no setting for, each said in one line with
what the user gets instead: an export never drops one silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planning import Plan

__all__ = ["KEPT_BY_POLICY", "Layout", "layout", "seq_len"]


@dataclass(frozen=True)
class Layout:
    """The plan's best configuration, as the exports need it."""

    micro_batch: int
    accumulation: int
    precision: str
    checkpoint_segments: int
    checkpoint_policy: str
    strategy: str
    world_size: int
    nodes: int
    cpu_offload: bool
    offload_activations: bool
    optimizer_in_backward: bool
    length_grouped: bool
    compile: bool | None
    device: str

    @property
    def per_node(self) -> int:
        return max(1, self.world_size // max(1, self.nodes))


def layout(plan: Plan) -> Layout:
    """The plan's layout; a tensor-parallel one is refused: the tools' exported settings (a
    Trainer's arguments, an Accelerate or Lightning strategy, a torchtune recipe's keys) would
    train the whole model on every device, which the plan does not fit."""
    from estimators import ConfigError

    c = plan.config
    if c.pp > 1:
        raise ConfigError(
            f"the plan cuts the model into pp {c.pp} pipeline stages ({c.describe()}), which this export cannot "
            f"express; train it with memplan train MODEL.py --plan plan.json --nproc {c.ranks}")
    if c.tp > 1:
        raise ConfigError(
            f"the plan splits the model over tp {c.tp} (tensor parallelism: {c.describe()}), which this export "
            f"cannot express; train it with memplan train MODEL.py --plan plan.json --nproc {c.ranks}")
    if c.dp_replicate > 1:
        raise ConfigError(
            f"the plan shards the model within groups of {c.shard_size} ranks (HSDP: {c.describe()}), which this "
            f"export cannot express; train it with memplan train MODEL.py --plan plan.json --nproc {c.ranks}")
    return Layout(
        micro_batch=c.micro_batch_size, accumulation=c.grad_accum_steps, precision=c.precision,
        checkpoint_segments=c.checkpoint_segments, checkpoint_policy=c.checkpoint_policy, strategy=c.strategy,
        world_size=c.world_size, nodes=c.nodes, cpu_offload=c.cpu_offload, offload_activations=c.offload_activations,
        optimizer_in_backward=c.optimizer_in_backward, length_grouped=c.length_grouped, compile=plan.compile,
        device=plan.device,
    )


def seq_len(plan: Plan) -> int | None:
    """The sequence length an ``hf:`` plan was made for (None: a model file's, which its data sets)."""
    origin = plan.provenance.get("origin") or {}
    value = origin.get("seq_len") if isinstance(origin, dict) else None
    return int(value) if isinstance(value, int) else None


KEPT_BY_POLICY = {"selective": "selective checkpointing (matmul outputs kept)",
                  "op": "op-policy checkpointing (attention and every other matmul output kept)"}
"""What a checkpoint policy other than full keeps, in the words of the exports' caveats."""


def checkpointing_caveat(lay: Layout, tool: str, every: str = "every layer") -> list[str]:
    """The plan checkpoints some blocks; a tool that checkpoints all or none says so."""
    out = []
    if lay.checkpoint_segments:
        out.append(f"the plan checkpoints {lay.checkpoint_segments} block(s); {tool} checkpoints {every}: where the "
                   "model has more blocks, it saves more memory than planned and runs slower")
        if lay.checkpoint_policy != "full":
            out.append(f"the plan's {KEPT_BY_POLICY[lay.checkpoint_policy]} has no {tool} setting: full "
                       "checkpointing is exported (less memory, slower than planned)")
    return out
