"""OOM injection for the tests: ``torch.OutOfMemoryError`` raised before a chosen op.

* :class:`OOMInjector` -- a dispatch mode on its own, on any device (it counts nothing but ops).
* :class:`InjectingGuard` -- a :class:`~estimators.runtime._guard.MemoryGuard` that can also be
  armed to fail (``guard.inject(...)``): the recovery tests and ``benchmarks/recovery.py`` hand it
  to the trainer, which names the step's phase on it (``guard.phase = "optimizer"``).

Test code only: the package's guard raises an OOM when its budget is exceeded, never otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from estimators._errors import ConfigError
from estimators.runtime._guard import GuardDevice, MemoryGuard, _EagerMode, _op_name

__all__ = ["OOMInjector", "InjectingGuard", "pick_op"]


def _in_backward() -> bool:
    """True while the autograd engine is running a backward node in this thread."""
    return torch._C._current_autograd_node() is not None


class _Injection:
    """Counts ops and says when to fail (``InjectingGuard.inject``; ``OOMInjector``)."""

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


class _InjectionMode(_EagerMode):
    """Raises the armed injection's OOM before an op, on any device (none armed: a no-op)."""

    def __init__(self, injection: _Injection | None) -> None:
        super().__init__()
        self._inj = injection

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        if self._inj is not None:
            self._inj.check(func)
        return func(*args, **(kwargs or {}))


class OOMInjector(_InjectionMode):
    """Raises ``torch.OutOfMemoryError`` before the ``after_ops``-th op (a test hook).

    Works on any device (it allocates nothing and counts nothing but ops). ``phase``
    restricts counting to ops of one phase: ``"backward"`` is recognised by itself (ops run
    by the autograd engine); any other phase matches :attr:`phase_label`, which a training
    loop may set (``"forward"`` by default, e.g. ``"optimizer"``). With ``seed`` instead of
    ``after_ops`` the op is drawn uniformly from ``1..max_ops``, reproducibly. It fires
    ``times`` times (once by default: then recovery can proceed under the same injector).

    Example:
        >>> import torch
        >>> with OOMInjector(after_ops=2) as inj:
        ...     a = torch.ones(3)
        ...     try:
        ...         b = a + 1
        ...     except torch.OutOfMemoryError:
        ...         print("injected", inj.fired)
        injected 1
    """

    _inj: _Injection

    def __init__(self, after_ops: int | None = None, *, phase: str | None = None,
                 seed: int | None = None, max_ops: int = 200, times: int = 1) -> None:
        if after_ops is None:
            if seed is None:
                raise ConfigError("OOMInjector needs after_ops=N or seed=S (a random op in 1..max_ops)")
            after_ops = pick_op(seed, max_ops)
        super().__init__(_Injection(after_ops, phase, times))

    @property
    def after_ops(self) -> int:
        return self._inj.after_ops

    @property
    def fired(self) -> int:
        """How many OOMs were raised so far."""
        return self._inj.fired

    @property
    def phase_label(self) -> str:
        return self._inj.label

    @phase_label.setter
    def phase_label(self, label: str) -> None:
        self._inj.label = label


class InjectingGuard(MemoryGuard):
    """A :class:`MemoryGuard` (same budget, same counting) that :meth:`inject` arms to raise
    ``torch.OutOfMemoryError`` before a chosen op, as a real OOM would come.

    The injector is a dispatch mode of its own, entered above the guard's counting mode (on
    the CPU; on cuda, where the allocator enforces the budget, only when armed before the
    ``with``): it sees every op first, and an op it fails is never run nor counted.

    Example:
        >>> import torch
        >>> guard = InjectingGuard(10**9)
        >>> guard.inject(after_ops=2, phase="optimizer")
        >>> with guard:
        ...     a = torch.ones(3) + 1                # forward: not counted
        ...     guard.phase = "optimizer"
        ...     b = a.mul_(2)
        ...     try:
        ...         a.add_(1)
        ...     except torch.OutOfMemoryError:
        ...         print("injected", guard.injected)
        injected 1
    """

    def __init__(self, budget_bytes: int, *, device: GuardDevice | str = "cpu") -> None:
        super().__init__(budget_bytes, device=device)
        self._injection: _Injection | None = None
        self._phase_label = "forward"
        self._injector: _InjectionMode | None = None

    def inject(self, after_ops: int | None = None, phase: str | None = None, *,
               seed: int | None = None, max_ops: int = 200, times: int = 1) -> None:
        """Raise ``torch.OutOfMemoryError`` before the ``after_ops``-th op from now.

        ``phase="backward"`` counts only ops the autograd engine runs; other phases match
        :attr:`phase` (set it from the training loop: ``"forward"`` by default). ``seed``
        draws the op from ``1..max_ops`` reproducibly. ``after_ops=None`` without a seed
        disarms. On cuda, arm it before entering the guard.
        """
        if after_ops is None:
            if seed is None:
                self._arm(None)
                return
            after_ops = pick_op(seed, max_ops)
        if self.device.type == "cuda" and self._active and self._injector is None:
            raise ConfigError("on cuda, call guard.inject() before entering the guard")
        injection = _Injection(after_ops, phase, times)
        injection.label = self._phase_label
        self._arm(injection)

    def _arm(self, injection: _Injection | None) -> None:
        self._injection = injection
        if self._injector is not None:
            self._injector._inj = injection

    @property
    def injected(self) -> int:
        """How many injected OOMs were raised by the current :meth:`inject` arming."""
        return self._injection.fired if self._injection is not None else 0

    @property
    def phase(self) -> str:
        """The training loop's phase label (for ``inject(phase=...)``); backward is detected."""
        return self._phase_label

    @phase.setter
    def phase(self, label: str) -> None:
        self._phase_label = label
        if self._injection is not None:
            self._injection.label = label

    def __enter__(self) -> InjectingGuard:
        super().__enter__()
        if self.device.type != "cuda" or self._injection is not None:
            try:
                injector = _InjectionMode(self._injection)
                injector.__enter__()
            except BaseException:
                super().__exit__(None, None, None)
                raise
            self._injector = injector
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._injector is not None:
                self._injector.__exit__(*exc)
        finally:
            self._injector = None
            super().__exit__(*exc)
