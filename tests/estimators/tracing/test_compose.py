"""A block stack's trace composed from traces of the model cut short (estimators.tracing._compose)
against the trace of the whole model: the same allocations, events, ops and host allocations."""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers.models import lm_task
from torch.utils.data import TensorDataset

from estimators import Task, TrainConfig, load_task
from estimators.tracing import _depth
from estimators.tracing._compose import (
    Composer,
    cut_patterns,
    same_trace,
    stack_facts,
    stack_pattern,
    trace_composed,
)
from estimators.tracing._depth import DepthCut, NotComposable, block_differences
from estimators.tracing._trace import trace_step

ROOT = Path(__file__).resolve().parents[3]


def _models_large():
    spec = importlib.util.spec_from_file_location("models_large", ROOT / "benchmarks" / "models_large.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_task(layers: int, *, torchtitan: bool = False) -> Task:
    """``benchmarks/models_large.py``'s Llama 3 decoder (rotary positions, grouped-query
    attention, SwiGLU) at a size that traces in a blink; ``torchtitan``: its blocks laid out as
    torchtitan's (attention and feed-forward modules, which sequence parallelism needs)."""
    large = _models_large()
    block = large.TitanBlock if torchtitan else large.GQABlock
    vocab, seq = 256, 32

    def data() -> TensorDataset:
        tokens = torch.randint(0, vocab, (16, seq + 1), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    return Task(name=f"llama{layers}", build_model=lambda: large.Llama3(layers, 64, 4, 2, 128, vocab, False, 1e4, seq, block),
                train_data=data, checkpoint_blocks=lambda m: list(m.layers))


def _composed_and_whole(task: Task, config: TrainConfig, target: str = "cuda") -> None:
    whole = trace_step(task, config, target=target)
    composed = trace_composed(task, config, batch_size=config.micro_batch_size, target=target, gain=False)
    assert any(n.startswith("block stack: ") and "composed" in n for n in composed.notes), composed.notes
    assert same_trace(composed, whole) is None


# Five blocks compose from cuts of four and three; seven, two of them checkpointed (C P P C P P P),
# from C P P C P P and C P C P P. Small stacks, so that the whole model's trace is cheap too.
CUDA_CONFIGS = {
    "fp32": (5, TrainConfig(micro_batch_size=2)),
    "bf16-mixed, 2 of 7 checkpointed": (7, TrainConfig(micro_batch_size=2, precision="bf16-mixed",
                                                       checkpoint_segments=2)),
    "bf16-mixed, every block selective": (5, TrainConfig(micro_batch_size=2, precision="bf16-mixed",
                                                         checkpoint_segments=5, checkpoint_policy="selective")),
    "bf16-mixed, 2 of 7 with torchtitan's op policy": (7, TrainConfig(
        micro_batch_size=2, precision="bf16-mixed", checkpoint_segments=2, checkpoint_policy="op")),
    "fp16-mixed, accumulation": (5, TrainConfig(micro_batch_size=2, grad_accum_steps=4, precision="fp16-mixed")),
    "bf16-mixed, offloaded activations": (5, TrainConfig(micro_batch_size=2, precision="bf16-mixed",
                                                         offload_activations=True)),
}


@pytest.mark.parametrize("name", list(CUDA_CONFIGS))
def test_the_composed_trace_is_the_whole_models(name: str) -> None:
    layers, config = CUDA_CONFIGS[name]
    _composed_and_whole(llama_task(layers), config)


def test_an_id_a_dead_output_leaves_to_the_next_input_changes_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPython gives a dead tensor's id to the next object made at its address: the next
    # micro-batch's input to the first block can have the id of the last block's output before
    # it, as the process's history decides. Here every tensor an op makes has one id, the
    # worst case of that reuse: the first block's backward must still end where it does.
    real_id = builtins.id
    monkeypatch.setattr(_depth, "id", lambda o: 0 if isinstance(o, torch.Tensor) and o.grad_fn is not None
                        else real_id(o), raising=False)
    layers, config = CUDA_CONFIGS["fp16-mixed, accumulation"]
    _composed_and_whole(llama_task(layers), config)


@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=2, precision="bf16-mixed", strategy="fsdp", world_size=2, checkpoint_segments=5),
    TrainConfig(micro_batch_size=2, precision="bf16-mixed", strategy="fsdp", world_size=2, cpu_offload=True),
    # A block's input dies when the layer loop moves on (the block saved an offloaded copy), in
    # the burst of frees where FSDP2 reshards the block that just ran.
    TrainConfig(micro_batch_size=2, precision="bf16-mixed", strategy="fsdp", world_size=2, offload_activations=True),
    pytest.param(TrainConfig(micro_batch_size=2, strategy="ddp", world_size=2), marks=pytest.mark.slow),
], ids=["fsdp2-checkpointed", "fsdp2-cpu-offload", "fsdp2-offloaded-activations", "ddp"])
def test_sharded_and_replicated_layouts_compose(config: TrainConfig) -> None:
    # FSDP2 unshards each block in the one before it and prefetches the next; DDP's buckets
    # hold several blocks' gradients: both compose to the whole model's trace.
    _composed_and_whole(llama_task(5), config)


