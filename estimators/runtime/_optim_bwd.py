"""The optimizer step in backward (torchtune's ``optimizer_in_bwd``).

Each parameter gets its own optimizer, of the task's optimizer's class and with its parameter
group's settings (learning rate, weight decay, betas, ...), stepped in a post-accumulate-grad
hook as soon as backward has produced the parameter's gradient; the gradient is freed right
after. No moment of the step then holds every gradient: the peak loses up to the gradients'
size (a model's worth of fp32 bytes), which is the whole point.

What it excludes, and why (:func:`check_compatible`): gradient accumulation (a parameter is
stepped in every backward), clipping by the global norm (it needs every gradient first), the
fp16 GradScaler (it unscales and checks all gradients for inf/NaN before any step) and data
parallelism (DDP reduces gradients after the hook fires; FSDP2 hands the sharded parameter
its gradient outside autograd's accumulation). Clipping by value is per element, so the hook
clamps each gradient before its step: exact.

:class:`OptimizerInBackward` looks like one optimizer to the rest of the step and to the
trainer (``param_groups``, ``state``, ``state_dict()``, ``load_state_dict()``,
``zero_grad()``; ``step()`` does nothing: the hooks stepped already), as torchtune's
``OptimizerInBackwardWrapper``; a learning-rate schedule built on it reaches every
per-parameter optimizer, since its ``param_groups`` are theirs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.optim.optimizer import StateDict

from .._config import TrainConfig
from .._errors import ConfigError
from .._step_options import StepOptions

__all__ = ["OptimizerInBackward", "check_compatible", "ParamStepObserver"]


class ParamStepObserver(Protocol):
    """What sees each parameter's gradient before its step (the trace marks it a gradient;
    the optimizer state is marked after backward, through ``OptimizerInBackward.state``)."""

    def gradient_ready(self, param: torch.Tensor) -> None: ...


def check_compatible(config: TrainConfig, options: StepOptions) -> None:
    """Raise :class:`ConfigError` when the step's ``options`` exclude ``config``'s step in backward.

    What the configuration alone excludes (accumulation, fp16-mixed, data parallelism)
    ``TrainConfig`` refuses itself.
    """
    if config.optimizer_in_backward and options.clip == "norm":
        raise ConfigError(
            "optimizer_in_backward cannot clip by the global gradient norm (it needs every gradient "
            "before any step); clip by value (grad_clip_mode='value'), turn clipping off, or set "
            "optimizer_in_backward=False"
        )


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped in its parameter's post-accumulate-grad hook.

    ``optimizer`` is the task's optimizer over the model's parameters: its class, its
    ``defaults`` and each parameter group's settings make the per-parameter optimizers (it is
    not used afterwards and holds no state yet). ``clip_value`` clamps each gradient to
    ``[-clip_value, clip_value]`` before its step.

    >>> model = nn.Linear(4, 2)
    >>> opt = OptimizerInBackward(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    >>> model(torch.ones(3, 4)).sum().backward()  # steps both parameters, frees their gradients
    >>> model.weight.grad is None, len(opt.state)
    (True, 2)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *, clip_value: float | None = None) -> None:
        # Optimizer.__init__ would copy the groups: these must be the per-parameter optimizers'
        # own, so that a schedule setting group["lr"] reaches them.
        self.defaults = dict(optimizer.defaults)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        names = {p: n for n, p in model.named_parameters()}
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.names: dict[torch.Tensor, str] = {}
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.optimizers[p] = _one_parameter_optimizer(type(optimizer), p, settings, optimizer.defaults)
                self.names[p] = names.get(p, f"param{len(self.names)}")
        self.clip_value = clip_value
        self.observer: ParamStepObserver | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self.optimizers]

    # the hook --------------------------------------------------------------------------
    def _step_parameter(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if self.clip_value is not None:
            param.grad.clamp_(-self.clip_value, self.clip_value)  # clip_grad_value_, one tensor
        optimizer = self.optimizers[param]
        if self.observer is not None:
            self.observer.gradient_ready(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradient is dead now: free it before the next one

    @contextlib.contextmanager
    def observed(self, observer: ParamStepObserver | None) -> Iterator[None]:
        """``observer`` sees each parameter's step while the block runs (one step's backward)."""
        previous, self.observer = self.observer, observer
        try:
            yield
        finally:
            self.observer = previous

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # one optimizer, to the trainer -----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: object) -> None:
        raise AttributeError("OptimizerInBackward's param_groups are its per-parameter optimizers'; "
                             "set values inside the groups instead")

    # A view of the per-parameter optimizers' states, rebuilt on each read: a plain dict, where
    # torch declares the defaultdict an optimizer's own state is.
    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    @state.setter
    def state(self, value: object) -> None:
        raise AttributeError("OptimizerInBackward's state is its per-parameter optimizers'")

    # Never calls a closure, so never returns its loss (torch's overload for one returns a float).
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing to do: every parameter was stepped in backward. Kept so that a schedule's
        check that the optimizer stepped before it holds."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> StateDict:
        return {"optimizer_in_backward": {self.names[p]: opt.state_dict() for p, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: StateDict) -> None:
        per_param = state_dict.get("optimizer_in_backward") if isinstance(state_dict, dict) else None
        if per_param is None:
            raise ConfigError("this optimizer state is not optimizer_in_backward's (per-parameter states); "
                              "resume with the configuration that wrote it")
        missing = sorted(set(self.names.values()) - set(per_param))
        if missing:
            raise ConfigError(f"optimizer_in_backward state lacks parameters {missing[:3]}; "
                              "resume with the model that wrote it")
        for p, opt in self.optimizers.items():
            opt.load_state_dict(per_param[self.names[p]])

    def __repr__(self) -> str:
        first = next(iter(self.optimizers.values()))
        return f"OptimizerInBackward({type(first).__name__} x{len(self.optimizers)})"


def _one_parameter_optimizer(cls: type[torch.optim.Optimizer], param: torch.Tensor, settings: dict[str, Any],
                             defaults: dict[str, Any]) -> torch.optim.Optimizer:
    # The group carries every setting; the constructor gets the defaults it accepts by name
    # (AdamW's defaults hold decoupled_weight_decay, which its constructor does not take).
    accepted: Mapping[str, inspect.Parameter]
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    try:
        return cls([{**settings, "params": [param]}], **kwargs)
    except Exception as exc:  # noqa: BLE001 - any constructor failure gets the same advice
        raise ConfigError(
            f"optimizer_in_backward builds one {cls.__name__} per parameter as {cls.__name__}(param_groups, "
            f"**defaults), which failed ({type(exc).__name__}: {exc}); use a torch.optim optimizer or "
            "optimizer_in_backward=False"
        ) from exc
