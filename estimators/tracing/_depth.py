"""Tracing a model with its block stack cut short, each event tagged with its block.

A transformer repeats one block 16 to 126 times, and a trace's time is mostly the blocks'.
``_compose`` builds the trace of the whole stack from traces of the model cut to a few
blocks; this module makes those traces:

* :func:`block_differences` says whether the stack's blocks are the same module with the same
  shapes (class, parameters, buffers and plain attributes of every submodule; an attribute
  that only numbers the blocks, such as a layer index, may differ);
* :func:`cut_stack` keeps the first ``keep`` blocks of the stack's container (a
  ``ModuleList`` or ``Sequential``): forwards that iterate the container run those;
* :func:`tagged_blocks` hooks the kept blocks so that the recorder knows whose forward or
  backward runs (:class:`~estimators.tracing._recorder.BlockTags`).

What a cut is traced with is :class:`DepthCut`: how many blocks are kept and which of them are
checkpointed (the full model's checkpointed blocks are spread over its stack; a cut chooses
its own so that every kind of neighbourhood the full stack has is in it).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .._errors import MemplanError
from ..runtime._checkpoint import BlockFinder, apply_checkpointing, find_block_stack
from ._recorder import BlockTags, Recorder
from ._simulated_ranks import EmulatedDDP

__all__ = ["DepthCut", "NotComposable", "block_differences", "cut_stack", "tagged_blocks"]


class NotComposable(MemplanError):
    """The trace of the whole stack cannot be composed from traces of a cut one (the reason)."""


@dataclass(frozen=True, slots=True)
class DepthCut:
    """A model traced with its block stack cut to ``keep`` blocks, the blocks ``checkpointed``
    (indices into the kept ones) checkpointed with the configuration's policy."""

    keep: int
    checkpointed: tuple[int, ...] = ()


