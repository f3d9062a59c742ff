"""Activation checkpointing, applied the same way when tracing, probing and training.

How ``checkpoint_segments = N`` maps onto a model:

* memplan finds the model's *block stack*: the ``nn.ModuleList`` or ``nn.Sequential`` whose
  repeated children (two or more of the same class, holding parameters) hold the most
  parameters. GPT-style ``transformer.h``, ``nn.TransformerEncoder.layers``, a ResNet stage or
  a plain ``nn.Sequential`` of identical blocks all qualify. A model file can name its own
  stack with ``checkpoint_blocks(model) -> list[nn.Module]``.
* ``N = 0`` checkpoints nothing; ``N = len(stack)`` checkpoints every block; in between, N
  blocks spread evenly over the stack are checkpointed (torchtitan's "every k-th layer").
* A checkpointed block keeps only its inputs during forward and recomputes its activations in
  backward (``torch.utils.checkpoint``, non-reentrant). The block's ``forward`` is replaced on
  the instance, so parameter names and ``state_dict`` keys do not change.
* ``checkpoint_policy = "selective"`` checkpoints the same blocks, but a block also keeps the
  outputs of its matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and attention
  kernels (``scaled_dot_product_*``), through ``create_selective_checkpoint_contexts``:
  backward recomputes only the cheap ops between them (norms, activations, casts, views).
  This is torchtitan's "op" policy, except that torchtitan keeps every *other* ``mm``; all of
  them are kept here, so the policy is one decision per op, with no counter whose phase
  depends on how a block's ops are ordered, and the memory sits clearly between no
  checkpointing and full checkpointing (every kept output is one a plain backward keeps too).
  The policy runs as a dispatch mode, so the fake-tensor trace sees (and prices) exactly the
  tensors it keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch._ops import OpOverload
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .._errors import ConfigError

__all__ = ["find_block_stack", "apply_checkpointing", "max_checkpoint_segments", "select_blocks",
           "SAVED_OPS", "selective_policy", "block_policy"]

BlockFinder = Callable[[nn.Module], Sequence[nn.Module]]


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_stack(model: nn.Module, finder: BlockFinder | None = None) -> list[nn.Module]:
    """The blocks that checkpoint segments refer to, in execution order (may be empty)."""
    if finder is not None:
        return list(finder(model))
    best: list[nn.Module] = []
    best_params = 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        by_class: dict[type, list[nn.Module]] = {}
        for child in children:
            by_class.setdefault(type(child), []).append(child)
        for blocks in by_class.values():
            if len(blocks) < 2:
                continue
            params = sum(_n_params(b) for b in blocks)
            if params > best_params:
                best, best_params = blocks, params
    return best


def max_checkpoint_segments(model: nn.Module, finder: BlockFinder | None = None) -> int:
    return len(find_block_stack(model, finder))


def select_blocks(n_blocks: int, segments: int) -> list[int]:
    """Indices of the blocks to checkpoint: ``segments`` of ``n_blocks``, spread evenly."""
    if segments <= 0:
        return []
    if segments >= n_blocks:
        return list(range(n_blocks))
    # Evenly spaced, always including the first block (its activations are the largest when
    # sequence length or resolution shrinks through the stack).
    return sorted({(i * n_blocks) // segments for i in range(segments)})


def _ops(*names: str) -> frozenset[OpOverload]:
    # Overloads this torch build lacks (a CPU build has every one today) are left out.
    found: list[OpOverload] = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        for overload in ("default", "Tensor"):
            if packet is not None and hasattr(packet, overload):
                found.append(getattr(packet, overload))
    return frozenset(found)


SAVED_OPS: frozenset[OpOverload] = _ops(
    "mm", "addmm", "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)
"""The ops whose outputs a selectively checkpointed block keeps: the expensive ones."""


def selective_policy(ctx: SelectiveCheckpointContext, func: OpOverload, *args: object,
                     **kwargs: object) -> CheckpointPolicy:
    """The "op" policy: keep the outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_POLICIES: dict[str, Callable[..., CheckpointPolicy] | None] = {"full": None, "selective": selective_policy}


class _Checkpointed:
    """A block's checkpointed ``forward``: the original bound method, run under ``checkpoint``."""

    def __init__(self, original: Callable[..., object], policy: str) -> None:
        self.original = original
        self.policy = policy

    def __call__(self, *args: object, **kwargs: object) -> object:
        policy_fn = _POLICIES[self.policy]
        # The block's keyword arguments bound here, not passed through checkpoint's own
        # ``**kwargs``, where one named like its options (``debug``) would be taken for it;
        # the non-reentrant checkpoint calls (and recomputes) the function with them as is.
        forward = functools.partial(self.original, **kwargs) if kwargs else self.original
        if policy_fn is None:
            return checkpoint(forward, *args, use_reentrant=False)
        # A fresh pair of contexts per call: each holds the kept outputs of one forward.
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)


def block_policy(block: nn.Module) -> str | None:
    """How ``block`` is checkpointed: ``"full"``, ``"selective"``, or None (not at all)."""
    forward = block.__dict__.get("forward")
    return forward.policy if isinstance(forward, _Checkpointed) else None


def apply_checkpointing(model: nn.Module, segments: int, finder: BlockFinder | None = None,
                        policy: str = "full") -> int:
    """Checkpoint ``segments`` blocks of the model's block stack in place; returns how many.

    ``policy`` is ``"full"`` or ``"selective"`` (see the module docstring). Applying it again
    is idempotent, and only ever recomputes more: a selective block asked to be full becomes
    full, a full one stays full (the OOM ladder only steps down in memory).
    Raises ``ConfigError`` when more segments are asked than the stack has blocks.
    """
    if policy not in _POLICIES:
        raise ConfigError(f"unknown checkpoint policy {policy!r}; use full or selective")
    if segments == 0:
        return 0
    blocks = find_block_stack(model, finder)
    if segments > len(blocks):
        raise ConfigError(
            f"checkpoint segments {segments} > the {len(blocks)} blocks found in the model's "
            f"block stack; use --checkpoint 0..{len(blocks)}"
            + ("" if blocks else " (define checkpoint_blocks(model) in the model file to name them)")
        )
    chosen = select_blocks(len(blocks), segments)
    for index in chosen:
        block = blocks[index]
        current = block.__dict__.get("forward")
        if isinstance(current, _Checkpointed):
            if current.policy == "selective" and policy == "full":
                current.policy = "full"
            continue
        block.forward = _Checkpointed(block.forward, policy)
    return len(chosen)
