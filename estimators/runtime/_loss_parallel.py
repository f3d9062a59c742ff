"""A language model's head split over its vocabulary, and its loss computed where the logits lie.

With tensor parallelism, a replicated head makes every rank compute the whole vocabulary's
logits (a Llama 3 70B micro-batch of 16 x 8192 tokens: ~32 GiB in bf16, and again in fp32 for
the loss) and hold the whole head's weight, gradient and optimizer states. Megatron-LM and
torchtitan split the head by its outputs (``ColwiseParallel`` with the logits left sharded on
the vocabulary) and compute the cross entropy on the shards (``loss_parallel``: each rank's
log-softmax all-reduces a max and a sum per position; its loss one scalar), so that no rank
ever holds the whole logits.

The head is the one ``nn.Linear`` outside the block stack whose outputs number an embedding's
rows (the vocabulary), and the model's last module. It is not split when its weight is the embedding's (tied; the embedding
stays replicated), when ``tp`` does not divide the vocabulary, or when no such linear is found.

The logits stay sharded only inside :func:`sharded_loss`, which the training step enters
around the forward, the default loss and the backward of a micro-batch (``loss_parallel``
needs the backward inside it too) when the task's loss is the default cross entropy without
label smoothing (``loss_parallel`` does not smooth). Everywhere else (evaluation, a model
file's own loss, a smoothed loss, a forward outside the step) the head's output is gathered
into a whole plain tensor, as a replicated head gives: the split weight still saves its
states.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ._checkpoint import BlockFinder, find_block_stack

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["find_head", "split_head", "sharded_loss", "has_split_head", "local_loss"]

_SPLIT: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""Each model whose head was split -> the head's name."""

_KEEP_SHARDED: ContextVar[bool] = ContextVar("keep_sharded_logits", default=False)


def find_head(model: nn.Module, tp: int, *, split: set[str], finder: BlockFinder | None = None
              ) -> tuple[str | None, str | None]:
    """``(name, None)``: the head to split over ``tp`` ranks; ``(None, why)``: none is split,
    and why (None where the model has no head to speak of). ``split``: the block linears the
    plan splits already."""
    inside = {id(m) for block in find_block_stack(model, finder) for m in block.modules()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    rows = {e.num_embeddings for e in embeddings}
    heads = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name not in split and id(m) not in inside and m.out_features in rows]
    if len(heads) != 1:
        return None, (None if not heads else
                      f"the head is not split: {len(heads)} linears ({', '.join(n for n, _ in heads)}) have an "
                      "embedding's rows as outputs")
    name, head = heads[0]
    # Inside the step the logits stay sharded from the head to the loss: a head whose output
    # went on through other modules would hand them shards they take for whole tensors. The
    # model's last module is the one whose output is the model's (nanoGPT's lm_head,
    # torchtitan's output, a Hugging Face model's lm_head).
    children = [n for n, _ in model.named_children()]
    if not children or children[-1] != name:
        return None, f"the head ({name}) is not split: it is not the model's last module, whose output is the logits"
    if any(head.weight is e.weight for e in embeddings):
        return None, f"the head ({name}) is not split: its weight is the embedding's (tied), which stays replicated"
    if head.out_features % tp:
        return None, (f"the head ({name}) is not split: its {head.out_features} outputs are not divisible by "
                      f"tp {tp}; pad the vocabulary to a multiple of tp to split it")
    return name, None


def split_head(model: nn.Module, mesh: DeviceMesh, name: str) -> None:
    """Split ``model``'s head ``name`` by its outputs over the 1-D ``mesh`` (in place)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, mesh, {name: ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                           use_local_output=False)})
    model.get_submodule(name).register_forward_hook(_gathered_unless_kept)
    _SPLIT[model] = name


def has_split_head(model: nn.Module) -> bool:
    return model in _SPLIT


def _gathered_unless_kept(_module: nn.Module, _args: object, output: object) -> object:
    from torch.distributed.tensor import DTensor, Replicate

    if _KEEP_SHARDED.get() or not isinstance(output, DTensor):
        return None
    return output.redistribute(output.device_mesh, [Replicate()] * output.device_mesh.ndim).to_local()


@contextlib.contextmanager
def sharded_loss(enabled: bool) -> Iterator[None]:
    """Within the block (``enabled``), a split head's logits stay sharded on the vocabulary and
    the cross entropy runs on the shards (``loss_parallel``); forward, loss and backward must
    all run inside it."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    token = _KEEP_SHARDED.set(True)
    # Left by an exception (an OOM the trainer recovers from), loss_parallel's generator would
    # keep its loss ops installed: its exit is run as after a normal end, whatever happens.
    ops = loss_parallel()
    ops.__enter__()
    try:
        yield
    finally:
        ops.__exit__(None, None, None)
        _KEEP_SHARDED.reset(token)


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss ``loss_parallel`` gives (a replicated DTensor) as a plain tensor, its backward
    still through the shards: the step's scaler and running sums take plain tensors."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss
