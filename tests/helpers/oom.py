"""A test hook: ``torch.OutOfMemoryError`` before a chosen op, on any device.

Used by the tests only, so it does not ship in the package (the trainer's own guard is
armed with ``MemoryGuard.inject``).
"""

from __future__ import annotations

from estimators._errors import ConfigError
from estimators.runtime._injection import _Injection, _InjectionMode, pick_op

__all__ = ["OOMInjector"]


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
