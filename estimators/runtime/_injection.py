"""OOM injection: ``torch.OutOfMemoryError`` raised before a chosen op (recovery tests).

``MemoryGuard.inject`` arms it on the trainer's guard (the recovery tests and
``benchmarks/recovery.py`` drive OOM recovery with it); the tests' ``OOMInjector`` uses it on
its own. Also the dispatch-mode base both the guard and the injector run under.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from .._errors import ConfigError

__all__ = ["pick_op"]


def _in_backward() -> bool:
    """True while the autograd engine is running a backward node in this thread."""
    return torch._C._current_autograd_node() is not None


def _op_name(func: OpOverload) -> str:
    try:
        return str(func._overloadpacket)
    except AttributeError:  # pragma: no cover - every aten op has one
        return str(func)


class _Injection:
    """Counts ops and says when to fail (``MemoryGuard.inject``; the tests' ``OOMInjector``)."""

    __slots__ = ("after_ops", "phase", "times", "seen", "fired", "label")

    def __init__(self, after_ops: int, phase: str | None, times: int) -> None:
        if after_ops < 1:
            raise ConfigError(f"after_ops must be >= 1, got {after_ops}")
        self.after_ops = after_ops
        self.phase = phase
        self.times = times
        self.seen = 0
        self.fired = 0
        self.label = "forward"

    def current_phase(self) -> str:
        return "backward" if _in_backward() else self.label

    def check(self, func: OpOverload) -> None:
        if self.fired >= self.times:
            return
        if self.phase is not None and self.phase not in self.current_phase():
            return
        self.seen += 1
        if self.seen >= self.after_ops:
            self.fired += 1
            self.seen = 0
            raise torch.OutOfMemoryError(
                f"memplan OOM injector: out of memory (injected before op {self.after_ops} "
                f"{_op_name(func)}{' in ' + self.current_phase() if self.phase else ''})"
            )


def pick_op(seed: int, max_ops: int) -> int:
    return random.Random(seed).randint(1, max_ops)


class _EagerMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` is not wrapped in ``torch._dynamo.disable``.

    The wrapper would import ``torch._dynamo`` on the first op (seconds on a small machine,
    paid by every probe process) and add a call layer to every op. Without it, a
    ``torch.compile``d function called under the mode still runs (eagerly, op by op).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _InjectionMode(_EagerMode):
    """Raises the armed injection's OOM on any device (it counts nothing but ops): the
    guard's injector on cuda, where no counting mode runs."""

    def __init__(self, injection: _Injection) -> None:
        super().__init__()
        self._inj = injection

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        self._inj.check(func)
        return func(*args, **(kwargs or {}))