def _plain(value: object, depth: int = 0) -> bool:
    """A value compared by equality: a number, a string, a dtype, or a list, tuple or dict of them
    (nested at most 8 deep: a list that holds itself is not plain)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    if depth >= 8:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _signature(block: nn.Module) -> list[tuple[str, object]]:
    """What must be equal between blocks: each submodule's class, parameters (shape, dtype,
    requires_grad), buffers (shape, dtype) and plain attributes, by name."""
    out: list[tuple[str, object]] = []
    for name, module in block.named_modules():
        out.append((f"{name}:class", type(module)))
        for key, p in module._parameters.items():
            out.append((f"{name}.{key}", None if p is None else (tuple(p.shape), p.dtype, p.requires_grad)))
        for key, b in module._buffers.items():
            out.append((f"{name}.{key}", None if b is None else (tuple(b.shape), b.dtype)))
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, (nn.Module, torch.Tensor)):
                continue
            # Plain values compare by value, anything else (a shared config object) by identity;
            # a block's own list or dict of plain values (head sizes, say) by its repr, which
            # tells [1] from [True] and orders a dict's keys as they were set.
            plain = repr(value) if isinstance(value, (list, dict)) and _plain(value) else value
            out.append((f"{name}.{key}" if name else key, plain if _plain(value) else ("id", id(value))))
    return out


def block_differences(blocks: Sequence[nn.Module]) -> str | None:
    """None when ``blocks`` are the same module with the same shapes; else what differs."""
    if len({id(b) for b in blocks}) != len(blocks):
        return "the block stack holds one module more than once"
    signatures = [_signature(b) for b in blocks]
    first = signatures[0]
    for i, sig in enumerate(signatures[1:], start=1):
        if [k for k, _ in sig] != [k for k, _ in first]:
            return f"block {i} has other submodules, parameters or attributes than block 0"
    for j, (key, _) in enumerate(first):
        values = [sig[j][1] for sig in signatures]
        if all(v == values[0] for v in values):
            continue
        numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(numbers) == len(values) and _numbering(numbers):
            continue  # a layer index: numbers the blocks
        if all(isinstance(v, str) for v in values) and _named_by_index([str(v) for v in values]):
            continue  # a name holding the layer index (PEFT's target_name, "model.layers.3.q_proj")
        i = next(i for i, v in enumerate(values) if v != values[0])
        return f"blocks differ in {key} ({values[0]!r} in block 0, {values[i]!r} in block {i})"
    return None


def _numbering(numbers: list[int]) -> bool:
    return numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def _named_by_index(texts: list[str]) -> bool:
    """Strings equal but for numbers that number the blocks (each place's numbers equal in every
    block, or consecutive from block to block)."""
    parts = [re.split(r"(\d+)", t) for t in texts]
    if any(len(p) != len(parts[0]) for p in parts):
        return False
    for k, column in enumerate(zip(*parts)):
        if k % 2 == 0:
            if any(c != column[0] for c in column):
                return False
        elif any(c != column[0] for c in column) and not _numbering([int(c) for c in column]):
            return False
    return True


def _container(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[nn.Module, list[str]]:
    """The ModuleList or Sequential holding ``blocks`` as consecutive children, and their keys."""
    ids = [id(b) for b in blocks]
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        keys = [k for k, child in module._modules.items() if child is not None and id(child) in set(ids)]
        if len(keys) != len(blocks):
            continue
        order = list(module._modules)
        positions = [order.index(k) for k in keys]
        if [id(module._modules[k]) for k in keys] != ids or positions != list(range(positions[0],
                                                                                    positions[0] + len(keys))):
            raise NotComposable("the blocks are not consecutive, in order, in their container")
        return module, keys
    raise NotComposable("the blocks are not the children of one ModuleList or Sequential")


def cut_stack(model: nn.Module, finder: BlockFinder | None, keep: int) -> list[nn.Module]:
    """Cut the model's block stack to its first ``keep`` blocks, in place; the kept blocks."""
    blocks = find_block_stack(model, finder)
    if len(blocks) < keep:
        raise NotComposable(f"the stack has {len(blocks)} blocks, fewer than the {keep} to keep")
    container, keys = _container(model, blocks)
    dropped = set(keys[keep:])
    kept = [(k, m) for k, m in container._modules.items() if k not in dropped and m is not None]
    if isinstance(container, nn.ModuleList):
        container._modules = OrderedDict((str(i), m) for i, (_, m) in enumerate(kept))
    else:
        container._modules = OrderedDict(kept)
    after = find_block_stack(model, finder)
    if [id(b) for b in after] != [id(b) for b in blocks[:keep]]:
        raise NotComposable("the block finder does not find the cut stack's blocks")
    return list(blocks[:keep])


def checkpoint_cut(blocks: Sequence[nn.Module], cut: DepthCut, policy: str) -> None:
    """Checkpoint the cut's chosen blocks (the trace then builds with no segments of its own)."""
    chosen = [blocks[i] for i in cut.checkpointed]
    if chosen:
        apply_checkpointing(nn.Module(), len(chosen), lambda _m: chosen, policy=policy)


def _first_grad_tensor(value: object) -> torch.Tensor | None:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
            return leaf
    return None


