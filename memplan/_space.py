"""The configuration space of a search, built from the model, the device and the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from estimators import ConfigError, TrainConfig
from estimators._config import Precision

__all__ = ["SearchSpace", "build_space"]

MAX_KERNEL_BATCH = 65535
"""Some kernels (cuDNN grid dimensions, for one) refuse batch dimensions above this."""


@dataclass(frozen=True)
class SearchSpace:
    micro_batch_sizes: tuple[int, ...]
    precisions: tuple[Precision, ...]
    checkpoint_segments: tuple[int, ...]
    global_batch: int | None
    """Fixed global batch (micro × accumulation × world); None means the batch is searched."""
    world_size: int = 1

    def accum_for(self, micro: int) -> int:
        if self.global_batch is None:
            return 1  # accumulation only repeats work when the global batch is free
        return self.global_batch // (micro * self.world_size)

    def config(self, micro: int, precision: str, segments: int) -> TrainConfig:
        return TrainConfig(
            micro_batch_size=micro, grad_accum_steps=self.accum_for(micro),
            precision=precision, checkpoint_segments=segments,
        )

    def __len__(self) -> int:
        return len(self.micro_batch_sizes) * len(self.precisions) * len(self.checkpoint_segments)

    def __iter__(self) -> Iterator[TrainConfig]:
        for m in self.micro_batch_sizes:
            for p in self.precisions:
                for s in self.checkpoint_segments:
                    yield self.config(m, p, s)

    def smallest(self) -> list[TrainConfig]:
        """Corners most likely to need the least memory (the nearest miss when nothing fits)."""
        m = self.micro_batch_sizes[0]
        s = self.checkpoint_segments[-1]
        return [self.config(m, p, s) for p in self.precisions]


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _segment_choices(max_segments: int) -> tuple[int, ...]:
    # 0, powers of two and every block: the memory/time curve is smooth in between.
    choices = {0, max_segments} | {v for v in _powers_of_two(max_segments)}
    return tuple(sorted(choices))


def build_space(
    *,
    dataset_size: int | None,
    global_batch: int | None,
    precisions: tuple[Precision, ...],
    max_segments: int,
    max_micro_batch: int | None = None,
    world_size: int = 1,
) -> SearchSpace:
    limit = MAX_KERNEL_BATCH
    if dataset_size:
        limit = min(limit, dataset_size)
    if max_micro_batch:
        limit = min(limit, max_micro_batch)
    if global_batch is not None:
        if global_batch < 1:
            raise ConfigError(f"--global-batch must be >= 1, got {global_batch}")
        per_rank, rem = divmod(global_batch, world_size)
        if rem:
            raise ConfigError(f"global batch {global_batch} does not divide over {world_size} processes; pick a multiple of {world_size}")
        micros = [d for d in range(1, min(per_rank, limit) + 1) if per_rank % d == 0]
    else:
        micros = _powers_of_two(limit)
    if not micros:
        raise ConfigError("no micro-batch size fits the dataset; check train_data() and --global-batch")
    return SearchSpace(tuple(micros), precisions, _segment_choices(max_segments), global_batch, world_size)
