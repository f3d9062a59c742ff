"""Pipeline parallelism: the model cut into stages at its block stack, and the schedule that runs them.

``TrainConfig.pp`` processes each hold one stage (two, looped, under ``interleaved-1f1b``) of
the model, cut with ``torch.distributed.pipelining.pipeline`` (``torch.export`` of the model's
forward on one micro-batch, split before the first block of each later stage). The blocks are
the block stack checkpointing uses, spread over the stages by parameter count; the first stage
also runs what comes before the blocks (the embeddings), the last what comes after them (the
last norm, the head) and the loss. The library's schedule (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``) runs ``pp_microbatches`` micro-batches through
the stages and accumulates their gradients, averaged (``scale_grads``): the same gradients as
accumulating the micro-batches on one device.

A value the forward computes before the blocks and that every block takes (an attention mask,
rotary tables) reaches the later stages only through the stages between: the library passes
activations between neighbours only, so :func:`_pass_skips_through` makes each stage in
between take such a value and give it back as one more output.

What the schedule needs and memplan's step gives it: the batch of a step (the micro-batches,
concatenated; the schedule splits it again), the default loss (cross entropy with the task's
label smoothing, on the last stage: a model file's own ``loss`` sees the whole model, which no
stage is), and a model whose inputs are one tensor (or a tuple of tensors) and whose output is
one tensor. Checkpointed blocks are checkpointed in the stage that holds them (the export
would trace through a checkpoint and lose it). Parameters shared between stages (a head tied
to the embedding) are refused: each stage would update its own copy.

The same code builds the stages on the trace's fake process group (any rank of any world
size: static shapes from the export, no handshake) and on a real one, so that a fake trace of
a stage records what that stage's process allocates.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._config import TrainConfig
from .._errors import ConfigError
from ._checkpoint import BlockFinder, apply_checkpointing, find_block_stack

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import fx

    from ._step import StepHooks

__all__ = ["VIRTUAL_STAGES", "PipelinedModel", "StageModules", "build_pipeline", "pipeline_inputs", "stage_cuts",
           "stage_count", "traced_ranks"]

VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}
"""Stages each process holds, per schedule (looped: process ``r`` holds stages ``r``, ``r + pp``)."""


def stage_count(config: TrainConfig) -> int:
    """Stages the model is cut into."""
    return config.pp * VIRTUAL_STAGES[config.pp_schedule]


def traced_ranks(pp: int) -> tuple[int, ...]:
    """The pipeline ranks whose stage a fake trace records: the first, one in the middle and the
    last (the middle ones hold alike: the same blocks, the same buffers)."""
    return tuple(sorted({0, pp // 2, pp - 1}))


def stage_cuts(weights: Sequence[int], stages: int) -> list[int]:
    """The index of the first block of each stage after the first: ``len(weights)`` blocks of
    these weights in ``stages`` runs of at least one block, each as near ``1/stages`` of the
    total as the cuts allow."""
    n = len(weights)
    if stages > n:
        raise ConfigError(f"{stages} pipeline stages need at least {stages} blocks in the block stack, which has "
                          f"{n}; use a smaller pp")
    total = float(sum(weights)) or 1.0
    cuts: list[int] = []
    running = 0.0
    prefix = [0.0]
    for w in weights:
        running += w
        prefix.append(running)
    start = 0
    for k in range(1, stages):
        target = total * k / stages
        # The cut nearest the target that leaves each stage, this one and those after, a block.
        lo, hi = start + 1, n - (stages - k)
        cut = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(cut)
        start = cut
    return cuts


class PipelinedModel(nn.Module):
    """One process's stages and the schedule that runs them.

    ``modules`` holds the stages' modules (its parameters are this process's: clipping,
    optimizer, state dicts use it). :meth:`run` runs one pipeline step on a step's batch.
    """

    def __init__(self, stages: list[Any], *, group: dist.ProcessGroup | None, rank: int, pp: int,
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.stages = stages
        self.modules_ = StageModules([s.submod for s in stages])
        self.n_stages = pp * len(stages)
        self.micro_batch = 1
        """The micro-batch size the stages were exported at."""
        self.has_dropout = False
        """Did the model hold dropout? The export fixed it on (training mode), evaluation too."""
        self.schedule: Any = None
        self.label_smoothing = label_smoothing
        """The default loss's (the step's options set it: ``_step.make_step_parts``)."""
        self.group = group
        self.rank = rank
        self.pp = pp
        self.send_bytes = 0
        """What this process's busiest stage passes on per micro-batch (its outputs' bytes)."""
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)

    @torch.no_grad()
    def forward(self, inputs: Any) -> torch.Tensor:
        """The whole model's output for ``inputs`` (evaluation; training runs :meth:`run`), on
        every process: the stages run one after the other, each process its own, passing their
        outputs on (their shapes first: an evaluation batch may be smaller than a micro-batch);
        the last stage's output is broadcast."""
        import torch.distributed as dist

        group, pp = self.group, self.pp
        mine = {s.stage_index: s for s in self.stages}
        values: tuple[Any, ...] = inputs if isinstance(inputs, tuple) else (inputs,)
        # The stages were exported at one micro-batch's shapes: a smaller batch is padded with
        # copies of its first item, and the output cut back to it.
        n = int(values[0].shape[0])
        values = tuple(_padded(v, self.micro_batch) for v in values)
        device = next((p.device for p in self.modules_.parameters()), torch.device("cpu"))
        for index in range(self.n_stages):
            owner, before = index % pp, (index - 1) % pp
            if index > 0 and owner != before:
                if self.rank == before:
                    _send(values, owner, group)
                    values = ()
                elif self.rank == owner:
                    values = _recv(before, group, device)
            if self.rank == owner:
                out = mine[index].submod(*values)
                values = out if isinstance(out, tuple) else (out,)
        last = (self.n_stages - 1) % pp
        output: torch.Tensor = values[0] if self.rank == last else torch.empty(0)
        meta: list[Any] = [(tuple(output.shape), output.dtype) if self.rank == last else None]
        dist.broadcast_object_list(meta, group_src=last, group=group)
        shape, dtype = meta[0]
        if self.rank != last:
            output = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(output, group_src=last, group=group)
        return output[:n]

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The default loss on the last stage's output, shaped as ``default_logits_and_targets``
        shapes it (sequence outputs flattened)."""
        from ..task._task import loss_shapes

        return F.cross_entropy(*loss_shapes(out, targets), label_smoothing=self.label_smoothing)

    def run(self, inputs: Any, targets: torch.Tensor | None) -> list[torch.Tensor]:
        """One pipeline step over the micro-batches of ``inputs``/``targets`` (split on their
        first dimension); the last stage's per-micro-batch losses (none elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.is_first else ()
        self.schedule.step(*args, target=targets if self.is_last else None, losses=losses if self.is_last else None,
                           return_outputs=False)
        return losses

    @contextlib.contextmanager
    def phases(self, hooks: StepHooks, step: int) -> Iterator[None]:
        """Tell ``hooks`` where each stage's forward and backward of a micro-batch begins, as a
        step without a pipeline does (``step 1 micro 2 forward``; ``stage 3`` with two a process)."""
        several = len(self.stages) > 1
        saved = []
        for stage in self.stages:
            where = f"stage {stage.stage_index} " if several else ""
            for method, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
                original = getattr(stage, method)
                saved.append((stage, method))
                setattr(stage, method, _announced(original, hooks, f"step {step} {where}micro", kind))
        try:
            yield
        finally:
            for stage, method in saved:
                stage.__dict__.pop(method, None)

    def share_loss(self, loss_sum: torch.Tensor) -> None:
        """Give every stage the last stage's loss (the step's result on every process)."""
        import torch.distributed as dist

        if self.group is not None and self.pp > 1:
            dist.broadcast(loss_sum, group_src=self.pp - 1, group=self.group)