class _BucketTags:
    """Tags DDP's buckets and gradient views (:class:`~._simulated_ranks.BucketObserver`): a
    bucket is its first parameter's block's, a gradient view its parameter's."""

    def __init__(self, tags: BlockTags, owners: dict[int, int]) -> None:
        self.tags, self.owners = tags, owners

    def making(self, param: torch.Tensor | None) -> None:
        self.tags.block = -1 if param is None else self.owners.get(id(param), -1)

    def views(self, views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tags.views.clear()
        for param, view in views:
            block = self.owners.get(id(param), -1)
            if block >= 0:
                self.tags.views[id(view)] = block


@contextlib.contextmanager
def tagged_blocks(rec: Recorder, blocks: Sequence[nn.Module], wrapped: nn.Module | None = None,
                  owners: dict[int, int] | None = None) -> Iterator[BlockTags]:
    """Tag what the recorder records with the block whose forward or backward runs.

    A block's forward runs between its pre-hook (first of its pre-hooks, before FSDP2's
    unshard) and its forward hook (after FSDP2's reshard); its backward from when the gradient
    of its output is complete (before FSDP2's hook there) until that of the next block down,
    the first block's until the gradient of its input is. Hooks on tensors and modules
    allocate nothing. DDP's (``wrapped``, an ``EmulatedDDP``) buckets and gradient views get
    the blocks of their parameters (``owners``, :func:`param_blocks`)."""
    tags = rec.tags = BlockTags()
    ddp = wrapped if isinstance(wrapped, EmulatedDDP) else None
    if ddp is not None:
        ddp.observer = _BucketTags(tags, owners or {})
        ddp.observer.views(ddp.views())
    # The blocks' outputs so far, by id, each with a weak reference that proves it is still that
    # tensor: a dead output's id is soon another tensor's (the next micro-batch's input to the
    # first block, at whatever address the process's history gives it), which would lose the
    # hook that ends the first block's backward.
    outputs: dict[int, weakref.ref[torch.Tensor]] = {}

    def _is_output(t: torch.Tensor) -> bool:
        ref = outputs.get(id(t))
        return ref is not None and ref() is t

    def set_block(i: int) -> None:
        tags.enter(i)

    def pre(i: int) -> object:
        def hook(module: nn.Module, args: object, kwargs: object) -> None:
            tags.enter(i)
            if i == 0:
                t = _first_grad_tensor((args, kwargs))
                if t is not None and not _is_output(t):
                    t.register_hook(lambda _g: set_block(-1))
        return hook

    def marked(i: int) -> object:
        def hook(module: nn.Module, args: object, kwargs: object, output: object) -> None:
            t = _first_grad_tensor(output)
            if t is not None:
                outputs[id(t)] = weakref.ref(t)
                t.register_hook(lambda _g: set_block(i))
        return hook

    def post(module: nn.Module, args: object, kwargs: object, output: object) -> None:
        tags.enter(-1)

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre(i), prepend=True, with_kwargs=True))  # type: ignore[arg-type]
        # The output's hook goes before FSDP2's pre-backward (which unshards this block and
        # prefetches the next one down): that work is this block's.
        mark = block.register_forward_hook(marked(i), prepend=True, with_kwargs=True)  # type: ignore[arg-type]
        _just_before_fsdp(block, mark)
        handles.append(mark)
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        yield tags
    finally:
        for h in handles:
            h.remove()
        if ddp is not None:
            ddp.observer = None


def _just_before_fsdp(block: nn.Module, mark: torch.utils.hooks.RemovableHandle) -> None:
    """Move the forward hook ``mark`` (first of ``block``'s) to just before FSDP2's
    post-forward, where ``block`` has one: FSDP2 hooks its pre-backward on the output as the
    hooks before it leave it, and a hook there may replace the output (sequence parallelism
    gathers the last block's): the block's backward must begin where FSDP2's work does, on the
    same tensor, or the unshard it makes (this block's and the prefetched one's) falls outside
    the block, to whichever block owns the parameters."""
    from torch.distributed._composable_state import _get_module_state

    state = _get_module_state(block)
    fsdp = getattr(state, "_post_forward_hook_handle", None)
    hooks = block._forward_hooks
    if fsdp is None or fsdp.id not in hooks or mark.id not in hooks:
        return
    order = [k for k in hooks if k != mark.id]
    order.insert(order.index(fsdp.id), mark.id)
    reordered = {k: hooks[k] for k in order}
    hooks.clear()
    hooks.update(reordered)


def param_blocks(blocks: Sequence[nn.Module]) -> dict[int, int]:
    """id of each parameter and buffer of the blocks -> its block."""
    out: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for t in (*block.parameters(), *block.buffers()):
            out.setdefault(id(t), i)
    return out
