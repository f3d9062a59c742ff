"""The model-file contract and the in-memory ``Task`` every part of memplan works on.

A model file is a plain Python file; memplan imports it and looks up:

``model() -> nn.Module``                    required; built on the current default device
``train_data() -> Dataset``                 required; items collated by ``default_collate``
``val_data() -> Dataset``                   optional; validation metrics and early stopping
``loss(model, batch) -> Tensor``            optional; default cross-entropy of
                                            ``model(inputs)`` against ``targets``
``optimizer(parameters) -> Optimizer``      optional; default AdamW (no decay on biases/norms)
``collate(items) -> batch``                 optional; default ``torch.utils.data.default_collate``
``scheduler(optimizer, total_steps)``       optional; a ``torch.optim.lr_scheduler.LRScheduler``
                                            the trainer steps once per optimizer step (a
                                            ``ReduceLROnPlateau``: once per evaluation) instead
                                            of its built-in warm-up + cosine
``checkpoint_blocks(model) -> [Module]``    optional; the blocks checkpoint segments refer to
``tp_plan(model) -> {pattern: style}``      optional; which linears tensor parallelism splits
                                            (``"colwise"``/``"rowwise"``; else inferred:
                                            ``estimators.runtime._tensor_parallel``)
``item_sizes(dataset) -> [int | tuple]``    optional; per item, the sizes that vary (a length,
                                            ``(H, W)``), so that no item is read to find them
``settings``                                optional dict: global_batch, epochs, max_steps, lr,
                                            weight_decay, warmup_steps, target, …
                                            (``estimators.task._settings``: checked where the task
                                            is made)

The optimizer factory receives only the parameters that require gradients, so frozen parts
get no optimizer state.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
import traceback
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset, default_collate

from .._errors import ConfigError, ModelFileError
from .._step_options import StepOptions
from .._types import Batch, Item, Setting
from ._settings import check_settings, warn_ignored
from ._shapes import (
    POLICIES,
    ItemSize,
    PlannedBatch,
    ShapeProfile,
    dataset_length,
    fill_items,
    largest_items,
    planned_batch,
)
from ._task_data import (
    _as_factory,
    _cached_dataset,
    _cached_shapes,
    _cached_template,
    _is_spec,
    _one_line,
    _repeat_rows,
    module_fingerprint,
)

__all__ = ["Task", "load_task", "default_loss", "default_logits_and_targets", "default_optimizer"]


def default_logits_and_targets(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``model(inputs)`` and ``targets`` for ``batch = (inputs, targets)``, as the default loss
    sees them: sequence outputs ``(B, T, C)`` with targets ``(B, T)`` are flattened, as
    language models need; image-shaped outputs ``(B, C, H, W)`` with targets ``(B, H, W)`` are
    left for ``cross_entropy``, which handles them. The class dimension is 1."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(
            "the default loss needs batches of (inputs, targets); define "
            "`def loss(model, batch): ...` in the model file for other batch layouts"
        )
    inputs, targets = batch
    return loss_shapes(model(inputs), targets)


def loss_shapes(out: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``targets`` as the default loss takes them: sequence outputs ``(B, T, C)``
    with targets ``(B, T)`` flattened, anything else as is."""
    if (
        out.dim() >= 3
        and targets.dim() == out.dim() - 1
        and tuple(targets.shape) == tuple(out.shape[:-1])
    ):
        out, targets = out.flatten(0, -2), targets.flatten()
    return out, targets


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against ``targets`` (see
    :func:`default_logits_and_targets` for the shapes it accepts)."""
    return F.cross_entropy(*default_logits_and_targets(model, batch))


def default_optimizer(parameters: Iterable[nn.Parameter], *, lr: float = 1e-3,
                      weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: biases and norm weights (1-D) get none."""
    params = [p for p in parameters if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=lr)


