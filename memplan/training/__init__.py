"""Training: run one ``TrainConfig`` -- on one device, or as the ranks of a DDP/FSDP2 run --
exactly as the estimator predicted it, and recover from running out of memory.

Where each part lives (the :class:`Trainer` holds the loop and the objects marked *part*, each
made with what it uses; the progress they share is the :class:`TrainState`, passed to them):

``_trainer``        :class:`Trainer` and :func:`train`: set up, resume, the loop, the end.
``_options``        :class:`TrainOptions` (how to train) and its checks.
``_state``          :class:`TrainState`, the progress saved in checkpoints; :class:`TrainResult`.
``_data``           the data order (a pure function of seed and epoch); ``TrainData``: loaders, windows (*part*).
``_window``         THE STEP: ``WindowStep``, one window's forward/backward, clipping, optimizer step (*part*).
``_precision``      ``TrainPrecision``: the step's ``StepPrecision`` (name and GradScaler) that a rung switch replaces (*part*).
``_schedules``      the learning-rate schedules: the interface, the built-in shapes, ``make_schedule``.
``_evaluation``     ``Evaluator``: validation metrics, best weights, early stopping, the written weights (*part*).
``_checkpoints``    ``CheckpointManager``: what ``checkpoint.pt`` holds; save, load, restore (*part*).
``_checkpoint_io``  atomic files, the kept previous checkpoint, sharded (DCP) folders.
``_metrics``        ``Metrics``: ``metrics.jsonl``, the progress bar, the largest batch; ``summary.json`` (*part*).
``_memory``         the phase told to the memory guard, the measured peak (*parts*).
``_monitor``        NVML readings and per-layer gradient norms.
``_signals``        ``StopSignals``: SIGINT/SIGTERM (*part*).
``_oom``            ``InProcessRecovery``: step down the ladder, replay the window (*part*).
``_recovery``       OOM helpers (the ``Ladder``, undo copies, rung choice, records) and :func:`keep_global_batch`.
``_distributed``    ``RankAgreement``: what the ranks agree on (*part*).
``_launch``         :func:`launch_training`: start the ranks, relaunch them one rung down after an OOM.
``_out_dir``        the output folder: held by one run at a time; a fresh run never over another's results.
``_rank``           one rank's entry point and failure report.

What a run writes to ``out_dir``:

``checkpoint.pt``   everything to resume exactly (weights, optimizer, schedule, GradScaler, EMA,
                    RNG states, data position, counters, config, options); written atomically at
                    ``checkpoint_every``, at the end and on SIGINT/SIGTERM, never during a run of
                    NaN losses and never with non-finite weights.
``best_model.pt``   the best evaluated weights so far (only with validation data).
``model.pt``        the result: best weights with early stopping, else the final ones (EMA's if on).
``metrics.jsonl``   one JSON object a line: ``{"type": "step", "step", "epoch", "loss", "lr",
                    "samples_per_s", "grad_norm", "peak_memory_bytes", "skipped"[, "scaler_skipped",
                    "gpu_util_percent", "gpu_memory_used_bytes", "gpu_power_watts", "gpu_temperature_c",
                    "layer_grad_norms"]}`` per optimizer step (NVML on CUDA; per-layer gradient norms,
                    before clipping, at step 1 and every 50th: ``memplan.training._monitor``),
                    ``{"type": "eval", "step", "epoch", "val_loss"[, "val_accuracy"], "best",
                    "improved"}`` per evaluation, ``{"type": "oom_recovery", "event": "oom_recovery",
                    "step", "phase", "from", "to", "peak_at_failure", "seconds", "error"}`` per switch
                    to a smaller configuration, ``{"type": "resume", ...}`` when resumed
                    (appended to; lines logged after the last checkpoint of a crashed run repeat).
                    NaN/inf are written as the strings ``"nan"``/``"inf"``. Step lines are written
                    in batches, at most a second late; everything is on disk at each checkpoint and
                    when the run ends (also by a signal or an error).
``checkpoint-dcp/``  FSDP2 runs only: the sharded tensors of the checkpoint (``torch.distributed.checkpoint``).
``oom-rank<R>.json`` / ``failure-rank<R>.json``   distributed runs only: what a failed rank leaves for the launcher.
``.memplan.lock``   who holds the folder (see ``_out_dir``).
``summary.json``    wall time, steps, best and final metrics, measured vs predicted peak memory,
                    the OOM ``recoveries``.
"""

from __future__ import annotations

from ._data import epoch_items, epoch_permutation
from ._launch import LaunchSpec, launch_training
from ._options import TrainOptions
from ._recovery import DistributedOOM, keep_global_batch
from ._state import TrainResult, TrainState
from ._trainer import Trainer, train

__all__ = ["TrainOptions", "TrainResult", "TrainState", "Trainer", "train", "epoch_permutation", "epoch_items",
           "DistributedOOM", "LaunchSpec", "launch_training", "keep_global_batch"]
