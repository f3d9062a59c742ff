"""A memory budget for training on the CPU, enforced with a real ``torch.OutOfMemoryError``.

On a CUDA machine ``--vram`` is enforced by the caching allocator itself
(``torch.cuda.set_per_process_memory_fraction``). The CPU allocator has no such limit, so on
the CPU :class:`MemoryGuard` counts the bytes of live tensor storages and raises
``torch.OutOfMemoryError`` — the very exception class a CUDA OOM raises — as soon as an op
would take them over the budget. The trainer's OOM recovery, the probes and the tests then
handle a CPU OOM exactly as they would handle a GPU one.

How the CPU guard counts (the technique of ``estimators.tracing._recorder.Recorder``, kept minimal):

* a ``TorchDispatchMode`` sees every aten op that runs while the guard is active — forward,
  backward (the autograd engine runs CPU backward in the calling thread, with the mode
  stack), optimizer steps, factory functions such as ``torch.zeros``;
* each storage an op's outputs bring into being is counted once (keyed by its Python storage
  object, which PyTorch keeps alive exactly as long as the storage) and a ``weakref`` callback
  subtracts it when it dies. Outputs the op's schema marks as aliases of its inputs (views,
  in-place results) allocate nothing and are not counted — so a batch sliced out of a
  dataset tensor made before the guard costs nothing until it is copied —, but a counted
  storage an op resized in place (``resize_``, ``out=``) is re-measured;
* tensors that existed before the guard was entered (parameters, buffers, optimizer state,
  a batch) are counted only when the guard is told about them with :meth:`MemoryGuard.track`.

After an op has run, if the live bytes exceed the budget the guard drops its references to
the op's outputs (so they are freed as the exception unwinds) and raises
``torch.OutOfMemoryError``. The peak is not raised by the failed op, as on CUDA, where
``max_memory_allocated`` never counts the allocation that failed.

Overhead: one Python call per aten op, and it is PyTorch's Python-dispatch machinery that
costs, not the counting (a no-op ``TorchDispatchMode`` measured the same): tens of µs per op,
so small models' steps slow down most (``benchmarks/guard_overhead.py`` measures a small
MLP's step; figures in ``benchmarks/results/guard_overhead.md``).

Known limitations: kernel scratch memory that never becomes a tensor (oneDNN reorders, sort
buffers) is not counted — budgets should keep a margin, as the planner's does; tensors made
without an aten op (``torch.from_numpy``) count only when tracked; the counter is not
locked, so storages must be freed in the thread that runs the ops (true of CPU training; the
DataLoader's pin-memory thread creates tensors outside the mode, which are not counted).

Example:
    >>> import torch
    >>> from estimators.runtime._guard import MemoryGuard
    >>> with MemoryGuard(1_000_000) as guard:
    ...     a = torch.zeros(100_000)            # 400 kB: fits
    ...     try:
    ...         b = torch.zeros(200_000)        # 800 kB more: over the 1 MB budget
    ...     except torch.OutOfMemoryError:
    ...         print("OOM, live", guard.live_bytes)
    OOM, live 400000
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal, TypeAlias

import torch
import torch.nn as nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._errors import ConfigError
from .._units import format_size

__all__ = ["MemoryGuard"]

GuardDevice = Literal["cpu", "cuda"]

Trackable: TypeAlias = "torch.Tensor | nn.Module | torch.optim.Optimizer | Iterable[Trackable]"
"""What :meth:`MemoryGuard.track` counts: tensors, modules, optimizers, or iterables of them."""


def _op_name(func: OpOverload) -> str:
    try:
        return str(func._overloadpacket)
    except AttributeError:  # pragma: no cover - every aten op has one
        return str(func)


class _EagerMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` is not wrapped in ``torch._dynamo.disable``.

    The wrapper would import ``torch._dynamo`` on the first op (seconds on a small machine,
    paid by every probe process) and add a call layer to every op. Without it, a
    ``torch.compile``d function called under the mode still runs (eagerly, op by op).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def _out_tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        if all(isinstance(t, torch.Tensor) or t is None for t in out):
            return [t for t in out if t is not None]
        return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return []


_ALIASED: dict[OpOverload, bool | tuple[bool, ...]] = {}


def _aliased_returns(func: OpOverload) -> bool | tuple[bool, ...]:
    """Whether an op's returns alias its inputs (views ``Tensor(a)``, in-place ``Tensor(a!)``):
    True/False for all of them, else one flag per return."""
    try:
        flags = tuple(r.alias_info is not None for r in func._schema.returns)
    except AttributeError:
        return False
    if not flags or all(flags) == any(flags):
        return bool(flags) and flags[0]
    return flags


class _GuardMode(_EagerMode):
    """The dispatch mode of a CPU :class:`MemoryGuard`: count outputs, enforce the budget."""

    def __init__(self, guard: MemoryGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        g = self.guard
        t: torch.Tensor | None = None  # the last output counted (dropped before an OOM is raised)
        ret: object = None
        before = g._live
        out = func(*args, **(kwargs or {}))
        aliased = _ALIASED.get(func)
        if aliased is None:
            aliased = _ALIASED[func] = _aliased_returns(func)
        if aliased is True:  # views and in-place results: storages that already exist
            for t in _out_tensors(out):
                g._recount(t)
        elif aliased is False:
            for t in _out_tensors(out):
                g._count(t)
        else:  # a mix (rare): go return by return
            for ret, is_alias in zip(out if isinstance(out, (tuple, list)) else (out,), aliased):
                for t in _out_tensors(ret):
                    g._recount(t) if is_alias else g._count(t)
            ret = None
        t = None
        live = g._live
        if live > g._budget and live > before:
            # Drop this frame's references so that the outputs die as the error unwinds
            # (the traceback keeps this frame, and with it its locals, alive).
            del out
            raise torch.OutOfMemoryError(g._message(live - before, before, func))
        if live > g._peak:
            g._peak = live
        return out


class MemoryGuard:
    """Enforce ``budget_bytes`` of live tensor memory while the ``with`` block runs.

    Args:
        budget_bytes: The budget. Settable while active (``guard.budget_bytes = n``), e.g. by
            a trainer that lowers it to exercise OOM recovery.
        device: ``"cpu"``: a dispatch mode counts tensor storages (see the module docstring).
            ``"cuda"``: the caching allocator enforces it —
            ``torch.cuda.set_per_process_memory_fraction(budget / total_memory)`` on enter,
            ``1.0`` on exit; ``live_bytes``/``peak_bytes`` then read
            ``memory_allocated``/``max_memory_allocated`` (the limit itself applies to
            reserved memory, as PyTorch's does).

    Raises ``torch.OutOfMemoryError`` (a ``RuntimeError``) from the op that goes over.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1000, 1000)        # 4.00 MB of weights
        >>> guard = MemoryGuard(6_000_000)
        >>> guard.track(model)                         # counted from now on
        4004000
        >>> with guard:
        ...     y = model(torch.randn(10, 1000))
        >>> guard.live_bytes > 4_004_000, guard.peak_bytes <= 6_000_000
        (True, True)
    """

    def __init__(self, budget_bytes: int, *, device: GuardDevice | str = "cpu") -> None:
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"MemoryGuard supports device cpu or cuda, not {device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError("MemoryGuard(device='cuda') but no GPU is visible here; use device='cpu'")
        self.device = torch.device(device)
        self._budget = self._check_budget(budget_bytes)
        self._live = 0
        self._peak = 0
        self._entries: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._mode: TorchDispatchMode | None = None
        self._active = False

    # -- the budget ------------------------------------------------------------------------
    @staticmethod
    def _check_budget(value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"budget_bytes must be a whole number of bytes >= 0, got {value!r}")
        return value

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self._budget = self._check_budget(value)
        if self._active and self.device.type == "cuda":
            self._apply_cuda_fraction()

    # -- what is counted -------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        """Bytes of the live storages counted (cuda: ``torch.cuda.memory_allocated``)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self._live

    @property
    def peak_bytes(self) -> int:
        """Highest ``live_bytes`` since creation or :meth:`reset_peak`."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._peak

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = self._live

    def track(self, tensors: Trackable) -> int:
        """Count tensors that exist already; returns the bytes newly counted.

        Accepts tensors, a module (its parameters, buffers and existing gradients) or an
        optimizer (its state tensors), or an iterable of those. Storages shared by several
        tensors (tied weights, views) are counted once. A no-op on cuda (the allocator
        knows every tensor).
        """
        if self.device.type == "cuda":
            return 0
        added = 0
        for t in self._tensors_of(tensors):
            added += self._count(t)
        if self._live > self._peak:
            self._peak = self._live
        return added

    @classmethod
    def _tensors_of(cls, obj: Trackable) -> Iterable[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                yield obj.grad
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield value
        else:
            for item in obj:
                yield from cls._tensors_of(item)

    def _count(self, t: torch.Tensor) -> int:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            return 0  # sparse / nested / subclass tensors without one plain storage
        key = id(storage)
        entry = self._entries.get(key)
        if entry is not None:
            nbytes = storage.nbytes()
            if nbytes != entry[1]:  # resized in place
                self._live += nbytes - entry[1]
                self._entries[key] = (entry[0], nbytes)
                return nbytes - entry[1]
            return 0
        if t.is_meta:
            return 0
        nbytes = storage.nbytes()
        self._entries[key] = (weakref.ref(storage, self._on_release(key)), nbytes)
        self._live += nbytes
        return nbytes

    def _recount(self, t: torch.Tensor) -> None:
        """An op's aliased output: re-measure its storage if counted (``resize_`` and
        ``out=`` ops may grow it); a view of a storage the guard was never told about (a
        dataset tensor made before the guard) allocated nothing and is not counted."""
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            return
        entry = self._entries.get(id(storage))
        if entry is not None:
            nbytes = storage.nbytes()
            if nbytes != entry[1]:
                self._live += nbytes - entry[1]
                self._entries[id(storage)] = (entry[0], nbytes)

    def _on_release(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        # A closure per storage; it must not reference the storage itself.
        def released(_ref: weakref.ref[torch.UntypedStorage]) -> None:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._live -= entry[1]
        return released

    def _message(self, wanted: int, in_use: int, func: OpOverload) -> str:
        return (
            f"memplan memory guard: out of memory. Tried to allocate {format_size(wanted)} "
            f"({_op_name(func)}); {format_size(in_use)} of the {format_size(self._budget)} "
            "budget in use. Lower the micro-batch size, checkpoint more blocks or raise the budget."
        )

    # -- context -------------------------------------------------------------------------
    def __enter__(self) -> MemoryGuard:
        if self._active:
            raise RuntimeError("this MemoryGuard is already active; guards are not re-entrant")
        if self.device.type == "cuda":
            self._apply_cuda_fraction()
        else:
            self._mode = _GuardMode(self)
            self._mode.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            if self.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _apply_cuda_fraction(self) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, self._budget / total), self.device)

    def __repr__(self) -> str:
        return (f"MemoryGuard(budget={format_size(self._budget)}, live={format_size(self.live_bytes)}, "
                f"peak={format_size(self.peak_bytes)}, device={self.device.type!r})")
