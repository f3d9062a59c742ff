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
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .._errors import ConfigError

__all__ = ["find_block_stack", "apply_checkpointing", "max_checkpoint_segments", "select_blocks"]

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


def _checkpointed_forward(original: Callable, *args: object, **kwargs: object) -> object:
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, segments: int, finder: BlockFinder | None = None) -> int:
    """Checkpoint ``segments`` blocks of the model's block stack in place; returns how many.

    Raises ``ConfigError`` when more segments are asked than the stack has blocks.
    """
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
        if "forward" in block.__dict__:  # already checkpointed (idempotent)
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward)  # type: ignore[method-assign]
    return len(chosen)
