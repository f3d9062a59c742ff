"""FSDP2 sharding inside the simulated ranks (estimators.tracing._simulated_ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from estimators import TrainConfig
from estimators.tracing._simulated_ranks import _Chunks, parallelize_simulated, simulated_ranks


@pytest.mark.parametrize("shape", [(0, 3), (0,), (1, 5), (7, 3), (8, 2), (255, 4), (256, 4), (257, 4), (3, 9)])
def test_the_pieces_made_when_asked_are_fsdp2s_own(shape: tuple[int, ...]) -> None:
    # FSDP2 keeps piece `rank` and reads piece 0's size: each must be the very view (shape,
    # strides, offset) its own _chunk_with_empty gives, for sizes that leave pieces empty too.
    t = torch.randn(*shape)
    for n in (1, 2, 3, 4, 8, 256, 512):
        for dim in range(len(shape)):
            theirs, ours = _chunk_with_empty(t, n, dim), _Chunks(t, n, dim)
            assert len(ours) == len(theirs) == n
            for i in (*range(min(n, 9)), n - 1, -1):
                x, y = theirs[i], ours[i]
                assert (x.shape, x.stride(), x.storage_offset()) == (y.shape, y.stride(), y.storage_offset())


def test_fsdp2_shards_as_it_does_unpatched() -> None:
    # The same shards, and FSDP2's own function back in place afterwards.
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))

    config = TrainConfig(micro_batch_size=1, strategy="fsdp", world_size=4)
    with simulated_ranks(4):
        sharded = parallelize_simulated(model(), config)
        shapes = [p.to_local().shape for p in sharded.parameters()]
    assert _fsdp_param._chunk_with_empty is _chunk_with_empty
    # 7 rows over 4 ranks: 2 a rank (rank 0's), 5 columns' bias: 2.
    assert shapes == [torch.Size([2, 5]), torch.Size([2]), torch.Size([1, 7]), torch.Size([1])]