@dataclass(frozen=True, kw_only=True, eq=False)
class Task:
    """What memplan needs to know about a model to estimate, probe and train it.

    Build one with :func:`load_task` (a model file) or :meth:`Task.from_module` (an
    ``nn.Module`` plus a sample batch).
    """

    name: str
    build_model: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = default_loss
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    train_data: Callable[[], Dataset] | None = None
    val_data: Callable[[], Dataset] | None = None
    collate: Callable[[list[Item]], Batch] = default_collate
    build_scheduler: Callable[[torch.optim.Optimizer, int], LRScheduler] | None = None
    """``scheduler(optimizer, total_steps) -> LRScheduler``; ``None``: the trainer's built-in schedule."""
    checkpoint_blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    tp_plan: Callable[[nn.Module], Mapping[str, str]] | None = None
    """``tp_plan(model) -> {module pattern: "colwise" | "rowwise"}``: the linears ``tp > 1``
    splits; ``None``: the model's own plan or an inferred one (``runtime._tensor_parallel``)."""
    sample_fn: Callable[[int], Batch] | None = None
    """Makes a real batch of a given size (used when there is no dataset)."""
    settings: Mapping[str, Setting] = field(default_factory=dict)
    source_path: str | None = None
    source_hash: str | None = None
    origin: Mapping[str, Setting] = field(default_factory=dict)
    """Where a task not read from a model file comes from, for the plan's provenance: an
    ``hf:`` source's ``hf`` (repo id, folder or file), ``seq_len``, ``task`` and ``lora_rank``."""
    prebuilt: nn.Module | None = None
    """The user's own module (``from_module``); never mutated by memplan."""
    item_sizes: Callable[[Dataset], Sequence[ItemSize]] | None = None
    """Per item of the dataset, the sizes that vary (see ``estimators.task._shapes``)."""
    shape_policy: str = "max"
    """Which batch estimates are made for when items vary in shape: ``max``, the worst the
    loader can form; ``p99``, the 99th percentile of an epoch's; ``median`` (for reports)."""
    step: StepOptions = field(default_factory=StepOptions)
    """What the training step runs besides forward, backward and the optimizer step
    (clipping, EMA, label smoothing): a model file's or module's ``settings`` say
    (``StepOptions.from_settings``), else the trainer's defaults, unless :meth:`with_step` says."""
    _cache: dict[Hashable, object] = field(default_factory=dict, repr=False)
    """The loaded dataset, its shapes and batch templates: loaded once per task, dropped with it.
    Values of several kinds (the user's dataset and batches among them), each read back only
    by the helper that stored it under its key."""

    def __post_init__(self) -> None:
        # Every task is made here (load_task, from_module, Task(...), dataclasses.replace):
        # its settings are checked once more for each copy, the user's own keys warned of once.
        ignored = check_settings(self.settings, self.name)
        if ignored:
            warn_ignored(ignored, self.name, task=self.source_path or self.name)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        sample: Batch | Callable[[int], Batch] | None = None,
        *,
        loss: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        train_data: Callable[[], Dataset] | Dataset | None = None,
        val_data: Callable[[], Dataset] | Dataset | None = None,
        collate: Callable[[list[Item]], Batch] | None = None,
        scheduler: Callable[[torch.optim.Optimizer, int], LRScheduler] | None = None,
        name: str | None = None,
        settings: Mapping[str, Setting] | None = None,
    ) -> Task:
        """A task for an in-memory module. ``sample`` is a batch (leading dimension = batch)
        or a callable ``sample(batch_size) -> batch``; without it, batches come from
        ``train_data`` (a ``Dataset``, or a callable returning one)."""
        if not isinstance(module, nn.Module):
            raise ModelFileError(f"expected an nn.Module, got {type(module).__name__}")
        if sample is None and train_data is None:
            raise ModelFileError(
                f"{type(module).__name__}: memplan needs batches to trace the module; pass sample= (a batch, "
                "or a callable batch_size -> batch) or train_data= (a Dataset)")
        sample_fn = None if sample is None else (sample if callable(sample) else _repeat_rows(sample))
        return cls(
            name=name or type(module).__name__,
            build_model=lambda: module,
            loss_fn=loss or default_loss,
            build_optimizer=optimizer,
            train_data=_as_factory(train_data),
            val_data=_as_factory(val_data),
            collate=collate or default_collate,
            build_scheduler=scheduler,
            sample_fn=sample_fn,
            settings=dict(settings or {}),
            # The step the settings ask the trainer for is the one estimated.
            step=StepOptions.from_settings(settings or {}, name or type(module).__name__),
            prebuilt=module,
            source_hash=module_fingerprint(module, sample_fn, train_data),
        )

    # -- pieces used by estimators and the trainer ------------------------------------
    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ModelFileError(f"{self.name}: the model has no parameters that require grad; nothing to train")
        if self.build_optimizer is None:
            # Checked where the task was made (estimators.task._settings): a number, None, or lr
            # "auto", which the trainer replaces by lr-find's suggestion once a plan is chosen.
            lr, wd = self.settings.get("lr"), self.settings.get("weight_decay")
            return default_optimizer(params, lr=1e-3 if lr is None or isinstance(lr, str) else float(lr),
                                     weight_decay=0.01 if wd is None else float(wd))
        opt = self.build_optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ModelFileError(
                f"{self.name}: optimizer(parameters) returned {type(opt).__name__}, not a "
                "torch.optim.Optimizer; return e.g. torch.optim.AdamW(parameters, lr=1e-3)"
            )
        return opt

    def compute_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = self.loss_fn(model, batch)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ModelFileError(
                f"{self.name}: loss(model, batch) must return a scalar tensor, got "
                f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}"
            )
        return out

    def dataset(self) -> Dataset | None:
        return _cached_dataset(self)

    def dataset_size(self) -> int | None:
        data = self.dataset()
        if data is None:
            return None
        try:
            return dataset_length(data)
        except TypeError:
            return None

    def shapes(self) -> ShapeProfile:
        """The sizes of the dataset's items (found once per task; see ``estimators.task._shapes``)."""
        return _cached_shapes(self)

    def with_shape_policy(self, policy: str) -> Task:
        """This task planning for another batch of varying-shape data (``max``, ``p99``,
        ``median``); the loaded dataset and its shapes are shared, not loaded again."""
        if policy not in (*POLICIES, "median"):
            raise ConfigError(f"unknown shape policy {policy!r}; use one of {', '.join(POLICIES)}")
        if policy == self.shape_policy:
            return self
        shared: dict[Hashable, object] = {k: self._cache[k] for k in ("dataset", "shapes") if k in self._cache}
        task = replace(self, shape_policy=policy, _cache=shared)
        return task

    def with_step(self, step: StepOptions) -> Task:
        """This task with another step (the trainer's options that change the step's memory);
        the loaded dataset and its shapes are shared."""
        if step == self.step:
            return self
        return replace(self, step=step, _cache=self._cache)

    def planned(self, like: int) -> PlannedBatch | None:
        """The batch of ``like`` items this task's estimates are made for; None when every
        batch of that size has one shape."""
        profile = self.shapes()
        if not profile.varying:
            return None
        return planned_batch(profile, self.shape_policy, like)

    def real_batch(self, batch_size: int, *, offset: int = 0, like: int | None = None) -> Batch:
        """A real batch of ``batch_size`` items (dataset items cycled from ``offset``). When
        items vary in shape, the batch planned for micro-batches of ``like`` (default
        ``batch_size``): its longest items, then items no larger cycled from ``offset``."""
        if self.sample_fn is not None and self.train_data is None:
            return self.sample_fn(batch_size)
        data = self.dataset()
        if data is None:
            raise ModelFileError(f"{self.name}: define train_data() so memplan can build batches")
        n = dataset_length(data)
        if n == 0:
            raise ModelFileError(f"{self.name}: train_data() is empty; it must hold at least one item")
        planned = self.planned(like or batch_size)
        if planned is None:
            indices = [(offset + i) % n for i in range(batch_size)]
        elif not self.shapes().collate_pads and self.shape_policy == "max":
            indices = largest_items(self.shapes(), batch_size)
        else:
            indices = list(planned.items[:batch_size])
            indices += fill_items(self.shapes(), planned, batch_size - len(indices), offset)
        return self._collate([data[i] for i in indices])

    def _collate(self, items: list[Item]) -> Batch:
        try:
            return self.collate(items)
        except Exception as exc:  # noqa: BLE001 - the user's data, reported with the fix
            raise ModelFileError(
                f"{self.name}: cannot collate items of train_data() into a batch ({_one_line(exc)}); "
                "make items the same shape or define collate(items) in the model file"
            ) from None

    def batch_template(self, like: int | None = None) -> Batch:
        """A real batch with the structure, dtypes and per-item shapes of a batch: one item
        (the first) when every batch has one shape, else the items that set the padded size
        of the batch planned for micro-batches of ``like``."""
        planned = self.planned(like or 1)
        if planned is None:
            return _cached_template(self)
        key = ("template", planned.key())
        if key not in self._cache:
            self._cache[key] = self.real_batch(len(planned.items), like=like or 1)
        return self._cache[key]

    def fake_batch(self, batch_size: int, *, like: int | None = None) -> Batch:
        """A batch of ``batch_size`` with the template's structure, made by the active
        (fake) mode: no real memory, no values. ``like``: see :meth:`real_batch`."""
        planned = self.planned(like or batch_size)
        if planned is not None and not self.shapes().collate_pads:
            # The collate does not pad to the longest item: its output for the planned
            # items themselves is the only shape to trust.
            key = ("collated", batch_size, like or batch_size, self.shape_policy)
            if key not in self._cache:
                shapes = tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t,
                                  self.real_batch(batch_size, like=like or batch_size))
                self._cache[key] = shapes
            return tree_map(lambda x: torch.empty(x[0], dtype=x[1]) if _is_spec(x) else x, self._cache[key],
                            is_leaf=_is_spec)
        template = self.batch_template(like or batch_size) if planned is not None else self.batch_template()

        def grow(leaf: object) -> object:
            if isinstance(leaf, torch.Tensor):
                if leaf.dim() == 0:
                    return torch.empty((), dtype=leaf.dtype)
                return torch.empty((batch_size, *leaf.shape[1:]), dtype=leaf.dtype)
            return leaf
        return tree_map(grow, template)


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_MODULE_COUNTER = itertools.count()


