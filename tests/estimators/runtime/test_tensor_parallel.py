"""Which linears tensor parallelism splits (the model file's plan, a Hugging Face model's own,
or one inferred from the block shapes), what it refuses, and the configuration's checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import ConfigError, TrainConfig
from estimators.runtime._loss_parallel import sharded_loss
from estimators.runtime._tensor_parallel import apply_tp, resolve_tp_plan


def attention_lm(**kwargs: int) -> nn.Module:
    ns: dict[str, object] = {}
    exec(ATTENTION_LM_SOURCE, ns)
    return ns["AttentionLM"](**kwargs)  # type: ignore[operator]


class FusedAttention(nn.Module):
    """GPT-2's layout: one fused q/k/v projection, whose column shards would cut across q, k, v."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)


class GptMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)


class GptBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = FusedAttention(d)
        self.mlp = GptMLP(d)


class Gpt(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.h = nn.ModuleList(GptBlock(d) for _ in range(layers))


def test_the_block_shapes_give_the_megatron_split() -> None:
    plan = resolve_tp_plan(attention_lm(), 2)
    assert plan.source == "inferred"
    want = {}
    for i in range(3):
        for name in ("q_proj", "k_proj", "v_proj"):
            want[f"layers.{i}.attn.{name}"] = "colwise"
        want[f"layers.{i}.attn.o_proj"] = "rowwise"
        want[f"layers.{i}.mlp.gate_proj"] = want[f"layers.{i}.mlp.up_proj"] = "colwise"
        want[f"layers.{i}.mlp.down_proj"] = "rowwise"
    # The embedding, the norms and the head stay replicated.
    assert plan.styles == want


def test_a_fused_qkv_projection_stays_replicated_and_its_mlp_splits() -> None:
    plan = resolve_tp_plan(Gpt(), 2)
    assert plan.styles == {f"h.{i}.mlp.{n}": s for i in range(2) for n, s in (("c_fc", "colwise"),
                                                                            ("c_proj", "rowwise"))}


def test_a_block_holding_its_projections_itself_splits_them_and_its_head_counts() -> None:
    # The layout of benchmarks/models_large.py's Llama 3 block: q/k/v/out and gate/up/down are
    # the block's own children, and so are its head counts.
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.kv_heads = 8, 2
            for name, (i, o) in {"q": (32, 32), "k": (32, 8), "v": (32, 8), "out": (32, 32), "gate": (32, 64),
                                 "up": (32, 64), "down": (64, 32)}.items():
                setattr(self, name, nn.Linear(i, o, bias=False))

    model = nn.ModuleDict({"layers": nn.ModuleList([Block(), Block()])})
    plan = resolve_tp_plan(model, 2)
    assert {n.split(".")[-1]: s for n, s in plan.styles.items()} == {
        "q": "colwise", "k": "colwise", "v": "colwise", "out": "rowwise", "gate": "colwise", "up": "colwise",
        "down": "rowwise"}
    with pytest.raises(ConfigError, match=r"layers\.0\.kv_heads is 2, which tp 4 does not divide"):
        resolve_tp_plan(model, 4)


def test_a_model_with_nothing_to_split_is_refused_with_the_fix() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"found nothing to split.*define\s+tp_plan\(model\)"):
        resolve_tp_plan(model, 2)


def test_widths_and_head_counts_that_tp_does_not_divide_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.q_proj has 64 outputs, which tp 3 does not divide"):
        resolve_tp_plan(attention_lm(), 3)
    # 96 wide divides by 8, its 12 heads do not.
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.n_heads is 12, which tp 8 does not divide"):
        resolve_tp_plan(attention_lm(d=96, n_heads=12), 8)


def test_the_model_files_plan_comes_first_with_patterns() -> None:
    plan = resolve_tp_plan(attention_lm(), 2, hook=lambda m: {"layers.*.mlp.up_proj": "colwise",
                                                             "layers.*.mlp.down_proj": "rowwise"})
    assert plan.source == "tp_plan(model)"
    assert plan.styles == {f"layers.{i}.mlp.{n}": s for i in range(3)
                           for n, s in (("up_proj", "colwise"), ("down_proj", "rowwise"))}
    with pytest.raises(ConfigError, match=r"'layers\.\*\.mlp\.up' matches no nn\.Linear"):
        resolve_tp_plan(attention_lm(), 2, hook=lambda m: {"layers.*.mlp.up": "colwise"})
    with pytest.raises(ConfigError, match=r"has style 'sideways'; use 'colwise' or 'rowwise'"):
        resolve_tp_plan(attention_lm(), 2, hook=lambda m: {"layers.*.mlp.up_proj": "sideways"})


