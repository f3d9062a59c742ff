"""``MemplanCallback``: the plan checked and reported inside a Hugging Face ``Trainer``.

At ``on_train_begin`` it holds the Trainer's global batch (``per_device_train_batch_size`` x
``gradient_accumulation_steps`` x processes) to the plan's and raises when they differ. During
training it times each optimizer step (``on_step_begin`` to ``on_step_end``) and reads the peak
memory, and adds the plan's predictions beside the measurements to every training log under
``memplan/``, so that the reporters of ``report_to`` (TensorBoard, W&B, ...) record them; the
Trainer's reporters prefix them as its other training figures (TensorBoard: ``train/memplan/...``).

Keys: ``memplan/predicted_peak_bytes`` and ``memplan/predicted_step_s`` (the plan's choice's
prediction, when the run is that configuration); ``memplan/measured_step_s`` (the median step
so far); on CUDA ``memplan/measured_peak_bytes`` (``torch.cuda.max_memory_allocated`` since
training began, the figure ``Estimate.peak_allocated_bytes`` predicts) with
``memplan/predicted_reserved_bytes`` and ``memplan/measured_reserved_bytes``; elsewhere
``memplan/measured_max_rss_bytes``, the process's peak resident memory (interpreter and
libraries included: not the figure the plan predicts, hence its own name), or nothing where the
platform cannot say.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from typing import Any

import torch

from estimators import ConfigError, Estimate

from ...planning import Plan
from .._requires import require

transformers: Any = require("transformers", "hf", "memplan.integrations.hf.MemplanCallback")

__all__ = ["MemplanCallback"]

log = logging.getLogger(__name__)

PREFIX = "memplan/"


def _load(plan: Plan | str | os.PathLike[str]) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


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


class MemplanCallback(transformers.TrainerCallback):
    """Checks that a ``Trainer`` runs the plan's global batch and logs the plan's predictions
    beside the measured step time and peak memory (``memplan/...`` keys) to its reporters.

    ``plan``: a :class:`~memplan.planning.Plan` or the path of a ``plan.json``. Build the
    ``TrainingArguments`` with ``memplan.integrations.hf.training_args(plan)``; then
    ``Trainer(..., callbacks=[MemplanCallback(plan)])``.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str]) -> None:
        self.plan = _load(plan)
        self.step_times: list[float] = []
        """Seconds of each optimizer step timed in this run."""
        self._predicted: Estimate | None = None
        self._step_start: float | None = None
        self._device: torch.device | None = None

    # -- the plan against the Trainer's arguments --------------------------------------------
    @property
    def global_batch(self) -> int:
        """The global batch the plan trains (its fixed one, else its choice's)."""
        plan = self.plan
        return plan.global_batch if plan.global_batch is not None else plan.config.global_batch

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        micro, accum, world = int(args.train_batch_size), int(args.gradient_accumulation_steps), int(args.world_size)
        got = micro * accum * world
        if got != self.global_batch:
            raise ConfigError(
                f"the Trainer's global batch is {got} (per_device_train_batch_size {args.per_device_train_batch_size}"
                f"{f' x {args.n_gpu} GPUs' if micro != args.per_device_train_batch_size else ''} x "
                f"gradient_accumulation_steps {accum} x {world} process{'es' if world != 1 else ''}), not the plan's "
                f"global batch of {self.global_batch}; build the TrainingArguments with "
                "memplan.integrations.hf.training_args(plan)")
        c = self.plan.config
        if (micro, accum, world) == (c.micro_batch_size, c.grad_accum_steps, c.world_size):
            self._predicted = self.plan.best.predicted
        else:
            # The same global batch reached another way: the plan's figures are another
            # configuration's, and logging them beside this run's would compare unlike things.
            self._predicted = None
            log.warning("the Trainer runs micro-batch %d x %d accumulation x %d processes, not the plan's %d x %d x %d: "
                        "memplan/ logs no predictions for it; build the TrainingArguments with "
                        "memplan.integrations.hf.training_args(plan) to run the plan's choice",
                        micro, accum, world, c.micro_batch_size, c.grad_accum_steps, c.world_size)
        self.step_times.clear()
        device = args.device
        self._device = device if device.type == "cuda" else None
        if self._device is not None:
            # The training's peak, not model loading's or an earlier run's in this process.
            torch.cuda.reset_peak_memory_stats(self._device)
        self._run_before_reporters(sys._getframe(1))

    def _run_before_reporters(self, caller: Any) -> None:
        """Move this callback to the front of the Trainer's callbacks.

        The Trainer puts the ``report_to`` callbacks (TensorBoardCallback, WandbCallback, ...)
        before the user's and hands every callback's ``on_log`` the same ``logs`` dict in that
        order: keys added by a callback behind the reporters reach none of them. Callbacks are
        not handed the Trainer, so the handler is taken from the caller: ``on_train_begin`` is
        called by ``CallbackHandler.call_event``. A new list is assigned (the loop running this
        event goes on over the old one), so no callback misses or repeats this event.
        """
        handler = caller.f_locals.get("self")
        if isinstance(handler, transformers.trainer_callback.CallbackHandler) and self in handler.callbacks:
            handler.callbacks = [self, *(cb for cb in handler.callbacks if cb is not self)]
        else:
            log.warning("MemplanCallback could not find the Trainer's callback handler: memplan/ keys reach only the "
                        "reporters after it; pass it in Trainer(callbacks=[...]) of a transformers Trainer")

    # -- measurements --------------------------------------------------------------------------
    def _sync(self) -> None:
        # CUDA runs asynchronously: without waiting, on_step_end would time the launches, and
        # the step's kernels would count in whichever later step waits for them.
        if self._device is not None:
            torch.cuda.synchronize(self._device)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self._step_start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._step_start is None:
            return
        self._sync()
        self.step_times.append(time.perf_counter() - self._step_start)
        self._step_start = None

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

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        # Running first (``_run_before_reporters``), the keys added here are in the dict the
        # reporters write next. Evaluation's logs (eval_*, test_*) are left as they are.
        if logs is None or any(k.startswith(("eval_", "test_")) for k in logs):
            return
        keys = self.figures()
        logs.update(keys)
        # The Trainer copied the logs into its history before the callbacks ran.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(keys)