def load_task(path: str | Path) -> Task:
    """Import a model file and check it against the contract.

    Raises :class:`ModelFileError` with the file's name and the fix for: a missing file, a
    file that does not import, a missing ``model()``, or names of the wrong kind.
    """
    p = Path(path)
    module = _import_model_file(p, path)

    # The file's own functions: what they take and return is the file's (checked where called).
    def need_callable(name: str, required: bool, signature: str) -> Callable[..., Any] | None:
        obj = getattr(module, name, None)
        if obj is None:
            if required:
                raise ModelFileError(f"{p.name} defines no {name}(); add `def {signature}: ...`")
            return None
        if not callable(obj):
            raise ModelFileError(f"{p.name}: {name} must be a function `def {signature}`, got {type(obj).__name__}")
        return obj

    build = need_callable("model", True, "model() -> torch.nn.Module")
    assert build is not None  # required: need_callable raised otherwise
    train = need_callable("train_data", True, "train_data() -> torch.utils.data.Dataset")
    val = need_callable("val_data", False, "val_data() -> Dataset")
    loss = need_callable("loss", False, "loss(model, batch) -> Tensor")
    opt = need_callable("optimizer", False, "optimizer(parameters) -> torch.optim.Optimizer")
    collate = need_callable("collate", False, "collate(items) -> batch")
    scheduler = need_callable("scheduler", False,
                              "scheduler(optimizer, total_steps) -> torch.optim.lr_scheduler.LRScheduler")
    blocks = need_callable("checkpoint_blocks", False, "checkpoint_blocks(model) -> list[nn.Module]")
    tp_plan = need_callable("tp_plan", False, "tp_plan(model) -> dict[str, str]")
    sizes = need_callable("item_sizes", False, "item_sizes(dataset) -> list[int | tuple[int, ...]]")
    settings = getattr(module, "settings", {}) or {}
    if not isinstance(settings, Mapping):
        raise ModelFileError(f"{p.name}: settings must be a dict, got {type(settings).__name__}")
    return Task(
        name=p.name,
        build_model=_checked_builder(build, p),
        loss_fn=loss or default_loss,
        build_optimizer=opt,
        train_data=train,
        val_data=val,
        collate=collate or default_collate,
        build_scheduler=scheduler,
        checkpoint_blocks=blocks,
        tp_plan=tp_plan,
        item_sizes=sizes,
        settings=dict(settings),
        step=StepOptions.from_settings(settings, p.name),  # the step the settings ask the trainer for
        source_path=str(p.resolve()),
        source_hash=_file_hash(p),
    )