@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=2, tp=2, sequence_parallel=True),
    TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=2, tp=2),
    TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=2, tp=2, sequence_parallel=True),
    TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=2, tp=2, sequence_parallel=True,
                precision="bf16-mixed", grad_accum_steps=2, checkpoint_segments=5, offload_activations=True),
], ids=["tp-sp", "fsdp2-tp", "fsdp2-tp-sp", "fsdp2-tp-sp-checkpointed-offloaded"])
def test_tensor_parallel_layouts_compose(config: TrainConfig) -> None:
    # Sequence parallelism gathers the last block's output in a hook that runs before FSDP2's
    # post-forward: FSDP2's pre-backward (the last block's unshard and the prefetch of the one
    # before) hangs on the gathered tensor, so the last block's backward must begin there too.
    _composed_and_whole(llama_task(5, torchtitan=True), config)


@pytest.mark.parametrize("layers, config", [(7, TrainConfig(micro_batch_size=2, checkpoint_segments=2)),
                                            (5, TrainConfig(micro_batch_size=2, precision="bf16-mixed"))])
def test_a_cpu_target_composes_too(layers: int, config: TrainConfig) -> None:
    # The CPU's optimizer steps one parameter at a time (no multi-tensor kernels).
    _composed_and_whole(llama_task(layers), config, target="cpu")


def test_tied_embeddings_compose() -> None:
    _composed_and_whole(load_task(str(ROOT / "benchmarks/models/gpt_tied.py")), TrainConfig(micro_batch_size=2))


class Indexed(nn.Module):
    """A block that does more work every third layer, by its index: the same module, the same
    shapes, another trace."""

    def __init__(self, d: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + (self.fc(torch.relu(y)) if self.index % 3 == 0 else y)


def _stack_task(blocks: list[nn.Module] | None = None, layers: int = 8, forward_by_index: bool = False) -> Task:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(blocks if blocks is not None else [Indexed(16, i) for i in range(layers)])
            self.n = len(self.blocks)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if forward_by_index:
                for i in range(self.n):
                    x = self.blocks[i](x)
                return x
            for block in self.blocks:
                x = block(x)
            return x

    return Task(name="stack", build_model=Stack, sample_fn=lambda b: (torch.randn(b, 16), torch.randn(b, 16)),
                loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]))


def test_blocks_that_act_by_their_index_are_traced_whole() -> None:
    # The index numbers the blocks, so they pass for the same module: the two cuts disagree.
    task = _stack_task()
    assert stack_facts(task).differs is None
    config = TrainConfig(micro_batch_size=2)
    trace = trace_composed(task, config, batch_size=2, target="cuda", gain=False)
    note = next(n for n in trace.notes if n.startswith("block stack"))
    assert note.startswith("block stack traced whole: ")
    assert same_trace(trace, trace_step(task, config, target="cuda")) is None


def test_blocks_of_other_shapes_or_settings_are_traced_whole() -> None:
    shapes = _stack_task([nn.Linear(16, 16) for _ in range(6)] + [nn.Linear(16, 16, bias=False) for _ in range(2)])
    assert stack_facts(shapes).differs is not None
    window = [nn.Linear(16, 16) for _ in range(8)]
    for i, layer in enumerate(window):
        layer.window = 4 if i % 2 else 16  # alternating attention windows, say
    assert block_differences(window) == "blocks differ in window (16 in block 0, 4 in block 1)"
    trace = trace_composed(shapes, TrainConfig(micro_batch_size=2), batch_size=2, target="cuda", gain=False)
    assert any(n.startswith("block stack traced whole: ") for n in trace.notes)


def test_a_forward_that_indexes_the_stack_is_traced_whole() -> None:
    task = _stack_task([nn.Linear(16, 16) for _ in range(8)], forward_by_index=True)
    trace = trace_composed(task, TrainConfig(micro_batch_size=2), batch_size=2, target="cuda", gain=False)
    note = next(n for n in trace.notes if n.startswith("block stack"))
    assert note.startswith("block stack traced whole: ") and "IndexError" in note


def test_a_composer_refuses_cuts_that_disagree() -> None:
    # Cuts of two configurations (fp32 and bf16-mixed) do not compose: the check says so.
    task, config = llama_task(5), TrainConfig(micro_batch_size=2)
    deep = trace_step(task, config, target="cuda", cut=DepthCut(4))
    shallow = trace_step(task, config.replace(precision="bf16-mixed"), target="cuda", cut=DepthCut(3))
    assert deep.tagged is not None and shallow.tagged is not None
    try:
        why = Composer(deep.tagged, (False,) * 4, shallow.tagged, (False,) * 3).check(config, 2, shallow)
    except NotComposable as exc:
        why = str(exc)
    assert why is not None


def test_cut_patterns_witness_every_pair_of_neighbours() -> None:
    def show(p: tuple[bool, ...]) -> str:
        return "".join("C" if c else "P" for c in p)

    cases = {(32, 0): ("PPPP", "PPP"), (32, 32): ("CCCC", "CCC"), (32, 1): ("CPPP", "CPP"),
             (32, 8): ("CPPCPP", "CPCPP"), (32, 16): ("CPCPCP", "CPCP"), (28, 8): ("CPPCPP", "CPCPP")}
    for (n, segments), expected in cases.items():
        cuts = cut_patterns(stack_pattern(n, segments))
        assert cuts is not None and (show(cuts[0]), show(cuts[1])) == expected
    assert cut_patterns(stack_pattern(6, 0)) is None  # 4 + 3 blocks traced for 6: no gain
    assert cut_patterns(stack_pattern(6, 0), gain=False) is not None
    assert cut_patterns(stack_pattern(2, 0), gain=False) is None  # no interior


def test_small_models_are_traced_whole_without_a_note() -> None:
    trace = trace_composed(lm_task(), TrainConfig(micro_batch_size=2), batch_size=2, target="cuda")
    assert not any(n.startswith("block stack") for n in trace.notes)
