"""Pipeline parallelism's configuration, its cut of a model into stages and what it refuses."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from estimators import ConfigError, TrainConfig, load_task
from estimators.runtime._pipeline import _pass_skips_through, build_pipeline, stage_cuts, traced_ranks
from estimators.tracing._recorder import Category
from estimators.tracing._simulated_ranks import simulated_ranks
from estimators.tracing._trace import trace_step

MASKED_LM_SOURCE = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x, mask):
        return x + self.fc(self.norm(x)) * mask


class MaskedLM(nn.Module):
    # Every block takes the mask the forward makes before them: a value the later stages get
    # from the first.
    def __init__(self, layers=8, d=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x, mask = self.emb(idx), (idx > 0).float()[..., None]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def model():
    return MaskedLM()


def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (64, 13), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])
"""

_NS: dict[str, object] = {}
exec(MASKED_LM_SOURCE, _NS)
_MaskedLM: type[nn.Module] = _NS["MaskedLM"]  # type: ignore[assignment]


def test_stage_cuts_balance_the_blocks_and_keep_one_in_each_stage() -> None:
    assert stage_cuts([1] * 8, 4) == [2, 4, 6]
    assert stage_cuts([1] * 8, 8) == [1, 2, 3, 4, 5, 6, 7]
    # A heavy block gets a stage to itself.
    assert stage_cuts([1, 1, 1, 9, 1, 1], 2) == [3]
    assert stage_cuts([1] * 3, 2) in ([1], [2])
    with pytest.raises(ConfigError, match="4 pipeline stages need at least 4 blocks"):
        stage_cuts([1] * 3, 4)
    assert traced_ranks(2) == (0, 1) and traced_ranks(8) == (0, 4, 7) and traced_ranks(3) == (0, 1, 2)


def test_the_configuration_holds_a_pipeline_and_refuses_what_it_does_not_run() -> None:
    config = TrainConfig(micro_batch_size=4, pp=4, pp_microbatches=8)
    assert config.ranks == 4 and config.global_batch == 32 and config.micro_batches == 8
    assert "pp 4 1f1b over 8 micro-batches" in config.describe()
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "pp" not in TrainConfig(micro_batch_size=4).to_dict()  # written as before without a pipeline
    for changes, message in [
        ({"pp_microbatches": 2}, "needs at least as many micro-batches as stages"),
        ({"pp_schedule": "interleaved-1f1b", "pp_microbatches": 6}, "multiple of 4"),
        ({"grad_accum_steps": 2}, "set grad_accum_steps=1 and pp_microbatches=16"),
        ({"strategy": "fsdp", "world_size": 2}, "not combined with data parallelism"),
        ({"tp": 2}, "not combined with tp 2"),
        ({"precision": "fp16-mixed"}, "not combined with fp16-mixed"),
        ({"pp_schedule": "zb"}, "unknown pp_schedule 'zb'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config.replace(**changes)
    with pytest.raises(ConfigError, match="pp_microbatches 4 are a pipeline's"):
        TrainConfig(micro_batch_size=4, pp_microbatches=4)
    # GPipe runs any number of micro-batches.
    assert TrainConfig(micro_batch_size=4, pp=4, pp_schedule="gpipe", pp_microbatches=1).global_batch == 4


@pytest.mark.parametrize("stages", [3, 4])
def test_a_value_every_block_takes_is_passed_on_through_the_stages_between(stages: int) -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = _MaskedLM()
    idx = torch.randint(0, 32, (2, 12))
    cuts = stage_cuts([1] * 8, stages)
    pipe = pipeline(model, mb_args=(idx,), split_spec={f"blocks.{c}": SplitPoint.BEGINNING for c in cuts})
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]

    def producers(call: torch.fx.Node) -> set[int]:
        out = set()
        for arg in call.args:
            while arg.op == "call_function" and arg.target is operator.getitem:
                arg = arg.args[0]
            out.add(calls.index(arg) if arg in calls else -1)
        return out

    assert any(min(producers(c)) < i - 1 for i, c in enumerate(calls))  # the mask skips stages
    _pass_skips_through(pipe)
    for i, call in enumerate(calls):
        assert producers(call) == {i - 1}, (i, producers(call))
    # The stages, run one after the other on the same weights, compute the model's output.
    x = (idx,)
    for i in range(stages):
        out = pipe.split_gm.get_submodule(str(calls[i].target))(*x)
        x = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(x[0], model(idx))


def test_fake_traces_at_four_and_eight_stages_hold_less_per_rank(write_model) -> None:
    task = load_task(write_model(MASKED_LM_SOURCE))
    params = {}
    for pp in (2, 4, 8):
        config = TrainConfig(micro_batch_size=2, pp=pp, pp_microbatches=pp)
        trace = trace_step(task, config, stage=pp - 1)
        params[pp] = int(trace.alloc_bytes[trace.alloc_category == Category.PARAMS].sum())  # the stage's own
        assert "pipeline: traced stages' peaks rank 0" in trace_step(task, config).notes[-1]
    assert params[2] > params[4] > params[8]


def test_a_weight_two_stages_would_hold_is_refused() -> None:
    class Tied(_MaskedLM):  # type: ignore[misc, valid-type]
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x, mask = self.emb(idx), (idx > 0).float()[..., None]
            for block in self.blocks:
                x = block(x, mask)
            return F.linear(x, self.emb.weight)  # the head reads the embedding's weight

    config = TrainConfig(micro_batch_size=2, pp=2, pp_microbatches=2)
    with simulated_ranks(2):
        with pytest.raises(ConfigError, match="emb.weight is used by pipeline stages 0 and 1"):
            build_pipeline(Tied(), config, torch.randint(0, 32, (2, 12)), finder=None,
                           device=torch.device("cpu"), rank=0)
        tied = _MaskedLM()
        tied.head.weight = tied.emb.weight
        with pytest.raises(ConfigError, match="parameter emb.weight is also head.weight"):
            build_pipeline(tied, config, torch.randint(0, 32, (2, 12)), finder=None,
                           device=torch.device("cpu"), rank=0)


def test_a_model_file_loss_is_refused(write_model) -> None:
    from helpers.lm import ATTENTION_LM_SOURCE

    path = write_model(ATTENTION_LM_SOURCE + "\ndef loss(model, batch):\n    return model(batch[0]).mean()\n")
    with pytest.raises(ConfigError, match="pipeline stages run the default loss"):
        trace_step(load_task(path), TrainConfig(micro_batch_size=2, pp=2, pp_microbatches=2))
