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
  Every matrix product is kept, so the policy is one decision per op, with no counter whose
  phase depends on how a block's ops are ordered, and the memory sits clearly between no
  checkpointing and full checkpointing (every kept output is one a plain backward keeps too).
  The policy runs as a dispatch mode, so the fake-tensor trace sees (and prices) exactly the
  tensors it keeps.
* ``checkpoint_policy = "op"`` is torchtitan's selective "op" policy as its Llama recipes run
  it: a block keeps the outputs of its attention kernels, reduce-scatters and ``max`` and of
  every *other* ``aten.mm`` (the first, third, ... of each forward, counted per checkpointed
  call); ``addmm``, ``bmm`` and every second ``mm`` are recomputed. It keeps less than
  ``selective`` and more than ``full``. torch 2.13 replays the forward's decisions in the
  recomputation; a torch that asks the policy again there gets a counter of its own, as in
  torchtitan, so that both passes count alike.
* Recomputation changes no state. A block's forward may update buffers as a side effect
  (BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` in training mode;
  any module's in-place ``self.buf.add_(...)``); its recomputation in backward would update
  them a second time, so that checkpointing -- which the search and the OOM ladder switch on by
  themselves -- would change what the model learns. The checkpointed forward notes which of
  the block's modules changed a buffer (a buffer's version counter moved or the buffer was
  replaced; BatchNorm-style ``_NormBase`` modules in training mode always count: their kernels
  update the running statistics without bumping the version). The recomputation (the second
  context of ``context_fn``, entered only then) leaves them alone, also when it stops early or
  fails: torch's batch norms (``_BatchNorm``, ``SyncBatchNorm``) recompute with ``momentum =
  0.0`` -- the same kernel on the same tensors, which leaves the running statistics as they
  are, and allocates nothing, so that the trace's recomputed ops are still the plain
  forward's -- and their ``num_batches_tracked`` increment is taken back; other modules
  recompute on copies of their buffers, registered in their place while it runs (real
  allocations, made by the same code in the trace and in the trainer). Not under
  ``torch.compile``, where ``context_fn`` must be dispatch modes: there the checkpoint is the
  graph's higher-order op, and AOTAutograd's recomputation does not replay the buffer updates
  (they are graph outputs). A block that breaks the graph inside (a momentum-None batch norm's
  ``float(num_batches_tracked)``) falls back to an eager checkpoint chosen at trace time,
  which still updates twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import TypeGuard

import torch
import torch.nn as nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .._errors import ConfigError

__all__ = ["find_block_stack", "apply_checkpointing", "max_checkpoint_segments", "select_blocks",
           "SAVED_OPS", "OP_POLICY_SAVED", "selective_policy", "op_policy", "block_policy",
           "recomputes_more"]

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
    """The "selective" policy: keep the outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _functional(name: str) -> frozenset[OpOverload]:
    packet = getattr(getattr(torch.ops, "_c10d_functional", None), name, None)
    return frozenset([packet.default]) if packet is not None and hasattr(packet, "default") else frozenset()


_MM = torch.ops.aten.mm.default
OP_POLICY_SAVED: frozenset[OpOverload] = (
    _ops("mm", "max", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
         # The CPU's flash kernel: where a CUDA step runs the flash kernel, a CPU step runs this one.
         "_scaled_dot_product_flash_attention_for_cpu")
    | _functional("reduce_scatter_tensor")
)
"""torchtitan's save list of its "op" policy (``_op_sac_save_list``), with the CPU's flash kernel."""


def op_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh "op" policy (torchtitan's) for one checkpointed call: its ``mm`` counters start at
    zero, one for the forward and one for the recomputation."""
    counts = {False: 0, True: 0}

    def policy(ctx: SelectiveCheckpointContext, func: OpOverload, *args: object,
               **kwargs: object) -> CheckpointPolicy:
        if func == _MM:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_POLICY_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


PolicyFactory = Callable[[], Callable[..., CheckpointPolicy]]

_POLICIES: dict[str, PolicyFactory | None] = {
    "full": None, "selective": lambda: selective_policy, "op": op_policy,
}
"""Per policy name, what makes one checkpointed call's policy (None: keep only the inputs)."""

_RECOMPUTES = {"selective": 0, "op": 1, "full": 2}
"""How much each policy recomputes, in order: a block asked to recompute more does, never less."""

_BatchNorm = nn.modules.batchnorm._BatchNorm
_BATCH_NORM_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def _momentum_only(module: nn.Module) -> TypeGuard[_BatchNorm]:
    """A batch norm whose forward is torch's own and updates its running statistics in this
    call: with ``momentum = 0.0`` it leaves them as they are, and only ``num_batches_tracked``
    moves (``add_``, which bumps its version)."""
    return (isinstance(module, _BatchNorm) and type(module).forward in _BATCH_NORM_FORWARDS
            and module.training and module.track_running_stats)


class _BufferGuard:
    """One checkpointed call's buffer side effects: which of ``block``'s modules change buffers in
    its forward (:meth:`forward`), and a recomputation that leaves them alone (:meth:`recompute`,
    sequentially re-entrant: a graph kept for a second backward recomputes again)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.norms: list[_BatchNorm] = []
        """Batch norms (:func:`_momentum_only`): recomputed with ``momentum = 0.0``."""
        self.stateful: list[nn.Module] = []
        """The block's other modules that changed a buffer in the forward: recomputed on copies."""
        self._saved: list[tuple[list[tuple[nn.Module, str, torch.Tensor]],
                                list[tuple[_BatchNorm, float | None, torch.Tensor | None, int]]]] = []

    def forward(self) -> AbstractContextManager[None]:
        return _ForwardWatch(self)

    def recompute(self) -> AbstractContextManager[None]:
        return _Recompute(self)


class _ForwardWatch:
    def __init__(self, guard: _BufferGuard) -> None:
        self.guard = guard
        self.before: list[tuple[nn.Module, str, torch.Tensor, int]] = []

    def __enter__(self) -> None:
        self.before = [(m, name, b, b._version) for m in self.guard.block.modules()
                       for name, b in m._buffers.items() if b is not None]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        before, self.before = self.before, []
        if kind is not None:
            return  # a failed forward is never recomputed
        norms: dict[int, _BatchNorm] = {}
        changed: dict[int, nn.Module] = {}
        for module in self.guard.block.modules():
            if _momentum_only(module):
                norms[id(module)] = module
            elif isinstance(module, nn.modules.batchnorm._NormBase) and module.training and module.track_running_stats:
                # Their kernels update running_mean/var without bumping the version counter.
                changed[id(module)] = module
        for module, name, buf, version in before:
            if id(module) not in norms and (module._buffers.get(name) is not buf or buf._version != version):
                changed[id(module)] = module  # an in-place update, or a buffer replaced
        self.guard.norms, self.guard.stateful = list(norms.values()), list(changed.values())


class _Recompute:
    def __init__(self, guard: _BufferGuard) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        # Batch norms recompute with momentum 0: the same kernel, reading and writing the same
        # tensors (so the trace's recomputed ops are the plain forward's), and running
        # statistics multiplied by 1 plus 0 times the batch's. Other modules update copies of
        # their buffers, registered in their place; the buffers themselves are never touched,
        # and going back to them is an assignment, which nothing (an OOM, an early stop) can
        # interrupt.
        guard = self.guard
        slots = [(m, name, b) for m in guard.stateful for name, b in m._buffers.items() if b is not None]
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for _, _, b in slots:
                if id(b) not in copies:  # a buffer two modules share: one copy for both
                    copies[id(b)] = b.clone()
        for module, name, b in slots:  # only once every copy is made: an OOM above changes nothing
            module._buffers[name] = copies[id(b)]
        norms: list[tuple[_BatchNorm, float | None, torch.Tensor | None, int]] = []
        for m in guard.norms:
            counter = m._buffers.get("num_batches_tracked")
            norms.append((m, m.momentum, counter, counter._version if counter is not None else 0))
            m.momentum = 0.0
        guard._saved.append((slots, norms))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Also after an early stop (checkpoint ends a recomputation by raising once it has what
        # backward needs) or an error: the buffers are the forward's whatever happened.
        slots, norms = self.guard._saved.pop()
        for module, name, b in slots:
            module._buffers[name] = b
        for m, momentum, counter, version in norms:
            m.momentum = momentum
            if counter is not None and counter._version != version:
                # The recomputation's add_(1) taken back, with the dispatch modes off: an in-place
                # op on a scalar that allocates nothing, which no guard may fail or count.
                with _disable_current_modes(), torch.no_grad():
                    counter.sub_(counter._version - version)


class _Nested:
    """``outer`` then ``inner``, left in reverse order; sequentially re-entrant when both are."""

    def __init__(self, outer: AbstractContextManager[object], inner: AbstractContextManager[object]) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException as e:
            self.outer.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.inner.__exit__(kind, exc, tb)
        finally:
            self.outer.__exit__(kind, exc, tb)


def _contexts(block: nn.Module, factory: PolicyFactory | None
              ) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` of one checkpointed call: the buffer guard around the selective policy's
    pair of modes (outside them, so that the policy never sees the guard's copies)."""
    guard = _BufferGuard(block)
    if factory is None:
        forward, recompute = nullcontext(), nullcontext()
    else:  # a fresh pair per call: each holds the kept outputs of one forward (and its counters)
        forward, recompute = create_selective_checkpoint_contexts(factory())
    return _Nested(guard.forward(), forward), _Nested(guard.recompute(), recompute)


class _Checkpointed:
    """A block's checkpointed ``forward``: the original bound method, run under ``checkpoint``."""

    def __init__(self, original: Callable[..., object], policy: str, block: nn.Module) -> None:
        self.original = original
        self.policy = policy
        self.block = block

    def __call__(self, *args: object, **kwargs: object) -> object:
        factory = _POLICIES[self.policy]
        # The block's keyword arguments bound here, not passed through checkpoint's own
        # ``**kwargs``, where one named like its options (``debug``) would be taken for it;
        # the non-reentrant checkpoint calls (and recomputes) the function with them as is.
        forward = functools.partial(self.original, **kwargs) if kwargs else self.original
        if torch.compiler.is_compiling():
            # Compiled, the graph's recomputation does not replay buffer updates (they are graph
            # outputs), and context_fn must return dispatch modes: the policy's alone (see the
            # module docstring for a block that breaks the graph).
            if factory is None:
                return checkpoint(forward, *args, use_reentrant=False)
            return checkpoint(forward, *args, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(factory()))
        context_fn = functools.partial(_contexts, self.block, factory)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)


def recomputes_more(policy: str, than: str) -> bool:
    """Does a block checkpointed with ``policy`` recompute more (keep less) than with ``than``?"""
    return _RECOMPUTES[policy] > _RECOMPUTES[than]


def block_policy(block: nn.Module) -> str | None:
    """How ``block`` is checkpointed: ``"full"``, ``"selective"``, ``"op"``, or None (not at all)."""
    forward = block.__dict__.get("forward")
    return forward.policy if isinstance(forward, _Checkpointed) else None


def apply_checkpointing(model: nn.Module, segments: int, finder: BlockFinder | None = None,
                        policy: str = "full") -> int:
    """Checkpoint ``segments`` blocks of the model's block stack in place; returns how many.

    ``policy`` is ``"full"``, ``"selective"`` or ``"op"`` (see the module docstring). Applying
    it again is idempotent, and only ever recomputes more: a selective block asked to be full
    (or "op") becomes so, a full one stays full (the OOM ladder only steps down in memory).
    Raises ``ConfigError`` when more segments are asked than the stack has blocks.
    """
    if policy not in _POLICIES:
        raise ConfigError(f"unknown checkpoint policy {policy!r}; use {', '.join(_POLICIES)}")
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
            if recomputes_more(policy, current.policy):
                current.policy = policy
            continue
        block.forward = _Checkpointed(block.forward, policy, block)
    return len(chosen)
