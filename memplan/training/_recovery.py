"""Out-of-memory recovery: the trainer's helpers and :func:`keep_global_batch` for own loops.

The rule every helper here follows (FACTS.md, "After an OOM"): catch the error by type
(:func:`estimators.is_oom_error`), keep nothing of it but its message, and recover
*outside* the ``except`` block -- while the exception is being handled its traceback keeps the
failed step's frames, and with them its tensors, alive. Recovery then drops the references,
runs ``gc.collect()`` and, on CUDA, ``torch.cuda.empty_cache()``.

Unlike Accelerate's ``find_executable_batch_size``, :func:`keep_global_batch` keeps the global
batch: each retry halves the micro-batch (to the next divisor of the global batch) and raises
gradient accumulation to match, so the learning rate and the optimisation stay the same.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from estimators import ConfigError, TrainConfig, TrainingError, is_oom_error

__all__ = ["keep_global_batch", "GlobalBatchStep", "next_micro_batch", "free_memory", "is_oom_error", "RecoveryEvent", "OOMRecord",
           "DistributedOOM", "ladder_configs", "ladder_peaks", "pick_rung", "Ladder"]

P = ParamSpec("P")
R = TypeVar("R")


def next_micro_batch(global_batch: int, micro_batch_size: int) -> int | None:
    """The largest divisor of ``global_batch`` that is at most half of ``micro_batch_size``
    (``None`` when ``micro_batch_size`` is already 1).

    >>> next_micro_batch(64, 64), next_micro_batch(64, 32), next_micro_batch(48, 48), next_micro_batch(60, 60)
    (32, 16, 24, 30)
    >>> next_micro_batch(64, 1) is None
    True
    """
    if micro_batch_size <= 1:
        return None
    half = micro_batch_size // 2
    for d in range(half, 0, -1):
        if global_batch % d == 0:
            return d
    return 1


def free_memory(device: torch.device | str | None = None, *,
                optimizer: torch.optim.Optimizer | None = None,
                model: nn.Module | None = None) -> None:
    """Free what a failed step left: gradients (``set_to_none``), garbage cycles, the CUDA cache.
    Call it after the ``except`` block has ended."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if model is not None:
        for p in model.parameters():
            p.grad = None
    gc.collect()
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def ladder_configs(ladder: Sequence[Any] | None, config: TrainConfig) -> list[TrainConfig]:
    """``Plan.ladder()`` entries or configs -> the configs with ``config``'s global batch, in order."""
    out: list[TrainConfig] = []
    for rung in ladder or ():
        c = getattr(rung, "config", rung)
        if isinstance(c, Mapping):
            c = TrainConfig.from_dict(dict(c))
        if not isinstance(c, TrainConfig):
            raise ConfigError(f"ladder entries must be TrainConfig or PlanEntry, got {type(rung).__name__}")
        if c.global_batch == config.global_batch and c != config and c not in out:
            out.append(c)
    return out


def ladder_peaks(ladder: Iterable[Any] | None) -> dict[TrainConfig, int]:
    """The memory each rung of a ``Plan.ladder()`` needs (measured where it was probed, else
    predicted); rungs given as bare configurations have none."""
    out: dict[TrainConfig, int] = {}
    for rung in ladder or ():
        config, peak = getattr(rung, "config", None), getattr(rung, "peak_bytes", None)
        if isinstance(config, TrainConfig) and isinstance(peak, int):
            out[config] = peak
    return out


def pick_rung(rungs: list[TrainConfig], peaks: dict[TrainConfig, int],
              capacity: int | None) -> tuple[TrainConfig, list[TrainConfig]]:
    """Take the rung to step down to from ``rungs`` (in ladder order, removed from it): the
    first predicted to fit ``capacity``, the memory the failure showed there is (the budget
    the run is held to), and the rungs passed over. A plan made for 1 GB and run under 110 MB
    goes from micro-batch 32 straight to the first rung predicted under 110 MB, not through
    every rung above it, each an OOM of its own. A rung without a prediction is tried; when
    none is predicted to fit, the last (smallest) is the best chance left."""
    if not rungs:
        raise ValueError("no rung left")
    if capacity is None:
        return rungs.pop(0), []
    index = next((i for i, c in enumerate(rungs) if peaks.get(c, 0) <= capacity), len(rungs) - 1)
    chosen, skipped = rungs[index], rungs[:index]
    del rungs[: index + 1]
    return chosen, skipped



