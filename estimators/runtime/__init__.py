"""The training step's techniques, shared by the trace, the probes and the trainer.

* :mod:`._step` -- :func:`train_step`: forward, loss, backward per micro-batch, clip, optimizer
  step, EMA, zero_grad; what differs between its callers is their :class:`StepHooks`.
* :class:`~estimators.StepOptions` (a core type, ``estimators._step_options``): clipping, EMA, label smoothing (``Task.step``).
* :mod:`._build` -- :func:`build_for_training`: build, move, checkpoint, wrap, compile.
* :mod:`._planned` -- :class:`PlannedSteps`: steps on the batches a task plans (trace, probes).
* :mod:`._precision`, :mod:`._checkpoint`, :mod:`._parallel`, :mod:`._clip`, :mod:`._ema` --
  one technique each; :mod:`._guard` (the CPU memory budget), :mod:`._oom` (is it an OOM?).
"""