def test_a_hugging_face_plan_names_modules_below_the_base_model() -> None:
    class Config:
        base_model_tp_plan = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
                              "layers.*.attn.q_proj": "colwise_rep"}  # a style this split leaves replicated

    class ForCausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = attention_lm()
            self.config = Config()

    plan = resolve_tp_plan(ForCausalLM(), 2)
    assert plan.source == "base_model_tp_plan"
    assert plan.styles == {f"model.layers.{i}.mlp.{n}": s for i in range(3)
                           for n, s in (("gate_proj", "colwise"), ("down_proj", "rowwise"))}


def test_splitting_shards_the_linears_and_divides_the_head_count() -> None:
    from estimators.tracing._simulated_ranks import simulated_ranks

    model = attention_lm()
    with simulated_ranks(2):
        from torch.distributed.device_mesh import init_device_mesh

        plan = resolve_tp_plan(model, 2)
        assert (plan.head, plan.head_note) == ("head", None)
        apply_tp(model, init_device_mesh("cpu", (2,)), plan)
        attn = model.layers[0].attn
        assert attn.n_heads == 2 and attn.head_dim == 16
        assert attn.q_proj.weight.to_local().shape == (32, 64)  # rows: its half of the heads
        assert attn.o_proj.weight.to_local().shape == (64, 32)  # columns: the same half
        # Replicated: a DTensor of the whole table on every rank.
        assert model.emb.weight.to_local().shape == (256, 64)
        assert model.emb.weight.placements[0].is_replicate()
        # The head: split over the vocabulary, its logits gathered outside the step's loss.
        assert model.head.weight.placements[0].is_shard(0) and model.head.weight.to_local().shape == (128, 64)
        logits = model(torch.randint(0, 256, (2, 8)))
        assert type(logits) is torch.Tensor and logits.shape == (2, 8, 256)
        with sharded_loss(True):
            kept = model(torch.randint(0, 256, (2, 8)))
        assert kept.placements[0].is_shard(2) and kept.to_local().shape == (2, 8, 128)


def test_a_head_is_split_only_where_it_is_one_linear_of_its_own_that_tp_divides() -> None:
    from helpers.lm import LM_SOURCE

    ns: dict[str, object] = {}
    exec(LM_SOURCE, ns)
    tied = ns["TinyLM"]()  # type: ignore[operator]
    assert tied.head.weight is tied.emb.weight
    plan = resolve_tp_plan(tied, 2)
    assert plan.head is None and "tied" in (plan.head_note or ""), plan.head_note
    model = attention_lm()
    model.head = nn.Linear(64, 256 + 1)
    model.emb = nn.Embedding(256 + 1, 64)
    plan = resolve_tp_plan(model, 2)
    assert plan.head is None and "257 outputs are not divisible by tp 2" in (plan.head_note or "")
    model.aux = nn.Linear(64, 257)
    plan = resolve_tp_plan(model, 2)
    assert plan.head is None and "2 linears (head, aux)" in (plan.head_note or ""), plan.head_note
    # A vocabulary-wide linear whose output goes on through another module is not the head.
    model = attention_lm()
    model.after = nn.Identity()
    plan = resolve_tp_plan(model, 2)
    assert plan.head is None and "not the model's last module" in (plan.head_note or ""), plan.head_note


def test_tied_weights_stay_tied_when_replicated() -> None:
    from helpers.lm import LM_SOURCE
    from torch.distributed.device_mesh import init_device_mesh

    from estimators.tracing._simulated_ranks import simulated_ranks

    ns: dict[str, object] = {}
    exec(LM_SOURCE, ns)
    model = ns["TinyLM"]()  # type: ignore[operator]
    with simulated_ranks(2):
        apply_tp(model, init_device_mesh("cpu", (2,)), resolve_tp_plan(model, 2))
        assert model.head.weight is model.emb.weight
        assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
        assert model.blocks[0].fc1.weight.to_local().shape == (128, 64)


def test_a_module_with_parameters_of_its_own_beside_split_linears_is_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from estimators.tracing._simulated_ranks import simulated_ranks

    model = attention_lm()
    model.layers[0].attn.scale = nn.Parameter(torch.ones(()))
    with simulated_ranks(2), pytest.raises(ConfigError, match=r"layers\.0\.attn holds parameters of its own \(scale\)"):
        apply_tp(model, init_device_mesh("cpu", (2,)), resolve_tp_plan(model, 2))


