"""The one builder of a model for training: the trace, the probes and the trainer call it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._config import TrainConfig
from .._errors import ConfigError
from . import _checkpoint, _parallel, _pipeline, _precision

if TYPE_CHECKING:
    from ..task._task import Task

__all__ = ["BuiltModel", "build_for_training", "checkpoint_more"]


@dataclass
class BuiltModel:
    model: nn.Module
    """The user's module (FSDP2 shards it in place): state dicts, clipping, EMA and evaluation use it."""
    wrapped: nn.Module
    """What the strategy made of it: DDP's wrapper, the FSDP2 module, or the module itself."""
    forward_model: nn.Module
    """What the training forward calls: ``wrapped``, compiled when asked."""
    compiled: bool = False


def build_for_training(task: Task, config: TrainConfig, device: torch.device | str, *,
                       model: nn.Module | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
                       compile: bool = False, device_ids: list[int] | None = None) -> BuiltModel:
    """The task's model on ``device``, in train mode, checkpointed and wrapped as ``config`` says.

    The order is the trainer's: build (a copy of a prebuilt module), cast to a true low
    precision (``bf16-true``: before the move, so that the device never holds the fp32
    copy), move, checkpoint the blocks, then DDP/FSDP2 (after checkpointing, as traced), then
    compile the wrapper (so that state dicts, taken from the plain module, keep their names). ``model`` passes a
    module built elsewhere (the trace's fake copy); ``wrap`` replaces the strategy's wrapping
    (the trace's simulated ranks).
    """
    if model is None:
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
        # Offloaded, the model stays on the CPU: FSDP2 moves what the device needs, unit by unit.
        model = _precision.cast_model(model, config.precision)
        if not config.cpu_offload:
            model = model.to(device)
    else:
        _precision.cast_model(model, config.precision)
    model.train()
    if config.pp > 1:
        # Cut into stages, each checkpointed on its own (the cut traces through a checkpoint).
        _check_pipelined(task, config, compile)
        wrapped = wrap(model) if wrap is not None else _pipelined(task, config, model, device)
        return BuiltModel(_parallel.unwrap(wrapped), wrapped, wrapped)
    _checkpoint.apply_checkpointing(model, config.checkpoint_segments, task.checkpoint_blocks,
                                    policy=config.checkpoint_policy)
    if wrap is not None:
        wrapped = wrap(model)
    else:
        wrapped = _parallel.parallelize(model, config, finder=task.checkpoint_blocks, device_ids=device_ids,
                                        device=device, tp_hook=task.tp_plan)
    # torch.compile of a module returns an OptimizedModule (an nn.Module); its stubs say only
    # that it returns a callable of the module's call signature.
    forward: nn.Module = torch.compile(wrapped) if compile else wrapped  # type: ignore[assignment]
    return BuiltModel(_parallel.unwrap(wrapped), wrapped, forward, compiled=compile)


def _check_pipelined(task: Task, config: TrainConfig, compile: bool) -> None:
    from ..task._task import default_loss

    if task.loss_fn is not default_loss:
        raise ConfigError(f"{task.name}: pipeline stages run the default loss on the last stage's output, and the "
                          "model file defines loss(model, batch), which needs the whole model; use pp=1")
    if compile:
        raise ConfigError("torch.compile is not applied to pipeline stages; use pp=1 or compile off")


def _pipelined(task: Task, config: TrainConfig, model: nn.Module, device: torch.device | str) -> nn.Module:
    """This process's stages of ``model``, on a real process group of ``config.pp`` ranks (the
    default one: a pipeline alone)."""
    import torch.distributed as dist

    example = _pipeline.pipeline_inputs(task.real_batch(config.micro_batch_size))
    piped = _pipeline.build_pipeline(model, config, example, finder=task.checkpoint_blocks,
                                     device=torch.device(device), rank=dist.get_rank())
    piped.label_smoothing = task.step.label_smoothing
    return piped


def checkpoint_more(built: BuiltModel, task: Task, segments: int, policy: str = "full") -> BuiltModel:
    """Checkpoint ``segments`` blocks of a running model (an OOM ladder's rung needs more).

    Idempotent per block: blocks checkpointed already stay so, and selective ones become full
    when ``policy`` is full (a ladder only steps down). A compiled forward is compiled again
    from the same wrapper as at setup.
    """
    _checkpoint.apply_checkpointing(built.model, segments, task.checkpoint_blocks, policy=policy)
    if built.compiled:
        built.forward_model = torch.compile(built.wrapped)  # type: ignore[assignment]  # an nn.Module, as above
    return built
