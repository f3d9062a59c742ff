"""``MemplanCallback``: a Lightning ``Trainer`` set to the plan's batch, checked and reported.

At ``setup`` (fit only) it sets the batch size where Lightning's own ``BatchSizeFinder`` sets
it (``lightning_setattr``: the LightningModule's attribute or hparams, and the datamodule's) and
``trainer.accumulate_grad_batches``, for the Trainer's world size: micro-batch x accumulation x
processes is the plan's global batch. Another world size than the plan's keeps the micro-batch
and recomputes the accumulation when the global batch divides; else it raises. At
``on_train_start`` it checks that the training dataloader was built with that batch size (one
passed straight to ``fit`` cannot be changed by a callback).

During training it times each optimizer step (its micro-batches, ``on_train_batch_start`` of
the first to ``on_train_batch_end`` of the last) and logs through ``pl_module.log_dict``, so
every logger of the Trainer records them at its ``log_every_n_steps``: the keys of
``memplan.integrations.hf.MemplanCallback`` -- ``memplan/predicted_peak_bytes``,
``memplan/predicted_step_s`` (when the run is the plan's choice), ``memplan/measured_step_s``
(the median step so far), on CUDA ``memplan/measured_peak_bytes`` (``max_memory_allocated``
since training began) and the reserved figures, elsewhere ``memplan/measured_max_rss_bytes``
(the process's peak resident memory, not the figure the plan predicts) or nothing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

from estimators import ConfigError, Estimate

from ...planning import Plan
from .._requires import require

_WHAT = "memplan.integrations.lightning.MemplanCallback"
pl: Any = require("lightning.pytorch", "lightning", _WHAT)
# The helpers the batch size finder (lightning.pytorch.tuner.batch_size_scaling) sets the size with.
_parsing: Any = require("lightning.pytorch.utilities.parsing", "lightning", _WHAT)
_rank_zero: Any = require("lightning.pytorch.utilities.rank_zero", "lightning", _WHAT)

__all__ = ["MemplanCallback"]

PREFIX = "memplan/"


def _max_rss_bytes() -> int | None:
    """The process's peak resident set size, or None where the platform does not report it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak <= 0:
        return None
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class MemplanCallback(pl.Callback):
    """Sets a Lightning ``Trainer``'s batch size and gradient accumulation from the plan and
    logs the plan's predictions beside the measured step time and peak memory (``memplan/``).

    ``plan``: a :class:`~memplan.planning.Plan` or the path of a ``plan.json``;
    ``batch_arg_name``: the attribute the dataloaders read the batch size from, as for
    Lightning's ``BatchSizeFinder``. ``Trainer(**trainer_kwargs(plan), callbacks=[MemplanCallback(plan)])``.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str], *, batch_arg_name: str = "batch_size") -> None:
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        self.batch_arg_name = batch_arg_name
        self.micro_batch_size: int | None = None
        """The micro-batch set at ``setup`` (None before)."""
        self.grad_accum_steps: int | None = None
        """The accumulation set at ``setup`` (None before)."""
        self.step_times: list[float] = []
        """Seconds of each optimizer step timed in this run."""
        self._predicted: Estimate | None = None
        self._device: torch.device | None = None
        self._start: float | None = None
        self._start_step = 0

    @property
    def global_batch(self) -> int:
        """The global batch the plan trains (its fixed one, else its choice's)."""
        plan = self.plan
        return plan.global_batch if plan.global_batch is not None else plan.config.global_batch

    def layout(self, world_size: int) -> tuple[int, int]:
        """The micro-batch and accumulation that make the plan's global batch over
        ``world_size`` processes: the plan's own on its world size; else its micro-batch (what
        the memory figure is for) with the accumulation that keeps the global batch."""
        c = self.plan.config
        if world_size == c.world_size:
            return c.micro_batch_size, c.grad_accum_steps
        per_step = c.micro_batch_size * world_size
        if self.global_batch % per_step:
            raise ConfigError(
                f"the plan's global batch of {self.global_batch} is not a whole number of micro-batches of "
                f"{c.micro_batch_size} over the Trainer's {world_size} processes; run it on the plan's "
                f"{c.world_size} (devices x num_nodes), or plan for {world_size}: memplan plan MODEL.py --gpus N --nodes M")
        return c.micro_batch_size, self.global_batch // per_step

    # -- the plan set on the Trainer -------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if stage != "fit":
            return
        world = int(trainer.world_size)
        micro, accum = self.layout(world)
        name = self.batch_arg_name
        if not _parsing.lightning_hasattr(pl_module, name):
            raise ConfigError(
                f"{type(pl_module).__name__} has no {name!r} to set the plan's micro-batch of {micro} on (nor its "
                f"hparams, nor the datamodule); give the LightningModule or LightningDataModule a {name} attribute "
                f"its train_dataloader builds the DataLoader with, or name it: MemplanCallback(plan, batch_arg_name=...)")
        if accum > 1 and not pl_module.automatic_optimization:
            raise ConfigError(
                f"the plan accumulates {accum} micro-batches, which Lightning does only with automatic optimization; "
                f"set automatic_optimization = True in {type(pl_module).__name__}, or plan with accumulation 1")
        _parsing.lightning_setattr(pl_module, name, micro)
        trainer.accumulate_grad_batches = accum
        self.micro_batch_size, self.grad_accum_steps = micro, accum
        c = self.plan.config
        if (micro, accum, world) == (c.micro_batch_size, c.grad_accum_steps, c.world_size):
            self._predicted = self.plan.best.predicted
        else:
            # The same global batch reached another way: the plan's figures are another
            # configuration's, and logging them beside this run's would compare unlike things.
            self._predicted = None
            _rank_zero.rank_zero_warn(
                f"the Trainer runs {world} processes, not the plan's {c.world_size}: micro-batch {micro} x {accum} "
                f"accumulation keeps the global batch of {self.global_batch}, and memplan/ logs no predictions for it")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        size = getattr(loader, "batch_size", None)
        if (self.micro_batch_size is not None and isinstance(loader, torch.utils.data.DataLoader)
                and size is not None and size != self.micro_batch_size):
            raise ConfigError(
                f"the training DataLoader has batch_size {size}, not the plan's micro-batch of {self.micro_batch_size}: "
                f"it was built without {self.batch_arg_name!r} (a DataLoader passed to fit cannot be changed); build it "
                f"in train_dataloader() with batch_size=self.{self.batch_arg_name}")
        self.step_times.clear()
        device = pl_module.device
        self._device = device if device.type == "cuda" else None
        if self._device is not None:
            # The training's peak, not model loading's or an earlier run's in this process.
            torch.cuda.reset_peak_memory_stats(self._device)

    # -- measurements --------------------------------------------------------------------------
    def _sync(self) -> None:
        # CUDA runs asynchronously: without waiting, the step's end would time the launches, and
        # its kernels would count in whichever later step waits for them.
        if self._device is not None:
            torch.cuda.synchronize(self._device)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._start is None:  # the first micro-batch of an optimizer step
            self._sync()
            self._start, self._start_step = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._start is None or trainer.global_step == self._start_step:
            return  # accumulating: the optimizer has not stepped yet
        self._sync()
        self.step_times.append(time.perf_counter() - self._start)
        self._start = None
        # on_step only: Lightning writes them at its log_every_n_steps, to every logger.
        pl_module.log_dict(self.figures(), on_step=True, on_epoch=False, prog_bar=False, logger=True,
                           batch_size=self.micro_batch_size)

    def figures(self) -> dict[str, float]:
        """The ``memplan/`` keys of a log now: the predictions (when the run is the plan's
        choice), the median step so far, and the peak memory where it can be read."""
        out: dict[str, float] = {}
        predicted = self._predicted
        if predicted is not None:
            out["predicted_peak_bytes"] = predicted.peak_allocated_bytes
            if predicted.step_time_s is not None:
                out["predicted_step_s"] = predicted.step_time_s
        if self.step_times:
            out["measured_step_s"] = statistics.median(self.step_times)
        if self._device is not None:
            out["measured_peak_bytes"] = torch.cuda.max_memory_allocated(self._device)
            if predicted is not None and predicted.peak_reserved_bytes is not None:
                out["predicted_reserved_bytes"] = predicted.peak_reserved_bytes
            out["measured_reserved_bytes"] = torch.cuda.max_memory_reserved(self._device)
        else:
            rss = _max_rss_bytes()
            if rss is not None:
                out["measured_max_rss_bytes"] = rss
        return {PREFIX + k: v for k, v in out.items()}
