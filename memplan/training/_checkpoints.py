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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

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

    from ._options import TrainOptions
    from ._schedules import LRSchedule
    from ._state import TrainState

__all__: list[str] = []

log = logging.getLogger("memplan.trainer")

CHECKPOINT_FORMAT = 1


class _Checkpoints:
    """Save, resume and restore (a part of :class:`~memplan.training.Trainer`)."""

    # Set by the Trainer and its other parts; annotations only (nothing at runtime), for the type checker.
    task: Task
    config: TrainConfig
    options: TrainOptions
    state: TrainState
    device: torch.device
    world_size: int
    is_main: bool  # _RankAgreement's (read-only) property
    out_dir: Path
    checkpoint_path: Path
    best_path: Path
    last_checkpoint_step: int | None
    _last_dcp: str | None
    _pending_evaluation: bool
    n_train: int
    val_loader: DataLoader | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    ema: EMA | None
    schedule: LRSchedule
    ladder: list[TrainConfig]
    _tried: list[TrainConfig]
    recoveries: list[dict[str, Any]]
    _decided: dict[str, Any] | None
    _set_phase: Callable[[str], None]
    _flush_log: Callable[[], None]
    _agree: Callable[[bool], bool]
    _switch_config: Callable[[TrainConfig], None]

    def _save_checkpoint(self, *, collective: bool = True, pending_evaluation: bool = False) -> None:
        """``checkpoint.pt``; under FSDP2 with the sharded tensors in a ``torch.distributed.checkpoint``
        folder beside it. ``collective=False``: this rank alone writes it (a DDP rank after an
        OOM, whose replicated state is that of every rank; the others cannot be reached)."""
        self._set_phase("checkpoint")
        self._flush_log()  # a resume continues from here: the lines before it must be on disk
        finite = _all_finite(self.model)
        if collective:
            finite = self._agree(finite)  # FSDP: each rank checked its own shards
        if not finite:
            raise TrainingError(
                f"the weights became NaN/inf by step {self.state.step}; not overwriting the last good "
                f"checkpoint {self.checkpoint_path}; lower the learning rate, set grad_clip, or use "
                "bf16/fp32 instead of fp16"
            )
        sharded = self.config.strategy == "fsdp"
        if collective and not sharded and not self.is_main:
            self.last_checkpoint_step = self.state.step  # DDP: rank 0 writes the replicated state
            return
        dcp_dir = self._save_sharded() if sharded else None
        if not self.is_main and collective:
            self.last_checkpoint_step = self.state.step
            return
        state = self._checkpoint_state(sharded, dcp_dir, pending_evaluation)
        save_checkpoint(state, self.checkpoint_path, keep_previous=True)
        self.last_checkpoint_step = self.state.step
        if dcp_dir is not None:
            # The kept previous checkpoint.pt points at its own folder: that one stays too.
            keep = {Path(dcp_dir).name} | ({Path(self._last_dcp).name} if self._last_dcp else set())
            remove_stale_sharded(self.out_dir / SHARDED_DIR, keep=keep)
            self._last_dcp = dcp_dir

    def _checkpoint_state(self, sharded: bool, dcp_dir: str | None, pending_evaluation: bool) -> dict[str, Any]:
        """Everything ``checkpoint.pt`` holds; the counters are the :class:`TrainState`'s."""
        state = {
            "format": CHECKPOINT_FORMAT,
            **self.state.state_dict(),
            "epoch_micro_batches": math.ceil(self.state.epoch_offset / self.config.micro_batch_size),
            "n_train": self.n_train,
            # FSDP2: the tensors are in dcp_dir (resharded on load, at any world size).
            "model": None if sharded else self.model.state_dict(),
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "dcp": dcp_dir,
            "world_size": self.world_size,
            "pending_evaluation": pending_evaluation,
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None and not sharded else None,
            "rng": _rng_state(),
            "config": self.config.to_dict(),
            "options": self.options.to_dict(),
            "task": {"name": self.task.name, "source_hash": self.task.source_hash},
            # OOM recovery: "config" above is the configuration running now (the one that worked).
            "recovery": {"recoveries": list(self.recoveries),
                         "ladder": [c.to_dict() for c in self.ladder],
                         "tried": [c.to_dict() for c in self._tried]},
        }
        state["best"]["path"] = str(self.best_path) if self.state.best_step is not None else None
        return state

    def _save_sharded(self) -> str:
        """Every rank writes its shards into a fresh folder (a temporary name, renamed when all
        are done); ``checkpoint.pt``, written afterwards, points at it."""
        token = [f"step-{self.state.step:08d}-{os.urandom(4).hex()}" if self.is_main else None]
        dist.broadcast_object_list(token, src=0)  # one name for all ranks
        name = str(token[0])
        root = self.out_dir / SHARDED_DIR
        tmp, final = root / f".{name}.tmp", root / name
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_sharded(self.model, self.optimizer, tmp, extra=self._sharded_extra())
        dist.barrier()  # every rank's shards are on disk
        if self.is_main:
            os.replace(tmp, final)
        return f"{SHARDED_DIR}/{name}"

    def _sharded_extra(self) -> dict[str, Any]:
        return {"ema": self.ema.shadow} if self.ema is not None else {}

    def _resume(self) -> int | None:
        """Load ``checkpoint.pt`` if there is one; returns its step (None: fresh start)."""
        if not self.checkpoint_path.exists() and not previous_path(self.checkpoint_path).exists():
            log.warning("resume: no checkpoint at %s; starting from scratch", self.checkpoint_path)
            return None
        ckpt, source, passed_over = load_latest_checkpoint(self.checkpoint_path, map_location=self.device)
        if passed_over is not None:
            log.warning("%s; resuming from %s (step %s)", passed_over, source, ckpt.get("step"))
        try:
            return self._restore(ckpt)
        except KeyError as exc:
            raise DamagedCheckpointError(
                f"{source} lacks {exc}: not a checkpoint of this memplan; train into another --out") from None

    def _restore(self, ckpt: dict[str, Any]) -> int:
        saved = TrainConfig.from_dict(ckpt["config"])
        self._check_resumable(ckpt, saved)
        self._restore_recovery(ckpt, saved)
        self._restore_tensors(ckpt)
        self._pending_evaluation = bool(ckpt.get("pending_evaluation")) and self.val_loader is not None
        self.state.load_state_dict(ckpt)
        self.last_checkpoint_step = self.state.step
        # Last: building the model and loaders above drew from the RNGs.
        _set_rng_state(ckpt["rng"])
        return int(self.state.step)

    def _check_resumable(self, ckpt: Mapping[str, Any], saved: TrainConfig) -> None:
        """The checkpoint continues this run: same global batch, data order, seed and data."""
        if saved.global_batch != self.config.global_batch:
            raise ConfigError(
                f"{self.checkpoint_path} was trained with a global batch of {saved.global_batch}, this "
                f"config has {self.config.global_batch}; resume with the same micro_batch_size x "
                "grad_accum_steps product, or use another out_dir"
            )
        if saved.length_grouped != self.config.length_grouped:
            raise ConfigError(
                f"{self.checkpoint_path} was trained with length_grouped={saved.length_grouped}; resume with "
                "the same data order (length_grouped), or use another out_dir")
        if ckpt["options"]["seed"] != self.options.seed or ckpt["n_train"] != self.n_train:
            raise ConfigError(
                f"{self.checkpoint_path} was written with seed {ckpt['options']['seed']} and "
                f"{ckpt['n_train']} training items; resuming needs the same seed and data "
                f"(got seed {self.options.seed}, {self.n_train} items)"
            )
        if bool(ckpt["options"].get("drop_last", False)) != self.options.drop_last:
            raise ConfigError(
                f"{self.checkpoint_path} was written with drop_last={ckpt['options'].get('drop_last', False)}; "
                "an epoch's length depends on it: resume with the same drop_last, or use another out_dir")
        if ckpt["task"]["source_hash"] != self.task.source_hash:
            log.warning("%s changed since the checkpoint was written", self.task.name)
        changed = _changed_options(ckpt["options"], self.options.to_dict())
        if changed and self.is_main:
            log.warning("resuming %s with options the run did not start with: %s", self.checkpoint_path, changed)

    def _restore_recovery(self, ckpt: Mapping[str, Any], saved: TrainConfig) -> None:
        """An OOM-recovered run continues on the configuration that worked."""
        recovery = ckpt.get("recovery") or {}
        if recovery.get("recoveries") and self._decided is None:
            # The run stepped down after an OOM: continue on the configuration that worked, with
            # the rungs that were still below it.
            self.recoveries = list(recovery["recoveries"])
            self._tried = [TrainConfig.from_dict(c) for c in recovery.get("tried", [])] or [saved]
            if saved in self.ladder:
                self.ladder = self.ladder[self.ladder.index(saved) + 1:]
            else:
                self.ladder = [TrainConfig.from_dict(c) for c in recovery.get("ladder", [])]
            if saved != self.config:
                log.warning("resuming on %s, the configuration an OOM recovery switched to", saved.describe())
                self._switch_config(saved)

    def _restore_tensors(self, ckpt: Mapping[str, Any]) -> None:
        """Weights, optimizer, schedule, GradScaler and EMA, whatever the strategy that wrote them."""
        if ckpt.get("dcp"):
            # Written by an FSDP2 run: DCP reshards the tensors to this run's layout -- another
            # world size, or one plain process. Only from the run's own folder, read as data.
            folder = sharded_folder(self.out_dir, ckpt["dcp"], checkpoint=self.checkpoint_path)
            self._last_dcp = ckpt["dcp"]
            load_sharded(self.model, self.optimizer, folder, extra=self._sharded_extra())
        elif self.config.strategy == "fsdp":
            raise ConfigError(
                f"{self.checkpoint_path} is a single-file checkpoint (a single-device or DDP run); an FSDP run "
                "resumes from FSDP checkpoints only; resume it with strategy 'ddp' or 'single', or use another out_dir"
            )
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.schedule.load_state_dict(ckpt["schedule"])  # after the optimizer: it sets the lr
        if self.scaler is not None and ckpt["scaler"] is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
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
    flags = [torch.isfinite(p).all() for p in model.parameters() if p.is_floating_point()]
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