class Ladder:
    """The configuration running now (``config``), the rungs still below it (``rungs``, in
    order), the configurations tried and the OOM recoveries made (``recoveries``, their
    records): what OOM recovery steps along and what a checkpoint keeps of it.

    ``enabled``: a ladder was given (without one an OOM propagates). ``decided``: a relaunch's
    hand-over from the launcher (``{"recoveries": [...], "tried": [...], "failed_at": ...}``),
    which wins over the checkpoint's record.
    """

    def __init__(self, config: TrainConfig, ladder: Sequence[Any] | None,
                 decided: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.rungs = ladder_configs(ladder, config)
        self.peaks = ladder_peaks(ladder)
        self.enabled = ladder is not None
        self.tried: list[TrainConfig] = [config]
        self.recoveries: list[dict[str, Any]] = []
        self.decided = dict(decided) if decided is not None else None

    def step_down(self, capacity: int | None) -> tuple[TrainConfig, list[TrainConfig]]:
        """The next rung (see :func:`pick_rung`), tried from now on, and the rungs passed over.
        (The trainer applies it to the running parts, and makes it ``config``.)"""
        new, skipped = pick_rung(self.rungs, self.peaks, capacity)
        self.tried.append(new)
        return new, skipped

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``recovery`` entry (its ``config`` is the running one, saved apart)."""
        return {"recoveries": list(self.recoveries), "ladder": [c.to_dict() for c in self.rungs],
                "tried": [c.to_dict() for c in self.tried]}

    def resume(self, recovery: Mapping[str, Any], saved: TrainConfig) -> TrainConfig:
        """Take over a checkpoint's record (``recovery``, written running ``saved``); returns the
        configuration to continue on: the one an OOM recovery switched to, with the rungs that
        were still below it (the running one when the run never stepped down)."""
        if not recovery.get("recoveries") or self.decided is not None:
            return self.config
        self.recoveries = list(recovery["recoveries"])
        self.tried = [TrainConfig.from_dict(c) for c in recovery.get("tried", [])] or [saved]
        if saved in self.rungs:
            self.rungs = self.rungs[self.rungs.index(saved) + 1:]
        else:
            self.rungs = [TrainConfig.from_dict(c) for c in recovery.get("ladder", [])]
        return saved


@dataclass
class RecoveryEvent:
    """One switch to a smaller configuration after an OOM (a line of ``metrics.jsonl``)."""

    step: int
    phase: str
    from_config: dict[str, Any]
    to_config: dict[str, Any]
    peak_at_failure: int | None
    seconds: float
    error: str = ""
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Rungs passed over: predicted above the memory the failure showed there is."""

    def to_dict(self) -> dict[str, Any]:
        return {"event": "oom_recovery", "step": self.step, "phase": self.phase,
                "from": self.from_config, "to": self.to_config,
                "peak_at_failure": self.peak_at_failure, "seconds": self.seconds, "error": self.error,
                "skipped": self.skipped}


class DistributedOOM(TrainingError):
    """A rank of a distributed run ran out of memory and left; the launcher recovers (see
    :mod:`memplan.training._launch`) from the :class:`OOMRecord` it wrote."""


@dataclass(frozen=True, kw_only=True)
class OOMRecord:
    """What a rank that ran out of memory leaves for the launcher: a small JSON file in the run's
    folder, ``oom-rank<R>.json``. Files, not a collective: the other ranks may be blocked in a
    collective that will never complete, so nothing can be agreed among them after the fact;
    the launcher reads every record once all ranks have exited and decides for all of them."""

    rank: int
    step: int
    """The optimizer step that failed (1-based, as logged)."""
    phase: str
    config: dict[str, Any]
    peak_at_failure: int | None
    budget: int | None
    error: str
    time: float
    """``time.time()`` of the failure (recovery time is measured from it)."""
    resume_step: int | None
    """The step the relaunched run resumes from (None: from scratch)."""
    window_start_checkpoint: bool
    """A checkpoint of the failed window's start was written (DDP): nothing is lost."""

    @staticmethod
    def path(out_dir: str | os.PathLike[str], rank: int) -> Path:
        return Path(out_dir) / f"oom-rank{rank}.json"

    def write(self, out_dir: str | os.PathLike[str]) -> Path:
        target = self.path(out_dir, self.rank)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, target)
        return target

    @classmethod
    def read_all(cls, out_dir: str | os.PathLike[str]) -> list[OOMRecord]:
        """Every rank's record in ``out_dir``, earliest failure first."""
        records = []
        for f in sorted(Path(out_dir).glob("oom-rank*.json")):
            try:
                records.append(cls(**json.loads(f.read_text())))
            except (ValueError, TypeError):
                continue  # half-written by a rank killed while writing: the others tell the story
        return sorted(records, key=lambda r: r.time)

    @staticmethod
    def clear(out_dir: str | os.PathLike[str]) -> None:
        for f in Path(out_dir).glob("oom-rank*.json"):
            f.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# Undo state for a replayed window (the trainer's)