def test_the_configuration_counts_ranks_and_refuses_untested_mixes() -> None:
    c = TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=2, tp=4)
    assert c.ranks == 8 and c.global_batch == 8 and c.shards_parameters
    assert c.describe() == "micro-batch 4, fp32, fsdp x2 x tp 4"
    assert TrainConfig.from_dict(c.to_dict()) == c
    assert "tp" not in TrainConfig(micro_batch_size=4).to_dict()
    assert TrainConfig(micro_batch_size=4, tp=2).describe() == "micro-batch 4, fp32, tp 2"
    with pytest.raises(ConfigError, match="combines with FSDP2 for data parallelism, not DDP"):
        TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2, tp=2)
    with pytest.raises(ConfigError, match="cpu_offload is not combined with tp 2"):
        TrainConfig(micro_batch_size=4, strategy="fsdp", tp=2, cpu_offload=True)
    with pytest.raises(ConfigError, match="tp must be a whole number >= 1"):
        TrainConfig(micro_batch_size=4, tp=0)


class Flat(nn.Module):
    """A block holding its projections itself, as some model codes write them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    return tuple((t.to_local() if isinstance(t, DTensor) else t).shape)


def _sequence_parallel(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Split ``model`` over 2 simulated ranks with sequence parallelism, run ``x`` through it,
    and return the shape of the part of its input each block, norm and pair holds."""
    from torch.distributed.device_mesh import init_device_mesh

    from estimators.tracing._simulated_ranks import simulated_ranks

    seen: dict[str, tuple[int, ...]] = {}
    with simulated_ranks(2):
        apply_tp(model, init_device_mesh("cpu", (2,)), resolve_tp_plan(model, 2), sequence_parallel=True)
        for name, module in model.named_modules():
            if name.count(".") <= 2 and name.startswith("layers.0") or name in ("norm", "layers.2"):
                module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, _local_shape(args[0]))
                                                 and None)
        out = model(x)
    seen["output"] = tuple(out.shape)
    return seen


def test_sequence_parallel_shards_the_stream_between_the_pairs() -> None:
    seen = _sequence_parallel(attention_lm(), torch.randint(0, 256, (2, 8)))
    # The blocks and their norms see half of the 8 positions; each split pair gathers them all;
    # the last norm and the head see whole sequences again.
    assert seen["layers.0"] == seen["layers.0.attn_norm"] == seen["layers.2"] == (2, 4, 64)
    assert seen["layers.0.mlp_norm"] == (2, 4, 64)
    assert seen["layers.0.attn"] == seen["layers.0.mlp"] == (2, 8, 64)
    assert seen["norm"] == (2, 8, 64) and seen["output"] == (2, 8, 256)


def test_sequence_parallel_refuses_what_would_see_part_of_the_sequence() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from estimators.tracing._simulated_ranks import simulated_ranks

    # A sequence of 7 positions does not split over 2 ranks.
    with pytest.raises(ConfigError, match="sequence of 7 positions over tp 2, which does not divide it"):
        _sequence_parallel(attention_lm(), torch.randint(0, 256, (2, 7)))
    # A replicated module between the pairs that is not a norm (it could mix positions).
    model = attention_lm()
    for block in model.layers:
        block.mlp_norm = nn.Conv1d(64, 64, 1)  # type: ignore[assignment]
    with simulated_ranks(2), pytest.raises(
            ConfigError, match=r"layers\.0\.mlp_norm \(Conv1d\) would see 1/tp of the sequence between the split pairs"):
        apply_tp(model, init_device_mesh("cpu", (2,)), resolve_tp_plan(model, 2), sequence_parallel=True)
    # A block that holds its projections itself has no module to gather the sequence at.
    flat = nn.Sequential(*(Flat() for _ in range(2)))
    with simulated_ranks(2), pytest.raises(ConfigError, match=r"the block 0 holds its split linears itself"):
        apply_tp(flat, init_device_mesh("cpu", (2,)), resolve_tp_plan(flat, 2), sequence_parallel=True)
    # Nothing asks for sequence parallelism without tensor parallelism.
    with pytest.raises(ConfigError, match="sequence_parallel splits the sequence over the tensor-parallel ranks"):
        TrainConfig(micro_batch_size=4, sequence_parallel=True)
    c = TrainConfig(micro_batch_size=4, tp=2, sequence_parallel=True)
    assert c.describe() == "micro-batch 4, fp32, tp 2, sequence parallel"
    assert TrainConfig.from_dict(c.to_dict()) == c and "sequence_parallel" not in c.replace(
        sequence_parallel=False).to_dict()


def test_an_error_in_the_sharded_loss_leaves_no_loss_ops_installed() -> None:
    # loss_parallel's own context manager skips its exit when the block raises (an OOM the
    # trainer recovers from would leave DTensor's cross entropy rerouted for good).
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    with pytest.raises(RuntimeError, match="out of memory"), sharded_loss(True):
        assert len(handlers) > len(before)
        raise RuntimeError("out of memory")
    assert handlers == before
