"""Tensor-parallel layouts in the search: the degrees a machine's devices and the model allow,
tried when nothing fits with data parallelism alone, named in the plan's table."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import ConfigError, Task, TrainConfig
from memplan import search
from memplan.planning._space import Layout, build_space, layout_key, layouts_for, tensor_parallel_layouts


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d, 4 * d)
        self.down_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    """7.8M parameters, nearly all in the split linears: fp32 states of 125 MB."""

    def __init__(self, d: int = 700) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _task() -> Task:
    return Task(name="mlp", build_model=Net, sample_fn=lambda b: (torch.randn(b, 700), torch.randint(0, 10, (b,))))


def _space(gpus: int, nodes: int = 1):
    return build_space(dataset_size=None, global_batch=64, precisions=("fp32",), max_segments=2,
                       layouts=layouts_for(gpus, nodes))


def test_the_degrees_are_those_of_one_machine_that_the_model_divides() -> None:
    ns: dict[str, object] = {}
    exec(ATTENTION_LM_SOURCE, ns)
    model = ns["AttentionLM"]()  # type: ignore[operator]  # 4 heads: tp 8 does not divide them
    task = Task(name="lm", build_model=lambda: model)
    layouts, why = tensor_parallel_layouts(_space(8, 2), task, model)
    # Each degree plain and sequence parallel (norms alone between the split pairs).
    assert layouts == (Layout("fsdp", 8, 2, 2), Layout("fsdp", 8, 2, 2, True), Layout("fsdp", 4, 2, 4),
                       Layout("fsdp", 4, 2, 4, True)) and why is None
    assert [layout.key for layout in layouts] == ["fsdp x8 x tp 2 on 2 nodes", "fsdp x8 x tp 2 sp on 2 nodes",
                                                  "fsdp x4 x tp 4 on 2 nodes", "fsdp x4 x tp 4 sp on 2 nodes"]
    layouts, _ = tensor_parallel_layouts(_space(4), task, model)
    assert [layout.key for layout in layouts] == ["fsdp x2 x tp 2", "fsdp x2 x tp 2 sp", "tp 4", "tp 4 sp"]
    # A block with a module between its pairs that is not a norm: plain tensor parallelism only.
    for block in model.layers:
        block.mlp_norm = nn.Conv1d(64, 64, 1)
    layouts, _ = tensor_parallel_layouts(_space(4), task, model)
    assert [layout.key for layout in layouts] == ["fsdp x2 x tp 2", "tp 4"]
    assert tensor_parallel_layouts(_space(1), task, model) == ((), None)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    layouts, why = tensor_parallel_layouts(_space(2), Task(name="plain", build_model=lambda: plain), plain)
    assert layouts == () and why is not None and "found nothing to split" in why
    assert layout_key(TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=4, tp=2)) == "fsdp x4 x tp 2"
    assert layout_key(TrainConfig(micro_batch_size=2, tp=2, sequence_parallel=True)) == "tp 2 sp"


def test_tensor_parallelism_is_planned_when_data_parallelism_alone_does_not_fit() -> None:
    # Two devices, fp32: DDP holds all 125 MB of states, FSDP2 gathers a whole block (31 MB of
    # weights, then its gradients) on top of its half; tp 2 holds half of everything, gathers
    # nothing.
    plan = search(_task(), vram="110MB", device="cpu", gpus=2, global_batch=4, probe_top=0, trials=20,
                  precisions=["fp32"])
    best = plan.best.config
    assert (best.tp, best.strategy, best.ranks) == (2, "single", 2)
    assert best.micro_batch_size * best.grad_accum_steps == 4  # one replica: the whole global batch
    assert any("searched again with" in n and "tp 2" in n for n in plan.notes), plan.notes
    assert " tp 2 " in plan.table()
    assert plan.best.predicted.peak_bytes <= 110e6 * 0.9
    # Its blocks hold no norm between the pairs, so the sequence-parallel layout was tried too,
    # and its traced step refused it: these hidden states have no sequence to shard.
    refused = [r for c, r in plan.failures.items() if c.sequence_parallel]
    assert refused and all("not (batch, sequence, ...)" in r for r in refused), plan.failures
    # The tools' exports would train the whole model on each device: refused, with the way to train it.
    from memplan.integrations._plan_facts import layout

    with pytest.raises(ConfigError, match=r"cannot express; train it with memplan train MODEL\.py --plan plan\.json "
                                          r"--nproc 2"):
        layout(plan)


def test_several_nodes_search_hsdp_beside_ddp_and_fsdp() -> None:
    layouts = layouts_for(4, 2)
    assert [layout.key for layout in layouts] == ["ddp x8 on 2 nodes", "fsdp x8 on 2 nodes", "hsdp 2 x 4 on 2 nodes"]
    config = _space(4, 2).config(2, "fp32", 0, layouts[2])
    assert (config.strategy, config.world_size, config.dp_replicate, config.shard_size) == ("fsdp", 8, 2, 4)
    assert config.describe().endswith("fp32, hsdp 2 x 4 over 2 nodes") and layout_key(config) == layouts[2].key
    # One node, or one device per node: nothing to replicate across or to shard within.
    assert [layout.key for layout in layouts_for(8)] == ["ddp x8", "fsdp x8"]
    with pytest.raises(ConfigError, match="strategy hsdp shards within each node and replicates across nodes"):
        layouts_for(8, 1, ["hsdp"])
