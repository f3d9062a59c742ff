"""Items of varying shape: which batch to plan for.

A dataset whose items differ in shape (text of several lengths padded per batch by the model
file's ``collate``, images of several sizes) forms batches of different sizes; the plan must
hold for the largest the data loader can form, not for whatever the first item is.

The shapes are found once per task, without loading the dataset twice, from the first of:

1. the model file's ``item_sizes(dataset) -> sequence``: per item, in dataset order, an int
   (a length) or a tuple of ints (``(H, W)``): the sizes that vary;
2. a Hugging Face style length column (``dataset.column_names`` holds ``"length"`` or
   ``"lengths"``; ``dataset["length"]`` is read, no item is);
3. a ``TensorDataset``: every item is a slice of the same tensors, so all are alike;
4. a look at ``PROBE_ITEMS`` items (seeded): all alike, the data is taken as fixed-shape (as
   before this module: no further cost); else a scan of every item up to ``SCAN_LIMIT`` and
   a seeded random sample of that many above it, with a progress bar and the coverage stated.

Per item the scan keeps the shapes of its tensors (and the lengths of its lists of numbers),
end to end, as one vector of sizes. A batch of items is assumed padded to the elementwise
maximum of its items' sizes (dynamic padding); :func:`check_collate` calls the collate on the
extreme items to confirm that its output grows so, and the plan falls back to collating the
planned items themselves when it does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from typing import SupportsInt, TypeAlias, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from .._types import Item

__all__ = ["ShapeProfile", "PlannedBatch", "profile_shapes", "planned_batch", "batch_quantiles", "largest_items",
           "POLICIES", "SCAN_LIMIT", "PROBE_ITEMS", "ItemSize", "dataset_length"]

ItemSize: TypeAlias = "SupportsInt | Iterable[SupportsInt]"
"""What ``item_sizes(dataset)`` gives per item: one size (a length), or several (``(H, W)``)."""

POLICIES = ("max", "p99")
"""Shape policies a user chooses: the worst batch the loader can form, or the 99th percentile
of the batches an epoch forms (a rare larger batch is left to OOM recovery)."""

SCAN_LIMIT = 50_000
"""Datasets up to this size are scanned item by item; larger ones by a seeded sample this big."""

PROBE_ITEMS = 32
"""Items looked at (seeded) before any scan: all alike means a fixed-shape dataset."""

SAMPLE_SEED = 0

_SIM_BATCHES = 2000
"""Random batches simulated for the distribution (median, p99) of batch shapes."""


@dataclass
class _ProfileCache:
    """What the planning functions below found for a profile, each kept by its arguments."""

    worst: dict[int, PlannedBatch] = field(default_factory=dict)
    quantiles: dict[tuple[int, int], dict[str, PlannedBatch]] = field(default_factory=dict)
    factors: dict[tuple[tuple[int, ...], int, int], float] = field(default_factory=dict)
    fits: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    by_volume: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class ShapeProfile:
    """The sizes of a dataset's items, as far as they vary."""

    n_items: int
    indices: np.ndarray
    """Dataset indices of the items whose sizes are known (all items, or a sample)."""
    sizes: np.ndarray
    """``(len(indices), d)`` int64: each known item's size vector."""
    source: str
    """item_sizes() | length column | TensorDataset | probe | scan."""
    coverage: str
    """What was looked at, in words ("all 5,000 items", "a random sample of …")."""
    varying: bool
    collate_pads: bool = True
    """The collate pads a batch to its largest item (checked on the extreme items)."""
    _cache: _ProfileCache = field(default_factory=_ProfileCache, repr=False)

    @property
    def varying_dims(self) -> np.ndarray:
        return np.flatnonzero(self.sizes.min(axis=0) != self.sizes.max(axis=0)) if len(self.sizes) else np.zeros(0, int)

    @property
    def groupable(self) -> bool:
        """Can the data be ordered by size (length-grouped batching)? Every item's size must
        be known, and batches must pad to their largest item."""
        return self.varying and self.collate_pads and len(self.indices) == self.n_items

    def describe(self) -> str:
        lo, hi = self.sizes.min(axis=0), self.sizes.max(axis=0)
        dims = self.varying_dims
        spans = ", ".join(f"{int(lo[i])}-{int(hi[i])}" for i in dims)
        return f"item sizes vary ({spans}; {self.source}, {self.coverage})"


