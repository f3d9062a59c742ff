"""The data order: a pure function of ``(seed, epoch)``, so that a run resumes at any window.

Each epoch is a permutation drawn from a generator seeded with both (``DistributedSampler``'s
permutation), cut into *windows* of one global batch -- one optimizer step -- and each window
into this rank's micro-batches. A run resumes by recomputing the permutation and starting at
the saved sample offset, even with another micro-batch size of the same global batch (what OOM
recovery needs); ``drop_last`` ends each epoch at its last whole window. With ``W`` ranks the
last ``n % W`` items are dropped and rank ``r`` trains positions ``r::W`` of each window.

:class:`TrainData` builds the datasets' loaders and reads the windows from them, one
micro-batch at a time.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from estimators import ConfigError, ModelFileError, grouped_order

if TYPE_CHECKING:
    from estimators import Task, TrainConfig

    from ._options import TrainOptions

__all__ = ["epoch_permutation", "epoch_items"]

Batch = Any


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training items in ``epoch``: a pure function of ``(seed, epoch)``,
    and the very permutation ``DistributedSampler(shuffle=True, seed=seed)`` draws after
    ``set_epoch(epoch)`` -- so that a distributed run and a single-process run see one order."""
    g = torch.Generator().manual_seed(int(seed) + int(epoch))
    return torch.randperm(n, generator=g)


def _epoch_seed(seed: int, epoch: int) -> int:
    # The DataLoader's worker base seed; any injective-enough mix of (seed, epoch) works.
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + 12_345) % (2**63 - 1)


def _window_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of a distributed window: a pure function of (seed, step, rank), so
    that every rank draws its own dropout masks, a replayed window draws the same ones, and no
    checkpoint needs every rank's RNG state."""
    return (int(seed) * 1_000_003 + int(step) * 104_729 + int(rank) * 15_485_863 + 7) % (2**63 - 1)


def epoch_items(n: int, world_size: int) -> int:
    """Items of an epoch that are trained on: all of them on one process; with ``world_size``
    ranks the last ``n % world_size`` of the permutation are dropped, as
    ``DistributedSampler(drop_last=True)`` does, so that every rank has as many samples in every
    window (and every rank runs as many forward passes: none waits alone in a collective)."""
    return n if world_size == 1 else n - n % world_size


class _EpochBatches:
    """DataLoader batch sampler: this rank's micro-batches of one epoch from a sample offset on.

    The epoch's permutation is cut into windows of ``global_batch`` consecutive items (the last
    one may be short); rank ``r`` of ``world_size`` takes the window's positions ``r::world_size``
    -- exactly the items ``DistributedSampler`` gives it -- and cuts them into micro-batches. With
    one process this is the window itself. Set the position with :meth:`set_position` *before*
    each ``iter(loader)``; the sampler is read in the main process, so this works with
    persistent workers too.
    """

    def __init__(self, n: int, micro_batch_size: int, seed: int, *, global_batch: int,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False) -> None:
        self.n, self.micro, self.seed = n, micro_batch_size, seed
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.n_epoch = epoch_items(n, world_size)
        if drop_last:
            # Whole windows only: the permutation's tail after the last full global batch rests.
            self.n_epoch -= self.n_epoch % global_batch
        self.slices: list[list[int]] = []
        self.sizes: Any = None
        """Every item's size vector (``Task.shapes().sizes``) for a length-grouped order."""

    def windows(self, epoch: int, start: int) -> list[_Window]:
        """The windows of ``epoch`` from sample offset ``start`` on, with this rank's share."""
        order = epoch_permutation(self.n, self.seed, epoch)
        if self.sizes is not None:
            # Length-grouped: the same permutation, sorted by size within mega-batches of 50
            # global batches (the longest batch first); a pure function of (seed, epoch), so
            # a resumed run meets the same windows.
            order = torch.as_tensor(grouped_order(self.sizes, order.numpy(), self.global_batch))
        indices: list[int] = order.tolist()
        out: list[_Window] = []
        for begin in range(start, self.n_epoch, self.global_batch):
            chunk = indices[begin:min(begin + self.global_batch, self.n_epoch)]
            mine = chunk[self.rank::self.world_size]
            micro = [mine[i:i + self.micro] for i in range(0, len(mine), self.micro)]
            out.append(_Window(epoch=epoch, start=begin, micro_indices=micro, n_total=len(chunk)))
        return out

    def set_position(self, epoch: int, start: int) -> list[_Window]:
        windows = self.windows(epoch, start)
        self.slices = [m for w in windows for m in w.micro_indices]
        return windows

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.slices)

    def __len__(self) -> int:
        return len(self.slices)