# ----------------------------------------------------------------------------------------------

@dataclass
class _Snapshot:
    params: list[torch.Tensor] = field(default_factory=list)
    state: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    scaler: dict[str, Any] | None = None


def snapshot_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies, made with the dispatch modes (a CPU memory guard) switched off: the copy is
    an undo buffer in host memory, not part of the device's training step."""
    with _disable_current_modes(), torch.no_grad():
        return [t.detach().to("cpu", copy=True) for t in tensors]


def restore_tensors(targets: Iterable[torch.Tensor], saved: Iterable[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, s in zip(targets, saved):
            t.copy_(s)


@dataclass
class _BufferSnapshot:
    """Every buffer of a model as it was (:func:`snapshot_buffers`)."""

    slots: list[tuple[nn.Module, str, torch.Tensor]]
    """Each registration: the module, the buffer's name, the tensor it held."""
    tensors: list[torch.Tensor]
    """The distinct tensors of ``slots`` (a buffer shared by two modules is copied once)."""
    saved: list[torch.Tensor]
    """Their host copies."""


def snapshot_buffers(model: nn.Module) -> _BufferSnapshot | None:
    """Host copies of every buffer of ``model`` (None when it has none): what a forward may
    change as a side effect -- BatchNorm's running statistics and ``num_batches_tracked``, any
    module's in-place update or replaced buffer -- so that a replayed window starts from them."""
    slots = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    if not slots:
        return None
    tensors = list({id(b): b for _, _, b in slots}.values())
    return _BufferSnapshot(slots=slots, tensors=tensors, saved=snapshot_tensors(tensors))


def restore_buffers(snap: _BufferSnapshot) -> None:
    """Put back what :func:`snapshot_buffers` saw: the values, in the same tensors, under the same names."""
    restore_tensors(snap.tensors, snap.saved)
    for module, name, tensor in snap.slots:
        module._buffers[name] = tensor


def snapshot_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: Any | None) -> _Snapshot:
    """What an optimizer step changes in place: parameters, optimizer state, the GradScaler."""
    params = list(model.parameters())
    snap = _Snapshot(params=snapshot_tensors(params))
    with _disable_current_modes(), torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if not st:
                    snap.state[id(p)] = None
                    continue
                snap.state[id(p)] = {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                     for k, v in st.items()}
    snap.scaler = scaler.state_dict() if scaler is not None else None
    return snap


def restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any | None,
                      snap: _Snapshot) -> None:
    restore_tensors(model.parameters(), snap.params)
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                saved = snap.state.get(id(p))
                if saved is None:
                    optimizer.state.pop(p, None)  # lazily created by the failed step
                    continue
                current = optimizer.state[p]
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor) \
                            and current[k].shape == v.shape:
                        current[k].copy_(v)
                    elif isinstance(v, torch.Tensor):
                        current[k] = v.to(p.device if v.dim() else v.device)
                    else:
                        current[k] = v
    if scaler is not None and snap.scaler:  # empty before the scaler's first step
        scaler.load_state_dict(snap.scaler)


# ----------------------------------------------------------------------------------------------
# For users' own loops
# ----------------------------------------------------------------------------------------------

