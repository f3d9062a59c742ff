"""The configuration space of a search, built from the model, the device and the budget."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch.nn as nn

from estimators import (
    ConfigError,
    Estimator,
    Precision,
    Strategy,
    Task,
    TrainConfig,
    max_checkpoint_segments,
    normalize_precision,
)

__all__ = [
    "Layout",
    "SearchSpace",
    "Technique",
    "NO_TECHNIQUE",
    "CPU_OFFLOAD",
    "CpuOffload",
    "ACTIVATION_OFFLOAD",
    "OPTIMIZER_IN_BACKWARD",
    "optimizer_in_backward_excluded",
    "frugal_space",
    "build_space",
    "DEFAULT_GLOBAL_BATCH",
    "default_global_batch",
    "layouts_for",
    "layout_key",
    "space_for",
    "tensor_parallel_layouts",
    "pipeline_layouts",
]

MAX_KERNEL_BATCH = 65535
"""Some kernels (cuDNN grid dimensions, for one) refuse batch dimensions above this."""

DEFAULT_GLOBAL_BATCH = 32
"""The global batch (micro-batch x accumulation x ranks) when nobody fixes one: the global
batch is a training hyper-parameter, not a memory setting, and a search that maximises
samples/s would grow a free one to whatever fits (1,024 of 1,400 items: two optimizer steps
an epoch). 32 is the conventional default (PyTorch Lightning's and Keras's batch size)."""


@dataclass(frozen=True)
class Layout:
    """How the work is spread: a strategy on ``world_size`` data-parallel replicas over ``nodes``
    machines, each replica ``tp`` processes of one machine (tensor parallelism, with the
    sequence sharded between its split pairs when ``sequence_parallel``)."""

    strategy: Strategy = "single"
    world_size: int = 1
    nodes: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    dp_replicate: int = 1
    """HSDP's replica groups (``strategy='fsdp'``); 1: plain FSDP2."""
    pp: int = 1
    """Pipeline stages, one a process (``TrainConfig.pp``)."""
    pp_schedule: str = "1f1b"

    @property
    def ranks(self) -> int:
        return self.world_size * self.tp * self.pp

    @property
    def key(self) -> str:
        """The layout's name in the Optuna study ("single", "ddp x8", "fsdp x16 on 2 nodes",
        "tp 8", "fsdp x4 x tp 2 sp": "sp" for sequence parallel; "hsdp 2 x 8 on 2 nodes";
        "pp 4 1f1b")."""
        if self.pp > 1:
            return f"pp {self.pp} {self.pp_schedule}"
        nodes = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        if self.dp_replicate > 1:
            return f"hsdp {self.dp_replicate} x {self.world_size // self.dp_replicate}{nodes}"
        tp = f"tp {self.tp}" + (" sp" if self.sequence_parallel else "")
        if self.strategy == "single":
            return "single" if self.tp == 1 else f"{tp}{nodes}"
        return f"{self.strategy} x{self.world_size}" + (f" x {tp}" if self.tp > 1 else "") + nodes


