"""The data side of a ``Task``: its dataset, item shapes and batch template, each loaded once
and kept in the task's cache; and what tells two in-memory models apart.

Helpers of ``_task.Task``'s methods, kept apart so that the task reads as its contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset

from .._errors import ModelFileError
from .._types import Batch, Item
from ._shapes import ShapeProfile, dataset_length, profile_shapes, worst_items

if TYPE_CHECKING:  # ``_task`` imports this module, not the other way
    from ._task import Task


def _is_spec(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)


def _cached_shapes(task: Task) -> ShapeProfile:
    if "shapes" not in task._cache:
        data = task.dataset()
        if data is None:
            profile = ShapeProfile(0, np.zeros(0, np.int64), np.zeros((0, 0), np.int64), "sample", "a sample batch",
                                   varying=False)
        else:
            profile = profile_shapes(data, item_sizes=task.item_sizes, name=task.name)
            if profile.varying:
                profile = _check_collate(task, data, profile)
        task._cache["shapes"] = profile
    cached = task._cache["shapes"]
    assert isinstance(cached, ShapeProfile)
    return cached


def _check_collate(task: Task, data: Dataset[Item], profile: ShapeProfile) -> ShapeProfile:
    """Call the collate on the extreme items: the longest together, and with the shortest
    added. Padding to the longest item keeps the per-item shape and grows the leading
    dimension by one; a collate padding every batch to one length makes the data
    fixed-shape; any other growth (packing, say) is planned from collating the planned items
    themselves (``collate_pads=False``)."""
    top = worst_items(profile, len(profile.sizes))
    small = int(profile.indices[int(np.argmin(np.prod(np.maximum(profile.sizes, 1).astype(float), axis=1)))])
    longest = [data[i] for i in top.items]
    k = len(longest)
    a = _leaf_shapes(task._collate(longest))
    b = _leaf_shapes(task._collate([*longest, data[small]]))
    c = _leaf_shapes(task._collate([data[small]]))
    batched = [i for i, s in enumerate(a) if len(s) > 0]
    pads = len(a) == len(b) and all(len(b[i]) == len(a[i]) and b[i][0] == k + 1 and b[i][1:] == a[i][1:]
                                    and a[i][0] == k for i in batched)
    if pads and len(c) == len(a) and all(c[i][1:] == a[i][1:] for i in batched):
        return replace(profile, varying=False, source=profile.source + "; the collate pads every batch to one shape")
    return profile if pads else replace(profile, collate_pads=False)


def _leaf_shapes(batch: Batch) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in _leaves(batch) if isinstance(x, torch.Tensor)]


def _as_factory(data: Callable[[], Dataset] | Dataset | None) -> Callable[[], Dataset] | None:
    if data is None:
        return None
    if isinstance(data, Dataset) or not callable(data):
        dataset = data  # a dataset given as is (a callable one too): the factory hands it back
        return lambda: dataset
    return data


def module_fingerprint(module: nn.Module, sample_fn: Callable[[int], Batch] | None,
                       data: Callable[[], Dataset] | Dataset | None) -> str:
    """What tells two in-memory models apart for a cached study: the module's structure (its
    repr names every layer and its sizes), each parameter's and buffer's name, shape, dtype and
    trainability, and the shapes and dtypes of a sample batch. Two models of one class but
    other sizes, or other frozen parts, or other inputs, never share a study."""
    h = hashlib.sha256(repr(module).encode())
    for line in _tensor_lines(module):
        h.update(line.encode())
    try:
        if sample_fn is not None:
            batch = sample_fn(2)
        else:
            dataset = data() if callable(data) and not isinstance(data, Dataset) else data
            assert dataset is not None  # Task.from_module asks for a sample or data
            batch = [dataset[0], dataset_length(dataset)]
        for leaf in _leaves(batch):
            h.update((f"{tuple(leaf.shape)}:{leaf.dtype}" if isinstance(leaf, torch.Tensor) else repr(leaf)).encode())
    except Exception:  # noqa: BLE001 - a batch that cannot be made fails later, with its own message
        pass
    return "module-" + h.hexdigest()[:16]


def structure_fingerprint(module: nn.Module) -> tuple[int, str]:
    """The module's parameter count and a short hash of each parameter's and buffer's name,
    shape, dtype and trainability: what a plan was made for, whatever the weights' values and
    the device (a model built on meta has the fingerprint of the same model built for real).
    Unlike ``module_fingerprint`` it leaves out the repr and the inputs: two files that build
    the same parameters agree."""
    h = hashlib.sha256()
    count = 0
    for line in _tensor_lines(module):
        h.update(line.encode())
    for p in module.parameters():
        count += 0 if is_lazy(p) else p.numel()
    return count, h.hexdigest()[:16]


def _tensor_lines(module: nn.Module) -> list[str]:
    """One line per parameter (name, shape, dtype, trainability) and per buffer (name, shape,
    dtype; ``:grad`` when one requires grad, which buffers rarely do): what both fingerprints
    hash."""
    lines = [f"{name}:{_shape(p)}:{p.dtype}:{p.requires_grad}" for name, p in module.named_parameters()]
    lines += [f"{name}:{_shape(b)}:{b.dtype}" + (":grad" if b.requires_grad else "")
              for name, b in module.named_buffers()]
    return lines


def _shape(t: torch.Tensor) -> str:
    """The tensor's shape; ``lazy`` for a lazy module's parameter, whose shape is not known yet."""
    return "lazy" if is_lazy(t) else str(tuple(t.shape))


def _cached_dataset(task: Task) -> Dataset | None:
    if task.train_data is None:
        return None
    if "dataset" not in task._cache:
        try:
            data = task.train_data()
        except Exception as exc:  # noqa: BLE001
            raise ModelFileError(f"{task.name}: train_data() raised {_one_line(exc)}; fix the dataset code") from None
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise ModelFileError(
                f"{task.name}: train_data() returned {type(data).__name__}; return a map-style "
                "torch.utils.data.Dataset (with __len__ and __getitem__)"
            )
        task._cache["dataset"] = data
    # The model file's dataset, as stored above (checked map-style; not always a Dataset subclass).
    return cast(Dataset, task._cache["dataset"])


def _cached_template(task: Task) -> Batch:
    if "template" not in task._cache:
        task._cache["template"] = task.real_batch(1)
    return task._cache["template"]


def _repeat_rows(sample: Batch) -> Callable[[int], Batch]:
    leaves = [x for x in _leaves(sample) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        raise ModelFileError("sample must be a tensor or a tuple/dict of tensors with a leading batch dimension")

    def make(batch_size: int) -> Batch:
        def grow(leaf: object) -> object:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                reps = -(-batch_size // leaf.shape[0])
                return leaf.repeat(reps, *([1] * (leaf.dim() - 1)))[:batch_size].clone()
            return leaf
        return tree_map(grow, sample)
    return make


def _leaves(tree: Batch) -> list[object]:
    from torch.utils._pytree import tree_flatten
    return tree_flatten(tree)[0]


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0] if text else type(exc).__name__
