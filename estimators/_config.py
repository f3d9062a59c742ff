"""The training configuration that is estimated, probed, searched and run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ._errors import ConfigError

__all__ = ["CheckpointPolicy", "CHECKPOINT_POLICIES", "PipelineSchedule", "PIPELINE_SCHEDULES", "Precision",
           "Strategy", "TrainConfig", "normalize_precision", "PRECISIONS"]

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"]
Strategy = Literal["single", "ddp", "fsdp"]
CheckpointPolicy = Literal["full", "selective", "op"]

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]

CHECKPOINT_POLICIES: tuple[CheckpointPolicy, ...] = ("full", "selective", "op")
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = ("gpipe", "1f1b", "interleaved-1f1b")

PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")

# Lightning-style names and the short forms users type; all map to the canonical names. The
# bare "bf16"/"16" stay mixed precision: pure low precision must be asked for by name.
_PRECISION_ALIASES: dict[str, Precision] = {
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed", "bfloat16": "bf16-mixed",
    "fp16-mixed": "fp16-mixed", "fp16": "fp16-mixed", "16": "fp16-mixed", "16-mixed": "fp16-mixed",
    "float16": "fp16-mixed",
    "bf16-true": "bf16-true", "fp16-true": "fp16-true", "16-true": "fp16-true",
}

def normalize_precision(value: str) -> Precision:
    """Map ``"bf16"``, ``"16"``, ``"32-true"``… to the canonical precision name.

    >>> normalize_precision("bf16")
    'bf16-mixed'
    """
    key = str(value).strip().lower()
    if key not in _PRECISION_ALIASES:
        raise ConfigError(
            f"unknown precision {value!r}; use one of fp32 (32), bf16-mixed (bf16), "
            "fp16-mixed (fp16, 16), bf16-true, fp16-true (16-true)"
        )
    return _PRECISION_ALIASES[key]

_POLICY_WORDS: dict[str, str] = {"full": "full", "selective": "selective", "op": "op policy"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One point of the configuration space.

    ``micro_batch_size * grad_accum_steps * world_size`` is the global batch.
    """

    micro_batch_size: int
    """Samples per forward/backward pass on one device."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed before one optimizer step."""
    precision: Precision = "fp32"
    """``fp32``, ``bf16-mixed`` (autocast, fp32 weights), ``fp16-mixed`` (autocast + GradScaler),
    or ``bf16-true``/``fp16-true``: weights, gradients and optimizer state in the low precision,
    no autocast, no scaler (batch-norm layers stay fp32; see ``runtime._precision``)."""
    checkpoint_segments: int = 0
    """Blocks of the model's block stack recomputed in backward (0 = none)."""
    checkpoint_policy: CheckpointPolicy = "full"
    """What a checkpointed block keeps: ``full`` keeps only its inputs and recomputes the
    rest; ``selective`` also keeps the outputs of all its matrix products and attention kernels
    and recomputes only the cheap ops between them; ``op`` is torchtitan's selective "op"
    policy, which keeps the attention kernels' outputs and every other ``mm``'s (see
    ``runtime._checkpoint``). Needs ``checkpoint_segments >= 1``."""
    strategy: Strategy = "single"
    """``single`` device, ``ddp`` or ``fsdp`` (FSDP2)."""
    world_size: int = 1
    """Data-parallel replicas (each of ``tp`` processes when ``tp > 1``: :attr:`ranks`)."""
    tp: int = 1
    """Tensor-parallel degree: each block's attention and MLP linears split over ``tp``
    processes of one node (DTensor ``ColwiseParallel``/``RowwiseParallel``, see
    ``runtime._tensor_parallel``), which see the same batch. With ``strategy='fsdp'`` the
    ``world_size`` replicas shard what is left (FSDP2 x TP on a 2-D device mesh)."""
    sequence_parallel: bool = False
    """With ``tp > 1``, Megatron's sequence parallelism: between the split pairs (the norms,
    the residual stream, the inputs a checkpointed block keeps) each of the ``tp`` ranks holds
    ``1/tp`` of the sequence instead of all of it; each split pair gathers the sequence before
    its column-wise linears and reduce-scatters after its row-wise one, in place of the
    all-reduce (see ``runtime._tensor_parallel``)."""
    dp_replicate: int = 1
    """HSDP (``strategy='fsdp'``): the ``world_size`` FSDP2 ranks form ``dp_replicate`` groups,
    each sharding the model over ``world_size / dp_replicate`` ranks (neighbours: one machine
    when it holds that many), and the groups all-reduce their gradient shards. Each rank holds
    ``dp_replicate`` times the states of plain FSDP2 over the same ranks, and gathers only
    within its group."""
    pp: int = 1
    """Pipeline-parallel degree: the model's block stack is cut into ``pp`` stages (the first
    also holds what runs before the blocks, the last what runs after them and the loss), one
    per process, which pass activations and their gradients to their neighbours
    (``torch.distributed.pipelining``, see ``runtime._pipeline``)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """The pipeline's schedule: ``gpipe`` (every micro-batch's forward, then every backward),
    ``1f1b`` (a stage holds at most ``pp`` micro-batches' activations) or ``interleaved-1f1b``
    (two stages per process, looped: smaller bubbles, twice the transfers)."""
    pp_microbatches: int = 1
    """Micro-batches of ``micro_batch_size`` samples that one pipeline step runs (and whose
    gradients it accumulates) with ``pp > 1``: ``grad_accum_steps`` stays 1."""
    nodes: int = 1
    """Machines the ``world_size`` processes are spread over, evenly (``world_size % nodes ==
    0``): collectives between nodes cross the network, which the step-time model prices."""
    length_grouped: bool = False
    """Batches of items of similar size (items of varying shape only): the data order groups
    them, as Hugging Face's ``group_by_length`` does, so that batches pad less. Changes
    throughput, not the worst batch (the longest items still meet in one)."""
    optimizer_in_backward: bool = False
    """Step each parameter in backward, by its own optimizer, as soon as its gradient is ready,
    and free the gradient at once (torchtune's ``optimizer_in_bwd``): no moment holds every
    gradient. One device, no accumulation, no fp16 GradScaler, no clipping by the global norm."""
    cpu_offload: bool = False
    """FSDP2's CPU offload (``CPUOffloadPolicy``): the sharded parameters, their gradients and
    the optimizer's state live in (pinned) host memory; each unit's parameters are copied to
    the device for its forward and backward, gradients copied back, and the optimizer steps
    on the CPU. Needs ``strategy='fsdp'`` (``world_size=1`` offloads a single device)."""
    offload_activations: bool = False
    """Keep the tensors autograd saves for backward in host memory between forward and backward
    (torchtune's ``OffloadActivations``; see ``runtime._activation_offload``): on a GPU the saved
    activations leave device memory, at the price of copies over the host link each way. Any
    strategy and precision; with checkpointing, the checkpointed blocks' inputs are offloaded.
    On a CPU device nothing moves (host memory is the device's)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "grad_accum_steps", "world_size", "nodes", "tp", "dp_replicate", "pp",
                     "pp_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.checkpoint_segments, int) or self.checkpoint_segments < 0:
            raise ConfigError(
                f"checkpoint_segments must be a whole number >= 0, got {self.checkpoint_segments!r}"
            )
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ConfigError(
                f"unknown checkpoint_policy {self.checkpoint_policy!r}; use full, selective or op"
            )
        if self.checkpoint_policy != "full" and self.checkpoint_segments == 0:
            raise ConfigError(
                f"checkpoint_policy {self.checkpoint_policy!r} applies to checkpointed blocks; "
                "set checkpoint_segments >= 1 or use checkpoint_policy 'full'"
            )
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        if self.strategy not in ("single", "ddp", "fsdp"):
            raise ConfigError(f"unknown strategy {self.strategy!r}; use single, ddp or fsdp")
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError("strategy 'single' runs on one device; set world_size=1 or use ddp/fsdp")
        if not isinstance(self.length_grouped, bool):
            raise ConfigError(f"length_grouped must be True or False, got {self.length_grouped!r}")
        _check_optimizer_in_backward(self)
        if not isinstance(self.cpu_offload, bool):
            raise ConfigError(f"cpu_offload must be True or False, got {self.cpu_offload!r}")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ConfigError(
                f"cpu_offload is FSDP2's offload policy, but the strategy is {self.strategy!r}; use "
                "strategy='fsdp' (world_size=1 offloads a single device) or cpu_offload=False")
        if not isinstance(self.offload_activations, bool):
            raise ConfigError(f"offload_activations must be True or False, got {self.offload_activations!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        _check_tensor_parallel(self)
        _check_hsdp(self)
        _check_pipeline(self)
        if self.world_size % self.nodes:
            raise ConfigError(
                f"world_size {self.world_size} does not split evenly over nodes {self.nodes}; "
                "use a world size that is a multiple of the node count"
            )

    @property
    def shards_parameters(self) -> bool:
        """Are the parameters DTensor shards (FSDP2, tensor parallelism), or a pipeline stage's
        part of the model? Then state dicts, checkpoints and evaluation go through
        ``torch.distributed``'s sharded paths."""
        return self.strategy == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over by FSDP2 (``world_size``, or a group's under
        HSDP); 1 without FSDP2."""
        return self.world_size // self.dp_replicate if self.strategy == "fsdp" else 1

    @property
    def ranks(self) -> int:
        """Processes the configuration runs on: ``world_size`` replicas of ``tp * pp`` each."""
        return self.world_size * self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches one optimizer step runs on a replica: accumulated, or a pipeline's."""
        return self.grad_accum_steps * self.pp_microbatches

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.pp_microbatches * self.world_size

    def replace(self, **changes: Any) -> TrainConfig:
        # Fields by name (callers build the changes at run time); __post_init__ checks them.
        return replace(self, **changes)

    def to_dict(self) -> dict[str, int | str | bool]:
        d = asdict(self)
        # As configurations were written before these fields existed.
        if not self.length_grouped:
            del d["length_grouped"]  # as configurations were written before the field existed
        if self.checkpoint_policy == "full":
            del d["checkpoint_policy"]  # likewise
        if not self.optimizer_in_backward:
            del d["optimizer_in_backward"]  # likewise
        if not self.cpu_offload:
            del d["cpu_offload"]  # likewise
        if not self.offload_activations:
            del d["offload_activations"]  # likewise
        if self.tp == 1:
            del d["tp"]  # likewise
        if not self.sequence_parallel:
            del d["sequence_parallel"]  # likewise
        if self.dp_replicate == 1:
            del d["dp_replicate"]  # likewise
        if self.pp == 1:
            for name in ("pp", "pp_schedule", "pp_microbatches"):
                del d[name]  # likewise
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The configuration ``to_dict`` wrote, as read back from JSON: ``__post_init__`` checks
        each field's value."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown configuration fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def describe(self) -> str:
        parts = [f"micro-batch {self.micro_batch_size}"]
        if self.grad_accum_steps > 1:
            parts.append(f"x{self.grad_accum_steps} accumulation")
        parts.append(self.precision)
        if self.checkpoint_segments:
            parts.append(f"{self.checkpoint_segments} checkpoint segments"
                         + (f" ({_POLICY_WORDS[self.checkpoint_policy]})" if self.checkpoint_policy != "full" else ""))
        if self.dp_replicate > 1:
            parts.append(f"hsdp {self.dp_replicate} x {self.shard_size}"
                         + (f" over {self.nodes} nodes" if self.nodes > 1 else ""))
        elif self.strategy != "single":
            parts.append(f"{self.strategy} x{self.world_size}"
                         + (f" x tp {self.tp}" if self.tp > 1 else "")
                         + (f" over {self.nodes} nodes" if self.nodes > 1 else ""))
        elif self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.pp > 1:
            parts.append(f"pp {self.pp} {self.pp_schedule} over {self.pp_microbatches} micro-batches")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.length_grouped:
            parts.append("length-grouped")
        if self.optimizer_in_backward:
            parts.append("optimizer in backward")
        if self.cpu_offload:
            parts.append("CPU offload")
        if self.offload_activations:
            parts.append("activations offloaded")
        return ", ".join(parts)


def _check_tensor_parallel(config: TrainConfig) -> None:
    # The layouts that are traced, probed and trained with tensor parallelism; the others are
    # refused rather than run untested.
    if config.tp == 1:
        if config.sequence_parallel:
            raise ConfigError("sequence_parallel splits the sequence over the tensor-parallel ranks; set tp >= 2 "
                              "or sequence_parallel=False")
        return
    if config.strategy == "ddp":
        raise ConfigError(
            f"tp {config.tp} combines with FSDP2 for data parallelism, not DDP; use strategy='fsdp' "
            "(or strategy='single' for tensor parallelism alone)")
    if config.cpu_offload:
        raise ConfigError(f"cpu_offload is not combined with tp {config.tp}; set tp=1 or cpu_offload=False")
    if config.optimizer_in_backward:
        raise ConfigError(
            f"optimizer_in_backward is not combined with tp {config.tp}; set tp=1 or optimizer_in_backward=False")


def _check_hsdp(config: TrainConfig) -> None:
    if config.dp_replicate == 1:
        return
    if config.strategy != "fsdp":
        raise ConfigError(f"dp_replicate {config.dp_replicate} is HSDP, FSDP2's replicas of shard groups, but the "
                          f"strategy is {config.strategy!r}; use strategy='fsdp' or dp_replicate=1")
    if config.world_size % config.dp_replicate or config.world_size // config.dp_replicate < 2:
        raise ConfigError(f"dp_replicate {config.dp_replicate} does not split world_size {config.world_size} into "
                          "groups of 2 or more ranks; use a dp_replicate that divides it (with groups of 1, use ddp)")
    # Not traced or trained together (yet): refused rather than run untested.
    if config.tp > 1:
        raise ConfigError(f"dp_replicate {config.dp_replicate} (HSDP) is not combined with tp {config.tp}; set "
                          "dp_replicate=1 (FSDP2 x TP) or tp=1")
    if config.cpu_offload:
        raise ConfigError(f"cpu_offload is not combined with dp_replicate {config.dp_replicate} (HSDP); set "
                          "dp_replicate=1 or cpu_offload=False")


def _check_pipeline(config: TrainConfig) -> None:
    if config.pp_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"unknown pp_schedule {config.pp_schedule!r}; use {', '.join(PIPELINE_SCHEDULES)}")
    if config.pp == 1:
        if config.pp_microbatches != 1:
            raise ConfigError(f"pp_microbatches {config.pp_microbatches} are a pipeline's; set pp >= 2, or use "
                              "grad_accum_steps to accumulate micro-batches")
        return
    if config.grad_accum_steps != 1:
        raise ConfigError(f"a pipeline accumulates its own micro-batches; set grad_accum_steps=1 and "
                          f"pp_microbatches={config.grad_accum_steps * max(config.pp_microbatches, 1)}")
    if config.pp_schedule != "gpipe" and config.pp_microbatches < config.pp:
        raise ConfigError(f"the {config.pp_schedule} schedule needs at least as many micro-batches as stages; set "
                          f"pp_microbatches >= {config.pp} (or pp_schedule='gpipe')")
    if config.pp_schedule == "interleaved-1f1b" and config.pp_microbatches % config.pp:
        raise ConfigError(f"interleaved-1f1b runs micro-batches in rounds of pp {config.pp}; set pp_microbatches to a "
                          f"multiple of {config.pp}")
    # Not traced or trained together (yet): refused rather than run untested.
    combined = [name for name, on in (("data parallelism (strategy ddp/fsdp)", config.strategy != "single"),
                                      (f"tp {config.tp}", config.tp > 1),
                                      ("optimizer_in_backward", config.optimizer_in_backward),
                                      ("offload_activations", config.offload_activations),
                                      ("fp16-mixed (its loss scaler)", config.precision == "fp16-mixed"))
                if on]
    if combined:
        raise ConfigError(f"pp {config.pp} is not combined with {combined[0]}; set pp=1, or train the pipeline "
                          "alone (strategy='single', tp=1) in fp32, bf16-mixed or bf16-true")


def _check_optimizer_in_backward(config: TrainConfig) -> None:
    # What the step in backward excludes whatever the step's options (clipping by the global
    # norm is checked where the options meet the configuration: runtime._optim_bwd).
    if not isinstance(config.optimizer_in_backward, bool):
        raise ConfigError(f"optimizer_in_backward must be True or False, got {config.optimizer_in_backward!r}")
    if not config.optimizer_in_backward:
        return
    if config.grad_accum_steps > 1:
        raise ConfigError(
            f"optimizer_in_backward steps every parameter in each backward, so it cannot accumulate "
            f"{config.grad_accum_steps} micro-batches; set grad_accum_steps=1 or optimizer_in_backward=False"
        )
    if config.precision == "fp16-mixed":
        raise ConfigError(
            "optimizer_in_backward cannot run fp16-mixed (the GradScaler checks every gradient before any "
            "step); use bf16-mixed or fp32, or optimizer_in_backward=False"
        )
    if config.strategy != "single":
        raise ConfigError(
            f"optimizer_in_backward runs on one device (strategy {config.strategy!r} reduces gradients after "
            "the hook that steps them); use strategy='single' or optimizer_in_backward=False"
        )
