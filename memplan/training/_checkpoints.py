"""The trainer's checkpoints: what ``checkpoint.pt`` holds, how it is written (atomically, the
previous one kept; under FSDP2 with the sharded tensors in a ``torch.distributed.checkpoint``
folder beside it) and how a run resumes from it. File-level reading and writing is
:mod:`memplan.training._checkpoint_io`'s; the progress counters are :class:`TrainState`'s.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from estimators import ConfigError, TrainConfig, TrainingError

from ._checkpoint_io import (
    SHARDED_DIR,
    DamagedCheckpointError,
    load_latest_checkpoint,
    load_sharded,
    previous_path,
    remove_stale_sharded,
    save_checkpoint,
    save_sharded,
    sharded_folder,
)

if TYPE_CHECKING:
    from estimators import EMA, Task

    from ._distributed import RankAgreement
    from ._memory import Phase
    from ._metrics import Metrics
    from ._options import TrainOptions
    from ._precision import TrainPrecision
    from ._recovery import Ladder
    from ._schedules import LRSchedule
    from ._state import TrainState

__all__: list[str] = []

log = logging.getLogger("memplan.trainer")

CHECKPOINT_FORMAT = 1


class CheckpointManager:
    """``checkpoint.pt`` in ``out_dir``: :meth:`save`, and :meth:`load` then :meth:`restore` to resume.

    What it saves is handed to it: the model, optimizer, schedule, EMA and precision (its
    GradScaler), the :class:`Ladder` (the running configuration and the OOM recovery record),
    and at each save the :class:`TrainState`. ``ranks`` decides who writes and checks that
    every rank's weights are finite; ``metrics`` is flushed first (a resume continues the log
    from here).
    """

    def __init__(self, out_dir: Path, *, task: Task, options: TrainOptions, n_train: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, schedule: LRSchedule, ema: EMA | None, precision: TrainPrecision,
                 ladder: Ladder, ranks: RankAgreement, metrics: Metrics, phase: Phase, best_path: Path) -> None:
        self.out_dir, self.path, self.best_path = out_dir, out_dir / "checkpoint.pt", best_path
        self.task, self.options, self.n_train = task, options, n_train
        self.model, self.optimizer, self.schedule, self.ema = model, optimizer, schedule, ema
        self.precision, self.ladder, self.ranks, self.metrics, self.phase = precision, ladder, ranks, metrics, phase
        self.sharded = ladder.config.shards_parameters
        self.last_step: int | None = None
        """The step of the last checkpoint written or resumed from (None: none yet)."""
        self._last_dcp: str | None = None  # the sharded folder the last checkpoint.pt names
        self._source = self.path  # the file load() read (the kept previous one when the latest is damaged)

    def save(self, state: TrainState, *, collective: bool = True, pending_evaluation: bool = False) -> None:
        """``checkpoint.pt``; under FSDP2 with the sharded tensors in a ``torch.distributed.checkpoint``
        folder beside it. ``collective=False``: this rank alone writes it (a DDP rank after an
        OOM, whose replicated state is that of every rank; the others cannot be reached)."""
        self.phase.set("checkpoint")
        self.metrics.flush()  # a resume continues from here: the lines before it must be on disk
        finite = _all_finite(self.model)
        if collective:
            finite = self.ranks.agree(finite)  # FSDP: each rank checked its own shards
        if not finite:
            raise TrainingError(
                f"the weights became NaN/inf by step {state.step}; not overwriting the last good "
                f"checkpoint {self.path}; lower the learning rate, set grad_clip, or use "
                "bf16/fp32 instead of fp16"
            )
        is_main = self.ranks.is_main
        if collective and not self.sharded and not is_main:
            self.last_step = state.step  # DDP: rank 0 writes the replicated state
            return
        dcp_dir = self._save_sharded(state) if self.sharded else None
        if not is_main and collective:
            self.last_step = state.step
            return
        ckpt = self._checkpoint_state(state, dcp_dir, pending_evaluation)
        save_checkpoint(ckpt, self.path, keep_previous=True)
        self.last_step = state.step
        if dcp_dir is not None:
            # The kept previous checkpoint.pt points at its own folder: that one stays too.
            keep = {Path(dcp_dir).name} | ({Path(self._last_dcp).name} if self._last_dcp else set())
            remove_stale_sharded(self.out_dir / SHARDED_DIR, keep=keep)
            self._last_dcp = dcp_dir

    def _checkpoint_state(self, state: TrainState, dcp_dir: str | None, pending_evaluation: bool) -> dict[str, Any]:
        """Everything ``checkpoint.pt`` holds; the counters are the :class:`TrainState`'s."""
        sharded, config = self.sharded, self.ladder.config
        ckpt = {
            "format": CHECKPOINT_FORMAT,
            **state.state_dict(),
            "epoch_micro_batches": math.ceil(state.epoch_offset / config.micro_batch_size),
            "n_train": self.n_train,
            # FSDP2: the tensors are in dcp_dir (resharded on load, at any world size).
            "model": None if sharded else self.model.state_dict(),
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "dcp": dcp_dir,
            "world_size": self.ranks.world_size,
            "pending_evaluation": pending_evaluation,
            "schedule": self.schedule.state_dict(),
            "scaler": self.precision.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None and not sharded else None,
            "rng": _rng_state(),
            "config": config.to_dict(),
            "options": self.options.to_dict(),
            "task": {"name": self.task.name, "source_hash": self.task.source_hash},
            # OOM recovery: "config" above is the configuration running now (the one that worked).
            "recovery": self.ladder.state_dict(),
        }
        ckpt["best"]["path"] = str(self.best_path) if state.best_step is not None else None
        return ckpt

    def _save_sharded(self, state: TrainState) -> str:
        """Every rank writes its shards into a fresh folder (a temporary name, renamed when all
        are done); ``checkpoint.pt``, written afterwards, points at it."""
        is_main = self.ranks.is_main
        token = [f"step-{state.step:08d}-{os.urandom(4).hex()}" if is_main else None]
        dist.broadcast_object_list(token, src=0)  # one name for all ranks
        name = str(token[0])
        root = self.out_dir / SHARDED_DIR
        tmp, final = root / f".{name}.tmp", root / name
        if is_main:
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_sharded(self.model, self.optimizer, tmp, extra=self._sharded_extra(), flatten=self.ladder.config.pp > 1)
        dist.barrier()  # every rank's shards are on disk
        if is_main:
            os.replace(tmp, final)
        return f"{SHARDED_DIR}/{name}"

    def _sharded_extra(self) -> dict[str, Any]:
        return {"ema": self.ema.shadow} if self.ema is not None else {}

    def load(self, device: torch.device) -> dict[str, Any] | None:
        """The latest readable checkpoint, checked to continue this run (None: there is none, a
        fresh start). The caller switches to its configuration, then calls :meth:`restore`."""
        if not self.path.exists() and not previous_path(self.path).exists():
            log.warning("resume: no checkpoint at %s; starting from scratch", self.path)
            return None
        ckpt, source, passed_over = load_latest_checkpoint(self.path, map_location=device)
        if passed_over is not None:
            log.warning("%s; resuming from %s (step %s)", passed_over, source, ckpt.get("step"))
        try:
            self._check_resumable(ckpt, TrainConfig.from_dict(ckpt["config"]))
        except KeyError as exc:
            raise self._damaged(source, exc) from None
        self._source = source
        return ckpt

    def restore(self, ckpt: dict[str, Any], state: TrainState) -> int:
        """Weights, optimizer, schedule, GradScaler, EMA, ``state``'s counters and the RNGs from
        :meth:`load`'s checkpoint; returns its step."""
        try:
            self._restore_tensors(ckpt)
            state.load_state_dict(ckpt)
            rng = ckpt["rng"]
        except KeyError as exc:
            raise self._damaged(self._source, exc) from None
        self.last_step = state.step
        # Last: building the model and loaders drew from the RNGs.
        _set_rng_state(rng)
        return int(state.step)

    @staticmethod
    def _damaged(source: Path, exc: KeyError) -> DamagedCheckpointError:
        return DamagedCheckpointError(
            f"{source} lacks {exc}: not a checkpoint of this memplan; train into another --out")

    def _check_resumable(self, ckpt: Mapping[str, Any], saved: TrainConfig) -> None:
        """The checkpoint continues this run: same global batch, data order, seed and data."""
        config = self.ladder.config
        if saved.global_batch != config.global_batch:
            raise ConfigError(
                f"{self.path} was trained with a global batch of {saved.global_batch}, this "
                f"config has {config.global_batch}; resume with the same micro_batch_size x "
                "grad_accum_steps product, or use another out_dir"
            )
        if saved.length_grouped != config.length_grouped:
            raise ConfigError(
                f"{self.path} was trained with length_grouped={saved.length_grouped}; resume with "
                "the same data order (length_grouped), or use another out_dir")
        if ckpt["options"]["seed"] != self.options.seed or ckpt["n_train"] != self.n_train:
            raise ConfigError(
                f"{self.path} was written with seed {ckpt['options']['seed']} and "
                f"{ckpt['n_train']} training items; resuming needs the same seed and data "
                f"(got seed {self.options.seed}, {self.n_train} items)"
            )
        if bool(ckpt["options"].get("drop_last", False)) != self.options.drop_last:
            raise ConfigError(
                f"{self.path} was written with drop_last={ckpt['options'].get('drop_last', False)}; "
                "an epoch's length depends on it: resume with the same drop_last, or use another out_dir")
        if ckpt["task"]["source_hash"] != self.task.source_hash:
            log.warning("%s changed since the checkpoint was written", self.task.name)
        changed = _changed_options(ckpt["options"], self.options.to_dict())
        if changed and self.ranks.is_main:
            log.warning("resuming %s with options the run did not start with: %s", self.path, changed)

    def _restore_tensors(self, ckpt: Mapping[str, Any]) -> None:
        """Weights, optimizer, schedule, GradScaler and EMA, whatever the strategy that wrote them."""
        if ckpt.get("dcp"):
            # Written by an FSDP2 run: DCP reshards the tensors to this run's layout -- another
            # world size, or one plain process. Only from the run's own folder, read as data.
            folder = sharded_folder(self.out_dir, ckpt["dcp"], checkpoint=self.path)
            self._last_dcp = ckpt["dcp"]
            load_sharded(self.model, self.optimizer, folder, extra=self._sharded_extra())
        elif self.sharded:
            raise ConfigError(
                f"{self.path} is a single-file checkpoint (a single-device or DDP run); an FSDP run "
                "resumes from FSDP checkpoints only; resume it with strategy 'ddp' or 'single', or use another out_dir"
            )
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.schedule.load_state_dict(ckpt["schedule"])  # after the optimizer: it sets the lr
        self.precision.load_state_dict(ckpt["scaler"])
        if self.ema is not None and ckpt["ema"] is not None:
            self.ema.load_state_dict(ckpt["ema"])


_NOT_COMPARED = frozenset({"out_dir", "resume", "overwrite", "progress", "predicted_peak_bytes", "metrics_path"})
"""Options that say where and how a run is shown, not how it trains."""


def _changed_options(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """``lr 0.001 -> 0.01, max_steps 20 -> 40``: the training options a resume changes (those
    the checkpoint recorded; empty when none)."""
    return ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in now
                     if k in saved and k not in _NOT_COMPARED and saved[k] != now[k])


def _all_finite(model: nn.Module) -> bool:
    """Are this rank's parameters finite (a DTensor's: its shard; the ranks agree after)?"""
    flags = [torch.isfinite(getattr(p, "_local_tensor", p)).all() for p in model.parameters() if p.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def _rng_state() -> dict[str, Any]:
    """Every global RNG the model can draw from, as plain data (loadable with weights_only)."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].cpu().numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"], "gauss": n["gauss"],
    })
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