def _import_model_file(p: Path, path: str | Path) -> ModuleType:
    """The model file imported as a module of its own (its directory on the path meanwhile)."""
    if not p.is_file():
        raise ModelFileError(f"model file {str(path)!r} not found; pass the path of a .py file that defines model()")
    spec = importlib.util.spec_from_file_location(f"memplan_model_{next(_MODULE_COUNTER)}_{p.stem}", p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{p.name}: cannot be imported as Python; give a .py file that defines model()")
    module = importlib.util.module_from_spec(spec)
    # The file's own directory first on the path, so it can import its neighbours.
    sys.path.insert(0, str(p.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ModelFileError(f"{p.name}: syntax error at line {exc.lineno}: {exc.msg}; fix the file") from None
    except Exception as exc:  # noqa: BLE001
        where = _user_frame(exc, p)
        raise ModelFileError(f"{p.name}: importing it raised {_one_line(exc)}{where}; fix the file") from None
    finally:
        try:
            sys.path.remove(str(p.parent.resolve()))
        except ValueError:
            pass
    return module


def _checked_builder(build: Callable[[], object], p: Path) -> Callable[[], nn.Module]:
    """``model()`` of the file, its errors and a return that is not a module reported."""
    def build_model() -> nn.Module:
        try:
            m = build()
        except Exception as exc:  # noqa: BLE001
            raise ModelFileError(f"{p.name}: model() raised {_one_line(exc)}{_user_frame(exc, p)}; fix model()") from None
        if not isinstance(m, nn.Module):
            raise ModelFileError(
                f"{p.name}: model() returned {type(m).__name__}, not a torch.nn.Module; return the module itself"
            )
        return m

    return build_model


def _user_frame(exc: BaseException, path: Path) -> str:
    """' (line N)' of the deepest frame inside the model file, if any."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f" (line {line})" if line else ""