class StageModules(nn.Module):
    """A process's stages' parameters and buffers under the names they have in the model
    (``layers.3.attn.q_proj.weight``), the same tensors the stages train: its state dict is the
    model's, restricted to the stages, whatever the cut."""

    def __init__(self, submods: Sequence[nn.Module]) -> None:
        super().__init__()
        for sub in submods:
            for name, param in sub.named_parameters():
                _place(self, name, param, persistent=True)
            for name, buf in sub.named_buffers():
                owner, _, leaf = name.rpartition(".")
                holder = sub.get_submodule(owner) if owner else sub
                _place(self, name, buf, persistent=leaf not in holder._non_persistent_buffers_set)

    def forward(self, *args: Any) -> Any:  # pragma: no cover - a holder of tensors, run by the stages
        raise RuntimeError("a pipeline's stage modules run through the pipeline")


def _place(root: nn.Module, name: str, tensor: torch.Tensor, *, persistent: bool) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]  # type: ignore[assignment]
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def _padded(t: Any, size: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] >= size:
        return t
    return torch.cat([t, t[:1].expand(size - t.shape[0], *t.shape[1:])])


def _send(values: tuple[Any, ...], dst: int, group: Any) -> None:
    import torch.distributed as dist

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    dist.send_object_list([[(tuple(t.shape), t.dtype) for t in tensors]], group_dst=dst, group=group)
    for t in tensors:
        dist.send(t.contiguous(), group_dst=dst, group=group)


