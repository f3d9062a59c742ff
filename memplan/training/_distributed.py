"""What the ranks of a DDP/FSDP2 run agree on: one flag, the largest value. One process agrees
with itself without a collective. A part of :class:`~memplan.training.Trainer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from estimators import TrainConfig

__all__: list[str] = []


class _RankAgreement:
    """Collectives over ``world_size`` ranks (reads ``rank``, ``world_size``, ``config``, ``device``)."""

    # Set by the Trainer and its other parts; annotations only (nothing at runtime), for the type checker.
    rank: int
    world_size: int
    config: TrainConfig
    device: torch.device
    _stop_signal: str | None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.config.strategy != "single"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs and writes files."""
        return self.rank == 0

    @property
    def _comm_device(self) -> torch.device:
        """Where small tensors for collectives live: gloo reduces CPU tensors, NCCL CUDA ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on every rank (one process: ``flag``)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _agree_stop(self) -> bool:
        """Stop at this window boundary? All ranks stop together when any got SIGINT/SIGTERM, so
        that they write one checkpoint and none waits alone in the next step's collectives."""
        return not self._agree(self._stop_signal is None)

    def _max_over_ranks(self, value: int | None) -> int | None:
        if not self.distributed:
            return value
        t = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if int(t.item()) < 0 else int(t.item())