@dataclass(frozen=True)
class _Window:
    """One optimizer step's worth of data: the dataset indices of each of this rank's micro-batches.

    A window is the unit that OOM recovery replays: its indices identify the samples, so it can
    be re-cut into micro-batches of another size (same global batch) and run again.
    """

    epoch: int
    start: int
    """Offset of the window's first sample in the epoch's permutation."""
    micro_indices: list[list[int]]
    n_total: int = -1
    """Samples of the window over all ranks (-1: this rank's, i.e. one process)."""

    @property
    def n_items(self) -> int:
        """This rank's samples."""
        return sum(len(m) for m in self.micro_indices)

    @property
    def global_items(self) -> int:
        return self.n_total if self.n_total >= 0 else self.n_items

    @property
    def end(self) -> int:
        return self.start + self.global_items

    def recut(self, micro_batch_size: int) -> _Window:
        """The same samples in micro-batches of another size (same global batch)."""
        flat = [i for m in self.micro_indices for i in m]
        micro = [flat[k:k + micro_batch_size] for k in range(0, len(flat), micro_batch_size)]
        return _Window(epoch=self.epoch, start=self.start, micro_indices=micro, n_total=self.n_total)


def _seed_torch(seed: int) -> None:
    torch.manual_seed(seed)  # seeds every CUDA device too


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class TrainData:
    """The run's datasets, loaders and windows, for this rank.

    Made first and outside the memory guard: the dataset is not part of the training step's
    memory (on a GPU it is not even on the device), and dataset code may draw random numbers --
    whether it already ran in this process (the estimator caches datasets) must not change the
    model's initialisation.
    """

    def __init__(self, task: Task, config: TrainConfig, options: TrainOptions, *, device: torch.device,
                 rank: int, world_size: int) -> None:
        self.task, self.options, self.device = task, options, device
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size = config.micro_batch_size
        opts = options
        dataset = task.dataset()
        assert dataset is not None
        # (torch's Dataset declares no __len__; Task.dataset() checked that this one has it.)
        self.n_train = len(dataset)  # type: ignore[arg-type]
        if self.n_train == 0:
            raise ModelFileError(f"{task.name}: train_data() is empty; it must hold at least one item")
        if self.n_train < self.world_size:
            raise ConfigError(f"{task.name}: {self.n_train} training items cannot be shared by {self.world_size} ranks")
        if config.global_batch > self.n_train:
            # Each step would take every item, in batches smaller than the configuration's: not
            # the step that was planned (nor its memory), and not the global batch asked for.
            raise ConfigError(
                f"the configuration's global batch of {config.global_batch} ({config.describe()}) is larger than "
                f"{task.name}'s {self.n_train} training items; plan for at most {self.n_train} "
                f"(memplan plan --global-batch {self.n_train})")
        self.sampler = _EpochBatches(self.n_train, config.micro_batch_size, opts.seed,
                                     global_batch=config.global_batch, rank=self.rank, world_size=self.world_size,
                                     # A pipeline step runs whole windows only (its schedule's micro-batches).
                                     drop_last=opts.drop_last or config.pp > 1)
        if self.sampler.n_epoch == 0:
            raise ConfigError(
                f"TrainOptions.drop_last leaves no step: {task.name} has {self.n_train} training items, fewer than "
                f"one global batch of {config.global_batch}; set drop_last=False or use a smaller global batch")
        if config.length_grouped:
            shapes = task.shapes()
            if not shapes.groupable:
                raise ConfigError(
                    f"{task.name}: length-grouped batching needs every item's size and batches padded to "
                    "their longest item; define item_sizes(dataset) in the model file, or train without it")
            self.sampler.sizes = shapes.sizes
        # The loader's own generator: DataLoader draws its worker base seed from it at every
        # iter(); drawing from the global RNG instead would shift dropout after a resume.
        self._loader_generator = torch.Generator()
        self.train_loader = self._make_loader(dataset, batch_sampler=self.sampler)
        self.val_loader = self._make_val_loader()

    @property
    def n_epoch(self) -> int:
        """Items an epoch trains on."""
        return self.sampler.n_epoch

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Cut the windows ahead (and validation batches) into micro-batches of another size
        (an OOM recovery's rung; same global batch)."""
        if micro_batch_size == self.micro_batch_size:
            return
        self.micro_batch_size = self.sampler.micro = micro_batch_size
        if self.val_loader is not None:
            _stop_workers(self.val_loader)
            self.val_loader = self._val_loader_for(self.val_loader.dataset)

    def _num_workers(self, dataset: Dataset) -> int:
        if self.options.num_workers is not None:
            return self.options.num_workers
        if isinstance(dataset, TensorDataset):
            return 0
        return min(2, max(0, (os.cpu_count() or 1) - 1))

    def _make_loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        opts = self.options
        workers = self._num_workers(dataset)
        persistent = workers > 0 if opts.persistent_workers is None else opts.persistent_workers
        if persistent and workers == 0:
            raise ConfigError("TrainOptions.persistent_workers needs worker processes, and this dataset gets "
                              "none by default; set num_workers >= 1")
        return DataLoader(
            dataset,
            collate_fn=self.task.collate,
            num_workers=workers,
            # page-locked host memory: asynchronous copies to the GPU
            pin_memory=self.device.type == "cuda" if opts.pin_memory is None else opts.pin_memory,
            persistent_workers=persistent,  # no worker start-up cost at every epoch
            prefetch_factor=opts.prefetch_factor if workers > 0 else None,
            **{"generator": self._loader_generator, **kwargs},
        )

    def _make_val_loader(self) -> DataLoader | None:
        if self.task.val_data is None:
            return None
        try:
            data = self.task.val_data()
        except Exception as exc:  # noqa: BLE001 - the user's code, reported with the fix
            raise ModelFileError(f"{self.task.name}: val_data() raised {type(exc).__name__}: {exc}; fix the dataset code") from None
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise ModelFileError(
                f"{self.task.name}: val_data() returned {type(data).__name__}; return a map-style Dataset"
            )
        if len(data) == 0:
            return None
        return self._val_loader_for(data)

    def _val_loader_for(self, data: Dataset) -> DataLoader:
        # Validation needs no gradients, so the training micro-batch always fits. Its own
        # generator: evaluating must not move anything the training data order depends on.
        # Distributed: rank r evaluates items r::W (every item once; sums are all-reduced).
        # (torch's Dataset declares no __len__; _make_val_loader checked that this one has it.)
        sampler = None if self.world_size == 1 else list(range(self.rank, len(data), self.world_size))  # type: ignore[arg-type]
        return self._make_loader(
            data,
            batch_size=self.micro_batch_size,
            shuffle=False,
            drop_last=False,
            sampler=sampler,
            generator=torch.Generator().manual_seed(self.options.seed),
        )

    def windows(self, epoch: int, start: int) -> Generator[tuple[_Window, Iterator[Batch]], None, None]:
        """Windows from the data position ``(epoch, start)`` on, across epochs, without end.

        Each comes with an iterator over its collated micro-batches, read lazily from the
        DataLoader: only one micro-batch is held at a time, as the estimator assumes.
        """
        while True:
            windows = self.sampler.set_position(epoch, start)
            self._loader_generator.manual_seed(_epoch_seed(self.options.seed, epoch) + self.rank)
            loader_iter = iter(self.train_loader)
            for window in windows:
                yield window, itertools.islice(loader_iter, len(window.micro_indices))
            del loader_iter
            epoch, start = epoch + 1, 0

    def close(self) -> None:
        """Stop the loaders' worker processes now. A persistent iterator (or one a run left
        half-read at ``max_steps``) otherwise keeps them until the garbage collector finds
        the loader, whose shutdown then waits out the workers' join timeout (5 s each time,
        measured) in whatever code runs next."""
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                _stop_workers(loader)

    def collate_window(self, window: _Window) -> Iterator[Batch]:
        """The window's micro-batches straight from the dataset, one at a time: for replaying a
        window (``window.recut(new_micro)``) without the DataLoader; a plain run never does."""
        dataset = self.task.dataset()
        assert dataset is not None  # loaded by __init__ (and cached by the task)
        for indices in window.micro_indices:
            yield self.task.collate([dataset[i] for i in indices])


def _stop_workers(loader: DataLoader) -> None:
    """End ``loader``'s persistent iterator and its worker processes (torch's own teardown)."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    if iterator is not None:
        loader._iterator = None