def _recv(src: int, group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    import torch.distributed as dist

    meta: list[Any] = [None]
    dist.recv_object_list(meta, group_src=src, group=group)
    out = []
    for shape, dtype in meta[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, group_src=src, group=group)
        out.append(t)
    return tuple(out)


def _announced(method: Callable[..., Any], hooks: StepHooks, prefix: str, kind: str) -> Callable[..., Any]:
    def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
        hooks.phase(f"{prefix} {chunk + 1} {kind}", kind)
        return method(chunk, *args, **kwargs)

    return run


def build_pipeline(model: nn.Module, config: TrainConfig, example: Any, *, finder: BlockFinder | None,
                   device: torch.device, rank: int, group: dist.ProcessGroup | None = None) -> PipelinedModel:
    """``model`` cut into ``stage_count(config)`` stages, this process's (pipeline ``rank``)
    built and checkpointed as ``config`` says, with its schedule. ``example`` is one
    micro-batch's inputs (real or fake tensors): the export traces the forward on it."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        SplitPoint,
        pipeline,
    )

    blocks = find_block_stack(model, finder)
    if not blocks:
        raise ConfigError("pipeline stages are cut at the model's block stack, and none was found; define "
                          "checkpoint_blocks(model) in the model file, or use pp=1")
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    _check_unshared(model)
    n_stages = stage_count(config)
    cuts = stage_cuts([sum(p.numel() for p in b.parameters()) for b in blocks], n_stages)
    args = example if isinstance(example, tuple) else (example,)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise ConfigError("pipeline stages take tensors: the model's inputs must be a tensor or a tuple of tensors; "
                          "use pp=1")
    try:
        with warnings.catch_warnings():
            # The library's own deprecated pytree check, once per copied tree spec: not the user's to act on.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            pipe = pipeline(model, mb_args=args, split_spec={block_names[c]: SplitPoint.BEGINNING for c in cuts})
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.export's errors are many; one line names the cause
        raise ConfigError(f"the model's forward could not be cut into pipeline stages by torch.export "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); use pp=1") from exc
    for c in cuts:
        # pipeline() left its split marker on each cut block (``forward`` bound to the block, a
        # reference cycle that would keep a block another stage owns alive until a collection).
        block = blocks[c]
        if "_orig_forward" in block.__dict__:
            original = block.__dict__.pop("_orig_forward")
            block.__dict__.pop("forward", None)
            if getattr(original, "__self__", None) is not block:
                block.forward = original  # an instance forward of its own (a checkpoint's): kept
    _check_one_stage_each(pipe, n_stages)
    _pass_skips_through(pipe)
    # Which blocks each stage holds, and which of them are checkpointed.
    bounds = [0, *cuts, len(blocks)]
    from ._checkpoint import select_blocks

    chosen = set(select_blocks(len(blocks), config.checkpoint_segments))
    stages: list[Any] = []
    for index in range(rank, n_stages, config.pp):
        stage = pipe.build_stage(index, device, group=group)
        own = [block_names[i] for i in range(bounds[index], bounds[index + 1]) if i in chosen]
        if own:
            mods = [stage.submod.get_submodule(name) for name in own]
            apply_checkpointing(stage.submod, len(mods), _these(mods), policy=config.checkpoint_policy)
        stages.append(stage)
    sent = [_output_bytes(pipe.split_gm, s.stage_index) for s in stages if not s.is_last]
    # The stages' graph (each stage reads its neighbours' shapes from it) keeps the cut model
    # alive: the other stages' modules go, and with them their parameters.
    ours = {id(s.submod) for s in stages}
    for node in list(pipe.split_gm.graph.nodes):
        if node.op == "call_module" and id(pipe.split_gm.get_submodule(node.target)) not in ours:
            pipe.split_gm._modules.pop(str(node.target), None)
    del pipe
    # The cut model's graphs are reference cycles: collected now, they no longer hold the other
    # stages' parameters, which then go with the caller's model (not at some later collection,
    # in the middle of a step).
    gc.collect()
    import torch.distributed as dist

    piped = PipelinedModel(stages, group=group if group is not None else dist.group.WORLD, rank=rank, pp=config.pp)
    piped.send_bytes = max(sent, default=0)
    piped.micro_batch = config.micro_batch_size
    piped.has_dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    m = config.pp_microbatches
    if config.pp_schedule == "interleaved-1f1b":
        piped.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=piped.loss)
    else:
        kind = ScheduleGPipe if config.pp_schedule == "gpipe" else Schedule1F1B
        piped.schedule = kind(stages[0], m, loss_fn=piped.loss)
    return piped


def _these(modules: list[nn.Module]) -> BlockFinder:
    """A block finder that finds ``modules``: a stage's own blocks, by their names in it."""
    return lambda _model: modules


def pipeline_inputs(batch: Any) -> Any:
    """What the first stage takes of a batch ``(inputs, targets)``: the inputs."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ConfigError("pipeline stages run the default loss, which needs batches of (inputs, targets); use pp=1 "
                          "for other batch layouts")
    return batch[0]


def _check_unshared(model: nn.Module) -> None:
    """Refuse a parameter used by modules that could land on different stages (a tied head)."""
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if id(p) in owners and owners[id(p)] != full:
                raise ConfigError(f"parameter {owners[id(p)]} is also {full}: stages would each update their own "
                                  "copy; untie it, or use pp=1")
            owners[id(p)] = full


def _output_bytes(gm: Any, index: int) -> int:
    """Bytes of stage ``index``'s outputs, from the cut's shapes (as the stage reads them)."""
    from torch.fx.node import map_arg

    call = [n for n in gm.graph.nodes if n.op == "call_module"][index]
    out = next(n for n in gm.get_submodule(str(call.target)).graph.nodes if n.op == "output")
    nodes: list[fx.Node] = []

    def seen(n: fx.Node) -> fx.Node:
        nodes.append(n)
        return n

    map_arg(out.args, seen)
    vals = [n.meta.get("val") for n in nodes]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _check_one_stage_each(pipe: Any, n_stages: int) -> None:
    """Refuse a parameter the cut put in two stages (a head that reads the embedding's weight):
    each would update its own copy, and the tie would silently come undone."""
    where: dict[str, int] = {}
    for index in range(n_stages):
        for name, _ in pipe.get_stage_module(index).named_parameters():
            if name in where and where[name] != index:
                raise ConfigError(f"parameter {name} is used by pipeline stages {where[name]} and {index} (a tied "
                                  "weight?): each would update its own copy; untie it, or use pp=1")
            where[name] = index


def _source(node: fx.Node, calls: dict[fx.Node, int]) -> int | None:
    """The stage whose output ``node`` is (-1: an input of the model; None: neither)."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "placeholder":
        return -1
    return calls.get(node)


def _pass_skips_through(pipe: Any) -> None:
    """Make every value a stage takes come from the stage just before it (or, for the first,
    from the model's inputs), by passing it through each stage between: each takes it as one
    more input and gives it back as one more output."""
    gm = pipe.split_gm
    graph = gm.graph
    order = [n for n in graph.nodes if n.op == "call_module"]
    calls = {n: i for i, n in enumerate(order)}
    passed: dict[tuple[int, fx.Node], fx.Node] = {}  # (stage, value) -> that stage's output of it
    for j, call in enumerate(order):
        for a in range(len(call.args)):
            arg = call.args[a]  # read again: passing a value on may have replaced this one
            if not hasattr(arg, "op"):
                continue
            src = _source(arg, calls)
            if src is None or src >= j - 1:
                continue
            if src == -1 and arg not in order[0].args:
                raise ConfigError("an input of the model is used after the first pipeline stage only; pass it "
                                  "to what runs before the blocks, or use pp=1")
            value: fx.Node = arg
            # From the stage after its source on (a model input: from the first, which takes it).
            for k in range(src + 1 if src >= 0 else 0, j):
                value = _thread(gm, order[k], value, passed, k)
            call.update_arg(a, value)
    graph.lint()
    gm.recompile()


def _thread(gm: Any, call: fx.Node, value: fx.Node, passed: dict[tuple[int, fx.Node], fx.Node], k: int) -> fx.Node:
    """``call``'s stage gives ``value`` back as one more output; its node in the outer graph."""
    key = (k, value)
    if key in passed:
        return passed[key]
    sub = gm.get_submodule(str(call.target))
    inner = sub.graph
    placeholders = [n for n in inner.nodes if n.op == "placeholder"]
    if value in call.args:
        ph = placeholders[list(call.args).index(value)]
    else:
        with inner.inserting_after(placeholders[-1]):
            ph = inner.placeholder(f"passed_{len(placeholders)}")
        ph.meta["val"] = value.meta.get("val")
        call.args = (*call.args, value)
    out = next(n for n in inner.nodes if n.op == "output")
    results = out.args[0]
    graph = call.graph
    if not isinstance(results, (tuple, list)):
        # One output, used as is outside: make it the first of a tuple.
        out.args = ((results, ph),)
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        first.meta["val"] = call.meta.get("val")
        call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
        call.meta["val"] = (first.meta.get("val"), value.meta.get("val"))
        index = 1
    else:
        out.args = ((*results, ph),)
        index = len(results)
        if isinstance(call.meta.get("val"), (tuple, list)):
            call.meta["val"] = (*call.meta["val"], value.meta.get("val"))
    inner.lint()
    sub.recompile()
    # After the call's last output read, so that the outputs stay in order.
    users = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    anchor = max(users, key=lambda u: list(graph.nodes).index(u)) if users else call
    with graph.inserting_after(anchor):
        node = graph.call_function(operator.getitem, (call, index))
    node.meta["val"] = value.meta.get("val")
    passed[key] = node
    return node