def keep_global_batch(global_batch: int, starting_micro_batch: int | None = None, *,
                      before_retry: Callable[[int, int], None] | None = None,
                      device: str | torch.device | None = None,
                      ) -> Callable[[Callable[Concatenate[int, int, P], R]], GlobalBatchStep[P, R]]:
    """Retry a step with a smaller micro-batch and more accumulation after an OOM.

    The decorated function is called as ``fn(micro_batch_size, grad_accum_steps, *args,
    **kwargs)`` with ``micro_batch_size * grad_accum_steps == global_batch``. When it raises an
    out-of-memory error (``torch.OutOfMemoryError``, the CPU allocator's or cuDNN's, see
    :func:`is_oom_error`), the error is dropped, memory is freed (``gc.collect()``, the CUDA
    cache), ``before_retry(micro, accum)`` is called if given (zero your gradients there), and
    the function runs again with the micro-batch halved to the next divisor of the global batch
    and the accumulation raised to match -- the learning rate is left alone, since the global
    batch does not change. The working pair is remembered for later calls
    (``fn.micro_batch_size``, ``fn.grad_accum_steps``); ``fn.history`` lists every pair tried.
    Raises :class:`TrainingError` when micro-batch 1 still runs out of memory.

    Example:
        >>> @keep_global_batch(global_batch=64, starting_micro_batch=64)
        ... def step(micro_batch_size, grad_accum_steps):
        ...     if micro_batch_size > 16:
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     return micro_batch_size, grad_accum_steps
        >>> step()
        (16, 4)
        >>> step.history
        [(64, 1), (32, 2), (16, 4)]
    """
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a whole number >= 1, got {global_batch!r}")
    start = global_batch if starting_micro_batch is None else starting_micro_batch
    if not isinstance(start, int) or start < 1 or global_batch % start:
        raise ConfigError(f"starting_micro_batch {start!r} must divide the global batch {global_batch}")

    def decorate(fn: Callable[Concatenate[int, int, P], R]) -> GlobalBatchStep[P, R]:
        return GlobalBatchStep(fn, global_batch, start, before_retry=before_retry, device=device)
    return decorate


class GlobalBatchStep(Generic[P, R]):
    """A step decorated by :func:`keep_global_batch`: called without the micro-batch and the
    accumulation, which it holds (``micro_batch_size``, ``grad_accum_steps``) and lowers after
    an out-of-memory error; ``history`` lists every pair tried, ``recovery_seconds`` the time
    each recovery took."""

    def __init__(self, fn: Callable[Concatenate[int, int, P], R], global_batch: int, micro_batch_size: int, *,
                 before_retry: Callable[[int, int], None] | None, device: str | torch.device | None) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.global_batch = global_batch
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = global_batch // micro_batch_size
        self.history: list[tuple[int, int]] = []
        self.recovery_seconds: list[float] = []
        self._before_retry = before_retry
        self._device = device

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        while True:
            micro = self.micro_batch_size
            self.history.append((micro, self.global_batch // micro))
            message = None
            try:
                return self._fn(micro, self.global_batch // micro, *args, **kwargs)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                message = f"{type(exc).__name__}: {exc}"
            # Outside the except block: the traceback (and the step's tensors) are gone.
            self._halve_micro_batch(message)

    def _halve_micro_batch(self, message: str | None) -> None:
        """After an OOM: free memory and halve the micro-batch (to the next divisor of the
        global batch), or stop when micro-batch 1 failed."""
        t0 = time.perf_counter()
        free_memory(self._device)
        smaller = next_micro_batch(self.global_batch, self.micro_batch_size)
        if smaller is None:
            raise TrainingError(
                f"{getattr(self._fn, '__name__', 'the step')} ran out of memory with micro-batch 1 x "
                f"{self.global_batch} accumulation steps (tried {self.history}); nothing smaller keeps the "
                f"global batch of {self.global_batch} -- free memory or reduce the model ({message})"
            )
        self.micro_batch_size = smaller
        self.grad_accum_steps = self.global_batch // smaller
        if self._before_retry is not None:
            self._before_retry(smaller, self.global_batch // smaller)
        self.recovery_seconds.append(time.perf_counter() - t0)
