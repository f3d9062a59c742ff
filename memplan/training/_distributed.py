"""What the ranks of a DDP/FSDP2 run agree on: one flag, the largest value. One process agrees
with itself without a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__: list[str] = []


class RankAgreement:
    """Collectives over the ``world_size`` ranks of a run (``strategy`` other than ``"single"``)."""

    def __init__(self, rank: int, world_size: int, *, strategy: str, device: torch.device,
                 replicas: int | None = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.replicas = world_size if replicas is None else replicas
        """Data-parallel replicas: ``world_size`` over the tensor-parallel degree (whose ranks
        share each batch)."""
        self.distributed = world_size > 1 or strategy != "single"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs and writes files."""
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where small tensors for collectives live: gloo reduces CPU tensors, NCCL CUDA ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on every rank (one process: ``flag``)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def any_stop(self, stop: bool) -> bool:
        """Stop at this window boundary? All ranks stop together when any got SIGINT/SIGTERM, so
        that they write one checkpoint and none waits alone in the next step's collectives."""
        return not self.agree(not stop)

    def max_over_ranks(self, value: int | None) -> int | None:
        if not self.distributed:
            return value
        t = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if int(t.item()) < 0 else int(t.item())
