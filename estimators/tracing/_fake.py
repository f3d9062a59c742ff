"""A fake copy of the task's model: the same structure, shapes, dtypes and tied weights, no memory."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._errors import MemplanError
from ..task._task import Task

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["build_fake_model", "fake_mode", "quiet_fake_tensor_log"]


def fake_mode() -> FakeTensorMode:
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback ("failed while attempting to run meta for ...") for
    every op whose meta kernel raises, before raising it: the trace reports that error in one
    line of its own, so the log would only put the traceback on the user's screen twice."""
    import logging
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_copy(module: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of a real module whose parameters and buffers are fake (ties kept)."""
    memo: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in module.buffers():
        if id(b) not in memo:
            memo[id(b)] = mode.from_tensor(b)
    return copy.deepcopy(module, memo)


def build_fake_model(task: Task, mode: FakeTensorMode,
                     shape: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """The task's model with fake CPU parameters: built on meta where it can be, so that a
    billion-parameter model costs no real memory; else built for real and copied.

    ``shape`` changes the module tree before its tensors are made (a cut block stack: the
    blocks it drops are never made); it is applied to the copy of a module built for real."""
    if task.prebuilt is not None:
        model = _fake_copy(task.prebuilt, mode)
        if shape is not None:
            shape(model)
        return model
    try:
        with torch.device("meta"):
            model = task.build_model()
        if shape is not None:
            shape(model)
        ties = _shared_tensors(model)
        with mode:
            model.to_empty(device="cpu")
        _retie(ties)
        if any(t.device.type == "meta" for t in _plain_tensor_attrs(model)):
            raise RuntimeError("plain tensor attributes left on meta")
        return model
    except MemplanError:
        raise
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; build for real
        real = task.build_model()
        model = _fake_copy(real, mode)
        if shape is not None:
            shape(model)
        return model


def _shared_tensors(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Parameters and buffers held under several names (tied embeddings and heads)."""
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(module, kind).items():
                if value is not None:
                    holders.setdefault(id(value), []).append((module, kind, name))
    return [refs for refs in holders.values() if len(refs) > 1]


def _retie(ties: list[list[tuple[nn.Module, str, str]]]) -> None:
    # ``to_empty`` may give each holder of a tied tensor its own new tensor; tie them again
    # so the trace sees one parameter, one gradient and one optimizer state, as training does.
    for refs in ties:
        module, kind, name = refs[0]
        shared = getattr(module, kind)[name]
        for other, other_kind, other_name in refs[1:]:
            getattr(other, other_kind)[other_name] = shared


def _plain_tensor_attrs(model: nn.Module) -> Iterator[torch.Tensor]:
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value


# -- the traced step ---------------------------------------------------------------------
