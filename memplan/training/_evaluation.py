"""Evaluation: validation metrics, the best weights, early stopping's count, and the weights a
run writes at its end (``model.pt``: the best with early stopping, else the final; EMA's if on).

Evaluating with EMA on swaps the EMA weights into
the model for the duration: a second copy of the evaluated weights, not in the estimate.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from estimators import ConfigError, default_logits_and_targets, default_loss, to_device
from estimators.runtime._pipeline import PipelinedModel

from ._checkpoint_io import load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from estimators import EMA, Task

    from ._distributed import RankAgreement
    from ._memory import Phase
    from ._metrics import Metrics
    from ._options import TrainOptions
    from ._precision import TrainPrecision
    from ._schedules import LRSchedule
    from ._state import TrainState

__all__: list[str] = []

Batch = Any


class Evaluator:
    """Validation on ``val_loader`` (None: no validation data), the best weights (``best_path``),
    early stopping's count (in the :class:`TrainState`), and the weights written at the end
    (``model_path``).

    ``forward_model`` and ``val_loader`` follow an OOM recovery's switch (more checkpointing,
    another micro-batch size).
    """

    def __init__(self, task: Task, *, model: nn.Module, forward_model: nn.Module, ema: EMA | None,
                 val_loader: DataLoader | None, precision: TrainPrecision, sharded: bool, device: torch.device,
                 options: TrainOptions, schedule: LRSchedule, ranks: RankAgreement, metrics: Metrics, phase: Phase,
                 best_path: Path, model_path: Path) -> None:
        self.task, self.model, self.forward_model, self.ema = task, model, forward_model, ema
        self.val_loader, self.precision, self.sharded, self.device = val_loader, precision, sharded, device
        self.options, self.schedule, self.ranks, self.metrics, self.phase = options, schedule, ranks, metrics, phase
        self.best_path, self.model_path = best_path, model_path

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss (mean over samples) and, with the default loss and class targets,
        accuracy (per token for ``(B, T, V)`` outputs). Uses the EMA weights when on."""
        self.phase.set("evaluation")
        assert self.val_loader is not None
        default = self.task.loss_fn is default_loss
        total_loss, total_weight, correct, counted = 0.0, 0, 0, 0
        # DDP: the module itself (its wrapper's forward would broadcast buffers, a collective that
        # ranks with fewer validation batches would not join). FSDP2: the sharded module, whose
        # forward all-gathers, so every rank runs as many forward passes (see the padding below).
        # Compiled single-device runs evaluate the compiled module.
        # A pipeline: its stages, run one after the other, give every rank the output.
        eval_model = (self.model if self.ranks.distributed and not isinstance(self.forward_model, PipelinedModel)
                      else self.forward_model)
        self.model.eval()
        swap = self.ema.swapped_in(self.model) if self.ema is not None else contextlib.nullcontext()
        try:
            with swap:
                batches: Iterator[tuple[Batch, bool]] = ((b, True) for b in self.val_loader)
                if self.sharded:
                    batches = self._padded_val_batches()
                for batch, counts in batches:
                    batch = self.precision.convert_input(to_device(batch, self.device))  # bf16-true: bf16 inputs
                    with self.precision.forward_context():
                        if default:
                            logits, targets = default_logits_and_targets(eval_model, batch)
                            loss = F.cross_entropy(logits.float(), targets)
                        else:
                            loss = self.task.compute_loss(eval_model, batch)
                    if not counts:
                        continue  # a padding pass: it only keeps this rank in step with the others
                    if default and not targets.is_floating_point():
                        valid = targets != -100  # cross_entropy's ignore_index
                        n = int(valid.sum())
                        correct += int(((logits.argmax(dim=1) == targets) & valid).sum())
                        counted += n
                    else:
                        n = _batch_len(batch)
                    if n:
                        total_loss += float(loss) * n
                        total_weight += n
        finally:
            self.model.train()
        if self.ranks.distributed:
            # Each rank evaluated its share (items r::W): the metrics are of the sums over ranks.
            sums = torch.tensor(
                [total_loss, total_weight, correct, counted], dtype=torch.float64, device=self.ranks.comm_device
            )
            dist.all_reduce(sums)
            total_loss, total_weight, correct, counted = (
                sums[0].item(),
                int(sums[1].item()),
                int(sums[2].item()),
                int(sums[3].item()),
            )
        metrics = {"val_loss": total_loss / total_weight if total_weight else float("nan")}
        if counted:
            metrics["val_accuracy"] = correct / counted
        return metrics

    def _padded_val_batches(self) -> Iterator[tuple[Batch, bool]]:
        """This rank's validation batches, then as many padding passes (the first batch again,
        not counted) as it takes to match the rank with the most batches."""
        assert self.val_loader is not None
        n_val = len(self.val_loader.dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__
        most = math.ceil(math.ceil(n_val / self.ranks.replicas) / (self.val_loader.batch_size or 1))
        first, seen = None, 0
        for batch in self.val_loader:
            if first is None:
                first = batch
            seen += 1
            yield batch, True
        if first is None:  # fewer items than ranks: this rank has none
            first = self.task.collate([self.val_loader.dataset[0]])
        for _ in range(most - seen):
            yield first, False

    def track(self, state: TrainState, metrics: dict[str, float]) -> None:
        """Count an evaluation's ``metrics`` in ``state``: the best weights (written to
        ``best_path``), early stopping, the plateau schedule; log it."""
        state.last_metrics, state.last_eval_step = metrics, state.step
        if self.options.monitor not in metrics:
            raise ConfigError(
                f"monitor {self.options.monitor!r} is not a validation metric of {self.task.name}; "
                f"available: {', '.join(sorted(metrics))}"
            )
        value = metrics[self.options.monitor]
        improved = math.isfinite(value) and (
            state.best_metric is None
            or (value < state.best_metric if self.options.mode == "min" else value > state.best_metric)
        )
        # Early stopping's own yardstick: only a gain of more than min_delta over the value of
        # the last such gain resets the patience (the best weights follow every gain).
        delta = self.options.early_stopping_min_delta
        significant = math.isfinite(value) and (
            state.stop_reference is None
            or (
                value < state.stop_reference - delta
                if self.options.mode == "min"
                else value > state.stop_reference + delta
            )
        )
        if significant:
            state.stop_reference, state.bad_evaluations = value, 0
        else:
            state.bad_evaluations += 1
        if improved:
            state.best_metric, state.best_step, state.best_metrics = (
                value,
                state.step,
                dict(metrics),
            )
            # Best weights go to disk, not to RAM: no second copy of the model stays alive.
            best = self._eval_state_dict()
            if self.ranks.is_main:
                save_checkpoint(best, self.best_path)
            del best
        self.schedule.observe(value)
        patience = self.options.early_stopping_patience
        if patience is not None and state.bad_evaluations >= patience:
            state.stopped_early = True
        self.metrics.log(
            {
                "type": "eval",
                "step": state.step,
                "epoch": state.epoch,
                **metrics,
                "best": state.best_metric,
                "improved": improved,
            }
        )
        self.metrics.say(
            f"step {state.step}: "
            + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            + (" (best)" if improved else "")
        )

    def _eval_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights that are evaluated and written: the EMA's when on, else the model's. Full
        tensors on every rank (FSDP2 gathers its shards: every rank must call this)."""
        state = _full_tensors(self.model.state_dict())
        if self.ema is not None:
            state.update(_full_tensors(self.ema.shadow))
        if isinstance(self.forward_model, PipelinedModel):
            # Each rank holds its stages' part: the whole model is every rank's parts.
            parts: list[Any] = [None] * self.forward_model.pp
            dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=self.forward_model.group)
            state = {k: v.to(self.device) for part in parts for k, v in part.items()}
        return state

    def _load_full_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Full (unsharded) weights into the model, whatever its strategy."""
        if isinstance(self.forward_model, PipelinedModel):
            own = self.model.state_dict()
            self.model.load_state_dict({k: v for k, v in state.items() if k in own})  # this rank's stages
        elif self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state)

    def write_result_weights(self, train_state: TrainState) -> None:
        """``model.pt``: the best weights with early stopping, else the final ones (EMA if on).
        ``self.model`` is left holding them; with the best ones, ``train_state``'s last metrics
        become theirs."""
        if (
            self.options.early_stopping_patience is not None
            and train_state.best_step is not None
            and self.best_path.exists()
        ):
            state = load_checkpoint(self.best_path, map_location=self.device)
            train_state.last_metrics = dict(train_state.best_metrics)
        else:
            state = self._eval_state_dict()
        self._load_full_state(state)
        if self.ranks.is_main:
            save_checkpoint(state, self.model_path)


def _batch_len(batch: Batch) -> int:
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _full_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies; FSDP2's sharded DTensors gathered into full tensors (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        full = getattr(v, "full_tensor", None)
        out[k] = (full() if full is not None else v).detach().clone()
    return out