@dataclass(frozen=True)
class PlannedBatch:
    """Which items make the batch a plan is made for: ``items`` set its padded size (the
    longest items together), ``fill`` holds items no larger, used for the rest of a batch."""

    label: str
    items: tuple[int, ...]
    padded: tuple[int, ...]
    """The padded size vector (elementwise max over ``items``)."""

    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.label, self.items)


# -- finding the shapes ----------------------------------------------------------------------

def size_vector(item: Item) -> list[int]:
    """An item's sizes, end to end: the shape of each tensor or array, the length of each
    list of numbers (token ids before collation), in the item's own order."""
    out: list[int] = []
    _walk(item, out)
    return out


def _walk(obj: object, out: list[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.extend(int(s) for s in obj.shape)
    elif isinstance(obj, np.ndarray):
        out.extend(int(s) for s in obj.shape)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _walk(obj[key], out)
    elif isinstance(obj, (list, tuple)):
        if obj and all(isinstance(x, (int, float, bool)) for x in obj):
            out.append(len(obj))
        else:
            for x in obj:
                _walk(x, out)
    # scalars and strings have no size that batching pads


def _as_matrix(rows: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    m = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        m[i, : len(r)] = r
    return m


def dataset_length(data: Dataset[Item]) -> int:
    """The length of a map-style dataset (``Dataset`` itself declares no ``__len__``)."""
    if not isinstance(data, Sized):
        raise TypeError(f"object of type {type(data).__name__!r} has no len()")
    return len(data)


def _size_row(size: ItemSize) -> list[int]:
    """One item's ``item_sizes()`` entry as a size vector."""
    ndim = getattr(size, "ndim", None)  # as np.ndim finds it
    if (np.asarray(size).ndim if ndim is None else ndim) == 0:
        return [int(cast(SupportsInt, size))]
    return [int(v) for v in cast(Iterable[SupportsInt], size)]


def profile_shapes(data: Dataset[Item], *, item_sizes: Callable[[Dataset[Item]], Sequence[ItemSize]] | None = None,
                   name: str = "train_data()") -> ShapeProfile:
    """The size profile of ``data`` (see the module docstring for the order of sources)."""
    from torch.utils.data import TensorDataset

    from .._errors import ModelFileError

    n = dataset_length(data)
    every = np.arange(n, dtype=np.int64)
    if item_sizes is not None:
        try:
            raw = list(item_sizes(data))
        except Exception as exc:  # noqa: BLE001 - the user's hook, reported with the fix
            raise ModelFileError(f"{name}: item_sizes(dataset) raised {type(exc).__name__}: {exc}; fix it") from None
        if len(raw) != n:
            raise ModelFileError(f"{name}: item_sizes(dataset) gave {len(raw)} sizes for {n} items; "
                                 "return one int or tuple of ints per item, in dataset order")
        rows = [_size_row(x) for x in raw]
        return _profile(n, every, _as_matrix(rows), "item_sizes()", f"all {n:,} items")
    columns = getattr(data, "column_names", None)
    if isinstance(columns, (list, tuple)):
        col = next((c for c in ("length", "lengths") if c in columns), None)
        if col is not None:
            values = np.asarray(data[col], dtype=np.int64).reshape(n, -1)
            return _profile(n, every, values, f"the {col!r} column", f"all {n:,} items")
    if isinstance(data, TensorDataset) or n == 0:
        return ShapeProfile(n, every[:1], np.zeros((min(n, 1), 0), np.int64), "TensorDataset",
                            "every item alike", varying=False)
    rng = np.random.default_rng(SAMPLE_SEED)
    probe = np.unique(np.concatenate([[0], rng.choice(n, size=min(n, PROBE_ITEMS), replace=False)]))
    probe_rows = [size_vector(data[int(i)]) for i in probe]
    if all(r == probe_rows[0] for r in probe_rows):
        return ShapeProfile(n, probe, _as_matrix(probe_rows), "probe",
                            f"{len(probe)} of {n:,} items alike", varying=False)
    if n <= SCAN_LIMIT:
        indices, coverage = every, f"all {n:,} items scanned"
    else:
        indices = np.sort(np.random.default_rng(SAMPLE_SEED).choice(n, size=SCAN_LIMIT, replace=False))
        coverage = (f"a random sample of {SCAN_LIMIT:,} of {n:,} items (seed {SAMPLE_SEED}); "
                    "define item_sizes(dataset) to cover all")
    from tqdm.auto import tqdm
    rows = [size_vector(data[int(i)]) for i in tqdm(indices.tolist(), desc="memplan: item shapes",
                                                     unit="item", disable=None, leave=False)]
    return _profile(n, indices, _as_matrix(rows), "scan", coverage)


def _profile(n: int, indices: np.ndarray, sizes: np.ndarray, source: str, coverage: str) -> ShapeProfile:
    varying = bool(len(sizes)) and bool((sizes.min(axis=0) != sizes.max(axis=0)).any())
    return ShapeProfile(n, indices, sizes, source, coverage, varying=varying)


# -- the batch to plan for --------------------------------------------------------------------

def _volume(v: np.ndarray) -> np.ndarray:
    """Padded elements per item of size vectors ``v`` (rows): the product of the sizes."""
    return np.prod(np.maximum(v, 1).astype(np.float64), axis=-1)


def worst_items(profile: ShapeProfile, k: int) -> PlannedBatch:
    """At most ``k`` items whose padded batch is the largest (greedy: each next item grows
    the padded volume most; it stops once no item grows it). With one varying size, the
    longest item; with (H, W), the tallest and the widest when ``k >= 2``."""
    key = min(k, len(profile.sizes))
    if key in profile._cache.worst:
        return profile._cache.worst[key]
    sizes = profile.sizes
    own = _volume(sizes)
    cur = np.zeros(sizes.shape[1], dtype=np.int64)
    chosen: list[int] = []
    while len(chosen) < k:
        grown = _volume(np.maximum(cur, sizes))
        score = grown * (1 + 1e-9) + own * 1e-12  # ties broken by the item's own size
        if chosen:
            score[chosen] = -1
        j = int(np.argmax(score))
        if chosen and grown[j] <= _volume(cur):
            break
        chosen.append(j)
        cur = np.maximum(cur, sizes[j])
    planned = PlannedBatch("max", tuple(int(profile.indices[j]) for j in chosen), tuple(int(x) for x in cur))
    profile._cache.worst[key] = planned
    return planned


def _simulated_batches(profile: ShapeProfile, b: int, grouped: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Padded size vectors of random batches of ``b`` known items (seeded permutations cut
    into batches, as an epoch's sampler does), and each batch's positions into the profile.
    ``grouped``: the global batch a length-grouped order sorts by (0: a random order)."""
    m = len(profile.sizes)
    b = max(1, min(b, m))
    per_epoch = m // b
    epochs = max(1, min(math.ceil(_SIM_BATCHES / max(per_epoch, 1)), max(1, 4_000_000 // max(m, 1))))
    rng = np.random.default_rng(SAMPLE_SEED)
    batches = []
    for _ in range(epochs):
        perm = rng.permutation(m)
        if grouped:
            perm = grouped_order(profile.sizes, perm, grouped)
        batches.append(perm[: per_epoch * b].reshape(per_epoch, b))
    pos = np.concatenate(batches)
    return profile.sizes[pos].max(axis=1), pos


def batch_quantiles(profile: ShapeProfile, b: int, *, grouped: int = 0) -> dict[str, PlannedBatch]:
    """The median and 99th-percentile batch (by padded volume) of random batches of ``b``
    items, and the worst batch the loader can form (``max``)."""
    key = (b, grouped)
    if key in profile._cache.quantiles:
        return profile._cache.quantiles[key]
    padded, pos = _simulated_batches(profile, b, grouped)
    vol = _volume(padded)
    order = np.argsort(vol, kind="stable")
    out: dict[str, PlannedBatch] = {}
    for label, q in (("median", 0.5), ("p99", 0.99)):
        row = int(order[min(len(order) - 1, int(math.ceil(q * len(order))) - 1)])
        members = pos[row]
        # The members that set the padded size: the longest in each dimension.
        setters = sorted({int(members[int(np.argmax(profile.sizes[members, d]))])
                          for d in profile.varying_dims.tolist()} or {int(members[0])})
        items = tuple(int(profile.indices[j]) for j in setters[: b])
        out[label] = PlannedBatch(label, items, tuple(int(x) for x in padded[row]))
    out["max"] = worst_items(profile, b)
    profile._cache.quantiles[key] = out
    return out


def planned_batch(profile: ShapeProfile, policy: str, b: int) -> PlannedBatch:
    """The batch of ``b`` items that ``policy`` plans for."""
    if policy == "max":
        return worst_items(profile, b)
    if policy in ("p99", "median"):
        return batch_quantiles(profile, b)[policy]
    from .._errors import ConfigError
    raise ConfigError(f"unknown shape policy {policy!r}; use one of {', '.join(POLICIES)}")


def padding_factor(profile: ShapeProfile, planned: PlannedBatch, b: int, grouped: int = 0) -> float:
    """The mean padded volume of an epoch's batches of ``b`` (random, or length-grouped by
    global batches of ``grouped``) over the planned batch's: the share of the planned batch's
    step time an average step takes, to first order (attention's quadratic part aside)."""
    key = (planned.padded, b, grouped)
    if key not in profile._cache.factors:
        padded, _ = _simulated_batches(profile, b, grouped)
        profile._cache.factors[key] = float(_volume(padded).mean() / _volume(np.asarray(planned.padded)))
    return profile._cache.factors[key]


def fill_items(profile: ShapeProfile, planned: PlannedBatch, count: int, offset: int) -> list[int]:
    """``count`` items (cycled from ``offset``) no larger than ``planned``'s padded size in any
    dimension: the rest of a batch, which padding leaves at that size."""
    fits = profile._cache.fits.get(planned.padded)
    if fits is None:
        ok = (profile.sizes <= np.asarray(planned.padded)).all(axis=1)
        fits = profile.indices[ok]
        profile._cache.fits[planned.padded] = fits
    if count <= 0 or len(fits) == 0:
        return []
    start = offset % len(fits)
    return [int(fits[(start + i) % len(fits)]) for i in range(count)]


def largest_items(profile: ShapeProfile, count: int) -> list[int]:
    """The ``count`` largest known items, largest first (cycled when there are fewer): the
    worst batch of a collate that does not pad (packing grows with every item)."""
    order = profile._cache.by_volume
    if order is None:
        order = profile.indices[np.argsort(-_volume(profile.sizes), kind="stable")]
        profile._cache.by_volume = order
    return [int(order[i % len(order)]) for i in range(count)]


def grouped_order(sizes: np.ndarray, perm: np.ndarray, b: int, *, mega: int = 50) -> np.ndarray:
    """Length-grouped order (as Hugging Face's ``LengthGroupedSampler``): a random
    permutation cut into mega-batches of ``mega * b`` items, each sorted longest first, so
    that a batch holds items of similar size and pads little. The longest mega-batch's
    first batch goes first, so the worst batch is met (and any OOM seen) at once."""
    vol = _volume(sizes)
    chunk = max(b, mega * b)
    parts = [perm[i:i + chunk] for i in range(0, len(perm), chunk)]
    parts = [p[np.argsort(-vol[p], kind="stable")] for p in parts]
    out = np.concatenate(parts) if parts else perm
    # Bring the batch holding the longest item to the front.
    n_batches = max(1, len(out) // b)
    heads = [vol[out[i * b:(i + 1) * b]].max() for i in range(n_batches)]
    top = int(np.argmax(heads))
    if top:
        first = out[top * b:(top + 1) * b].copy()
        out = np.concatenate([first, out[: top * b], out[(top + 1) * b:]])
    return out