@dataclass(frozen=True)
class Technique:
    """A searched technique: a name (the study's value) and the ``TrainConfig`` fields it sets."""

    name: str
    fields: tuple[tuple[str, object], ...]

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` with the technique, or as it is where the technique does not apply to it
        (selective checkpointing without checkpointed blocks, say)."""
        try:
            return config.replace(**dict(self.fields))
        except ConfigError:
            return config


class CpuOffload(Technique):
    """FSDP2's CPU offload: on one device a world of one FSDP2 rank, on FSDP2 layouts the
    offload policy added; DDP, HSDP and tensor-parallel layouts do not offload (the
    configuration stays as it is)."""

    def apply(self, config: TrainConfig) -> TrainConfig:
        if (config.strategy == "ddp" or config.optimizer_in_backward or config.tp > 1 or config.dp_replicate > 1
                or config.pp > 1):
            return config
        return config.replace(strategy="fsdp", cpu_offload=True)


NO_TECHNIQUE = Technique("none", ())
CPU_OFFLOAD = CpuOffload("cpu-offload", (("cpu_offload", True),))
ACTIVATION_OFFLOAD = Technique("activation-offload", (("offload_activations", True),))
"""Saved activations in host memory between forward and backward (any layout)."""


@dataclass(frozen=True)
class SearchSpace:
    micro_batch_sizes: tuple[int, ...]
    precisions: tuple[Precision, ...]
    checkpoint_segments: tuple[int, ...]
    global_batch: int
    """The global batch (micro × accumulation × world), fixed: only how it is reached is searched."""
    layouts: tuple[Layout, ...] = (Layout(),)
    """Strategies × world sizes searched; every micro-batch size is valid for each of them."""
    grouping: tuple[bool, ...] = (False,)
    """Length-grouped batching searched ``(False, True)`` when items vary in shape."""
    techniques: tuple[Technique, ...] = ()
    """Memory-saving techniques searched beside none (each a set of ``TrainConfig`` fields)."""

    @property
    def world_size(self) -> int:
        return max(layout.world_size for layout in self.layouts)

    def accum_for(self, micro: int, world_size: int = 1) -> int:
        return self.global_batch // (micro * world_size)

    def layout(self, key: str) -> Layout:
        return next(layout for layout in self.layouts if layout.key == key)

    @property
    def technique_choices(self) -> tuple[Technique, ...]:
        return (NO_TECHNIQUE, *self.techniques)

    def technique(self, name: str) -> Technique:
        return next(t for t in self.technique_choices if t.name == name)

    def config(
        self,
        micro: int,
        precision: str,
        segments: int,
        layout: Layout | str | None = None,
        grouped: bool = False,
        technique: Technique | str = NO_TECHNIQUE,
    ) -> TrainConfig:
        if layout is None:
            layout = self.layouts[0]
        elif isinstance(layout, str):
            layout = self.layout(layout)
        accum = self.accum_for(micro, layout.world_size)
        pipeline: dict[str, Any] = {}
        if layout.pp > 1:
            # The pipeline's micro-batches are its accumulation. Fewer than its stages, 1F1B's
            # warm-up holds all of them, as GPipe does: the library runs it as GPipe. The
            # interleaved schedule runs them in rounds of pp: with a last round short of it,
            # plain 1F1B.
            schedule = layout.pp_schedule
            if schedule == "interleaved-1f1b" and accum % layout.pp:
                schedule = "1f1b"
            if accum < layout.pp:
                schedule = "gpipe"
            pipeline = {"pp": layout.pp, "pp_schedule": schedule, "pp_microbatches": accum}
            accum = 1
        config = TrainConfig(
            micro_batch_size=micro,
            grad_accum_steps=accum,
            precision=normalize_precision(precision),  # a study's parameter: a string
            checkpoint_segments=segments,
            strategy=layout.strategy,
            world_size=layout.world_size,
            nodes=layout.nodes,
            tp=layout.tp,
            sequence_parallel=layout.sequence_parallel,
            dp_replicate=layout.dp_replicate,
            length_grouped=grouped,
            **pipeline,
        )
        return (self.technique(technique) if isinstance(technique, str) else technique).apply(config)

    def __len__(self) -> int:
        return (
            len(self.micro_batch_sizes)
            * len(self.precisions)
            * len(self.checkpoint_segments)
            * len(self.layouts)
            * len(self.grouping)
            * len(self.technique_choices)
        )

    def __iter__(self) -> Iterator[TrainConfig]:
        seen: set[TrainConfig] = set()
        for config in self._all():
            if config not in seen:  # a technique that does not apply leaves the config as it is
                seen.add(config)
                yield config

    def _all(self) -> Iterator[TrainConfig]:
        for layout in self.layouts:
            for m in self.micro_batch_sizes:
                for p in self.precisions:
                    for s in self.checkpoint_segments:
                        for g in self.grouping:
                            for t in self.technique_choices:
                                yield self.config(m, p, s, layout, g, t)

    def smallest(self) -> list[tuple[TrainConfig, dict[str, object]]]:
        """Corners most likely to need the least memory (the nearest miss when nothing fits),
        with the trial parameters that ask for them: the smallest micro-batch, every block
        checkpointed, each precision and layout, without a technique and with CPU offload
        where it is searched."""
        m = self.micro_batch_sizes[0]
        s = self.checkpoint_segments[-1]
        techniques = [NO_TECHNIQUE] + [t for t in self.techniques if t is CPU_OFFLOAD]
        out: dict[TrainConfig, dict[str, object]] = {}
        for t in techniques:
            for layout in self.layouts:
                for p in self.precisions:
                    params: dict[str, object] = {
                        "layout": layout.key,
                        "micro_batch_size": m,
                        "precision": p,
                        "checkpoint_segments": s,
                    }
                    if self.techniques:
                        params["technique"] = t.name
                    out.setdefault(self.config(m, p, s, layout, False, t), params)
        return list(out.items())


def default_global_batch(dataset_size: int | None, world_size: int = 1) -> tuple[int, str]:
    """The global batch when none is given (``DEFAULT_GLOBAL_BATCH``), and the plan's note on
    it: no larger than the training set, and a multiple of the data-parallel ranks (each takes
    an equal share; the nearest multiple otherwise, said in the note)."""
    value = DEFAULT_GLOBAL_BATCH
    why: list[str] = []
    if dataset_size and value > dataset_size:
        value = dataset_size
        why.append(f"clipped to the training set's {dataset_size} items")
    if value % world_size:
        nearest = max(world_size, round(value / world_size) * world_size)
        if dataset_size and nearest > dataset_size:
            nearest = max(world_size, dataset_size // world_size * world_size)
        value = nearest
        why.append(f"rounded to a multiple of the {world_size} processes, one share each")
    fix = "set --global-batch or settings['global_batch'] to change it"
    if not why:
        return value, f"global batch {value} (the default; {fix})"
    return value, f"global batch {value} (the default {DEFAULT_GLOBAL_BATCH}, {' and '.join(why)}; {fix})"


def _whole(value: object, what: str) -> int:
    """``value`` as a whole number (a numpy integer, ``"64"`` or ``64.0`` too), else a one-line error."""
    if not isinstance(value, bool):
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, SupportsIndex):  # int, numpy's integers
            return operator.index(value)
    raise ConfigError(f"{what} must be a whole number, got {value!r}")


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _segment_choices(max_segments: int) -> tuple[int, ...]:
    # 0, powers of two and every block: the memory/time curve is smooth in between.
    choices = {0, max_segments} | {v for v in _powers_of_two(max_segments)}
    return tuple(sorted(choices))


def build_space(
    *,
    dataset_size: int | None,
    global_batch: int,
    precisions: tuple[Precision, ...],
    max_segments: int,
    max_micro_batch: int | None = None,
    layouts: tuple[Layout, ...] = (Layout(),),
    micro_batch_sizes: tuple[int, ...] | None = None,
    checkpoint_segments: tuple[int, ...] | None = None,
    grouping: tuple[bool, ...] = (False,),
) -> SearchSpace:
    """The space; ``micro_batch_sizes`` and ``checkpoint_segments`` pin or restrict those axes
    (each value must be one the space could hold: a divisor of the per-rank global batch, a
    segment count up to the model's blocks). The global batch is fixed (``space_for`` gives
    ``DEFAULT_GLOBAL_BATCH`` when nobody did): only how it is reached is searched."""
    world_size = max(layout.world_size for layout in layouts)
    limit = MAX_KERNEL_BATCH
    if dataset_size:
        limit = min(limit, dataset_size)
    if max_micro_batch:
        limit = min(limit, max_micro_batch)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"--global-batch must be a whole number >= 1, got {global_batch!r}")
    if dataset_size and global_batch > dataset_size:
        # Not one optimizer step would see a full batch: every epoch would train on nothing.
        raise ConfigError(
            f"global batch {global_batch} is larger than the training set ({dataset_size} items); "
            f"use --global-batch {dataset_size} or less"
        )
    per_rank, rem = divmod(global_batch, world_size)
    if rem:
        raise ConfigError(
            f"global batch {global_batch} does not divide over {world_size} processes; pick a multiple of {world_size}"
        )
    micros = [d for d in range(1, min(per_rank, limit) + 1) if per_rank % d == 0]
    if not micros:
        raise ConfigError("no micro-batch size fits the dataset; check train_data() and --global-batch")
    segments = _segment_choices(max_segments)
    if micro_batch_sizes is not None:
        bad = [m for m in micro_batch_sizes if m < 1 or per_rank % m or m > limit]
        if bad:
            raise ConfigError(
                f"--micro-batch {','.join(map(str, bad))} does not divide the per-device global "
                f"batch {per_rank}; choose from {','.join(map(str, micros))}"
            )
        micros = sorted(set(micro_batch_sizes))
    if checkpoint_segments is not None:
        bad = [c for c in checkpoint_segments if not 0 <= c <= max_segments]
        if bad:
            raise ConfigError(
                f"--checkpoint {','.join(map(str, bad))} is more segments than the model's "
                f"{max_segments} blocks; choose from 0..{max_segments}"
            )
        segments = tuple(sorted(set(checkpoint_segments)))
    return SearchSpace(tuple(micros), precisions, segments, global_batch, layouts, grouping)


_STRATEGIES: dict[str, Strategy] = {"single": "single", "ddp": "ddp", "fsdp": "fsdp"}


def layouts_for(gpus: int = 1, nodes: int = 1, strategies: Sequence[str] | None = None) -> tuple[Layout, ...]:
    """The layouts searched for ``gpus`` devices per node on ``nodes`` machines.

    One device: single-device training. More: DDP and FSDP2 over all of them — a plan for
    eight GPUs uses the eight (fewer would only be slower at the same global batch), and the
    two engines trade memory (FSDP2 shards parameters, gradients and optimizer state)
    against communication (DDP all-reduces gradients once, FSDP2 gathers parameters twice).
    Several nodes of several devices: HSDP too (``hsdp``), FSDP2 within each node and its
    gradient shards all-reduced across them, which gathers over the node's link only.
    """
    for name, value in (("--gpus", gpus), ("--nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    world = gpus * nodes
    wanted = strategies or (("single",) if world == 1 else ("ddp", "fsdp", "hsdp") if nodes > 1 and gpus > 1
                            else ("ddp", "fsdp"))
    out: list[Layout] = []
    for name in wanted:
        if name == "hsdp":
            if nodes < 2 or gpus < 2:
                raise ConfigError(f"strategy hsdp shards within each node and replicates across nodes; it needs "
                                  f"--nodes 2+ of --gpus 2+, got --gpus {gpus} --nodes {nodes}; use fsdp")
            out.append(Layout("fsdp", world, nodes, dp_replicate=nodes))
            continue
        strategy = _STRATEGIES.get(name)
        if strategy is None:
            raise ConfigError(f"unknown strategy {name!r}; use single, ddp, fsdp or hsdp")
        if strategy == "single":
            if world > 1:
                raise ConfigError(f"strategy single runs on one device, but {world} were asked for; use ddp or fsdp")
            out.append(Layout())
        else:
            out.append(Layout(strategy, world, nodes))
    return tuple(out)


def layout_key(config: TrainConfig) -> str:
    """The study's name for the layout ``config`` runs on (a pipeline's: ``pp 4 1f1b``)."""
    return Layout(config.strategy, config.world_size, config.nodes, config.tp, config.sequence_parallel,
                  config.dp_replicate, config.pp, config.pp_schedule).key


def tensor_parallel_layouts(space: SearchSpace, task: Task, model: nn.Module) -> tuple[tuple[Layout, ...], str | None]:
    """The tensor-parallel layouts of ``space``'s devices: each degree ``tp`` (a power of two up
    to the devices of one machine) that the model splits into, FSDP2 over the ``ranks / tp``
    replicas (none: ``tp`` alone); and why the model splits into none, when it does not.
    Each degree also comes sequence parallel where the model's blocks allow it (norms alone
    between the split pairs), as torchtitan trains: the same bytes communicated as plain
    tensor parallelism (a gather and a reduce-scatter for each all-reduce), ``1/tp`` of the
    stream's activations. ``model`` is built on meta."""
    from estimators.runtime._tensor_parallel import resolve_tp_plan, sequence_parallel_refusal

    spread = [layout for layout in space.layouts if layout.ranks > 1 and layout.tp == 1 and layout.dp_replicate == 1]
    if not spread:
        return (), None
    world, nodes = spread[0].ranks, spread[0].nodes
    per_node = world // nodes
    out: list[Layout] = []
    why = None
    for tp in _powers_of_two(per_node)[1:]:
        if per_node % tp:
            continue
        try:
            plan = resolve_tp_plan(model, tp, hook=task.tp_plan, finder=task.checkpoint_blocks)
        except ConfigError as exc:
            why = why or str(exc)
            continue
        # Plain tensor parallelism stays beside the sequence-parallel layout: the traced step
        # may still refuse the latter (hidden states without a sequence dimension, a length
        # that tp does not divide).
        modes = (False, True) if sequence_parallel_refusal(model, plan, finder=task.checkpoint_blocks) is None else (
            False,)
        replicas = world // tp
        out += [Layout("single", 1, 1, tp, sp) if replicas == 1 else Layout("fsdp", replicas, nodes, tp, sp)
                for sp in modes]
    return tuple(out), (why if not out else None)


def pipeline_layouts(space: SearchSpace, task: Task, model: nn.Module) -> tuple[tuple[Layout, ...], str | None]:
    """The pipeline layouts of ``space``'s devices: all the devices of one machine, one stage
    each, under 1F1B, and interleaved 1F1B (two stages a device) where the block stack has a
    block for each of those (a pipeline alone: data parallelism over pipelines is not combined
    yet); and why there is none, when the model cannot be cut into that many stages."""
    from estimators import default_loss
    from estimators.runtime._checkpoint import find_block_stack
    from estimators.runtime._pipeline import VIRTUAL_STAGES

    spread = [layout for layout in space.layouts if layout.ranks > 1 and layout.tp == 1 and layout.dp_replicate == 1]
    if not spread or spread[0].nodes > 1:
        return (), None
    pp = spread[0].ranks
    blocks = len(find_block_stack(model, task.checkpoint_blocks))
    if blocks < pp:
        return (), f"the block stack has {blocks} blocks, fewer than the {pp} stages of a pipeline over the devices"
    if task.loss_fn is not default_loss:
        return (), "pipeline stages run the default loss, and the model file defines its own"
    looped = "interleaved-1f1b"
    interleaved = (Layout("single", 1, 1, pp=pp, pp_schedule=looped),) if blocks >= pp * VIRTUAL_STAGES[looped] else ()
    return (Layout("single", 1, 1, pp=pp), *interleaved), None


def _precisions(estimator: Estimator, wanted: Sequence[str] | None) -> tuple[Precision, ...]:
    if estimator.device == "cuda":
        supported: list[Precision] = ["fp32", "fp16-mixed"]
        if estimator.spec is not None and estimator.spec.bf16:
            supported.append("bf16-mixed")
    else:
        # fp16 autocast runs ~50x slower than bf16 on CPUs: never the fastest, so not searched.
        supported = ["fp32", "bf16-mixed"]
    # Pure low precision (weights, gradients and state in 16 bits) changes the numerics: not
    # searched by default, but when nothing fits otherwise (frugal_space) or when asked for.
    true_precisions: list[Precision] = ["bf16-true"] if "bf16-mixed" in supported else []
    if estimator.device == "cuda":
        true_precisions.append("fp16-true")
    if wanted is None:
        if "bf16-mixed" in supported and "fp16-mixed" in supported:
            # Where the card has bf16, fp16 runs at the same tensor-core rate with the same
            # two-byte activations, plus a GradScaler's unscale and inf checks every step: it
            # is never the faster plan, so it is searched only when asked for (--precision).
            return tuple(p for p in supported if p != "fp16-mixed")
        return tuple(supported)
    chosen = tuple(normalize_precision(p) for p in wanted)
    supported += true_precisions
    refused = [p for p in chosen if p not in supported]
    if refused:
        raise ConfigError(
            f"precision {', '.join(refused)} is not available on {estimator.spec.name if estimator.spec else estimator.device}; choose from {', '.join(supported)}"
        )
    return chosen


def space_for(
    task: Task,
    estimator: Estimator,
    blocks_model: nn.Module,
    *,
    global_batch: int | None,
    precisions: Sequence[str] | None,
    max_micro_batch: int | None,
    layouts: tuple[Layout, ...],
    micro_batch_sizes: Sequence[int] | None,
    checkpoint_segments: Sequence[int] | None,
    notes: list[str] | None = None,
) -> SearchSpace:
    """The space of ``task`` on the estimator's target: the user's pins and restrictions, the
    global batch (``global_batch``, else the model file's ``settings["global_batch"]``, else
    ``DEFAULT_GLOBAL_BATCH``, which ``notes`` then names), the precisions the device runs well,
    and the checkpoint segments ``blocks_model`` (built on meta) has."""
    dataset_size = task.dataset_size() if task.train_data is not None else None
    fixed_batch = global_batch if global_batch is not None else task.settings.get("global_batch")
    if fixed_batch is None:
        fixed_batch, note = default_global_batch(dataset_size, max(layout.world_size for layout in layouts))
        if notes is not None:
            notes.append(note)
    return build_space(
        dataset_size=dataset_size,
        global_batch=_whole(fixed_batch, "--global-batch" if global_batch is not None else
                            f"settings['global_batch'] of {task.name}"),
        precisions=_precisions(estimator, precisions),
        max_segments=max_checkpoint_segments(blocks_model, task.checkpoint_blocks),
        max_micro_batch=max_micro_batch,
        layouts=layouts,
        micro_batch_sizes=tuple(micro_batch_sizes) if micro_batch_sizes else None,
        checkpoint_segments=tuple(checkpoint_segments) if checkpoint_segments is not None else None,
        # Length-grouped batching pads less; it needs every item's size to order the data.
        grouping=(False, True) if task.train_data is not None and task.shapes().groupable else (False,),
    )


OPTIMIZER_IN_BACKWARD = Technique("optimizer-in-backward", (("optimizer_in_backward", True),))
"""Each parameter stepped as its gradient is ready (one device, no accumulation: a
configuration it does not apply to stays as it is)."""


def optimizer_in_backward_excluded(task: Task) -> str | None:
    """Why the task's step cannot step the optimizer in backward (None: it can)."""
    if task.step.clip == "norm":
        return (
            "the step clips by the global gradient norm, which needs every gradient before any step "
            "(clip by value or turn clipping off to search it)"
        )
    return None


FRUGAL_TECHNIQUES = (Technique("selective-checkpointing", (("checkpoint_policy", "selective"),)),
                     Technique("op-checkpointing", (("checkpoint_policy", "op"),)))
"""Searched when nothing fits with the standard axes: exact, but slower than what they replace.
The checkpointed blocks keep their matmul outputs (selective), or torchtitan's every other one
(op: between selective and full in memory and recomputation)."""


def frugal_space(space: SearchSpace, estimator: Estimator, *, precisions_pinned: bool,
                 tp_layouts: Sequence[Layout] = ()) -> SearchSpace | None:
    """``space`` widened with the techniques that trade speed or precision for memory, for
    when nothing fits without them: pure bf16 (``bf16-true``: weights, gradients and optimizer
    state in bf16) where the device has bf16 and the precisions were not pinned, selective
    and op-policy checkpointing, the optimizer step in backward (one device, no accumulation, unless the
    step clips by the global norm), on a GPU activation offloading and FSDP2's CPU offload
    (one rank, or every FSDP2 layout's), and ``tp_layouts`` (tensor parallelism: its
    collectives cost every layer time, so it is tried when sharding alone does not fit, as
    the large-model recipes use it). None when there is nothing to add."""
    from dataclasses import replace

    precisions = space.precisions
    has_bf16 = estimator.device == "cpu" or (estimator.spec is not None and estimator.spec.bf16)
    if not precisions_pinned and has_bf16 and "bf16-true" not in precisions:
        precisions = (*precisions, "bf16-true")
    techniques = (
        tuple(t for t in FRUGAL_TECHNIQUES if t not in space.techniques) if max(space.checkpoint_segments) else ()
    )
    if (
        OPTIMIZER_IN_BACKWARD not in space.techniques
        and optimizer_in_backward_excluded(estimator.task) is None
        and any(layout.strategy == "single" for layout in space.layouts)
    ):
        techniques = (*techniques, OPTIMIZER_IN_BACKWARD)
    if estimator.device == "cuda":
        # Host memory is the device's on a CPU target: offloading there saves nothing.
        if ACTIVATION_OFFLOAD not in space.techniques:
            techniques = (*techniques, ACTIVATION_OFFLOAD)
        if CPU_OFFLOAD not in space.techniques and any(layout.strategy != "ddp" for layout in space.layouts):
            techniques = (*techniques, CPU_OFFLOAD)
    layouts = tuple(layout for layout in tp_layouts if layout not in space.layouts)
    if precisions == space.precisions and not techniques and not layouts:
        return None
    return replace(space, precisions=precisions, techniques=(*space.techniques, *techniques),
                   layouts=(*space.layouts, *layouts))
