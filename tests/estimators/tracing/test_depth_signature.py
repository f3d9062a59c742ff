"""What blocks must share to pass for one module (estimators.tracing._depth.block_differences):
lists and dicts of plain values compare by value, as numbers and strings do, so that blocks that
each carry their own list (of head sizes, window sizes, ...) compose; anything else by identity."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from estimators import Task, TrainConfig
from estimators.tracing._compose import same_trace, stack_facts, trace_composed
from estimators.tracing._depth import block_differences
from estimators.tracing._trace import trace_step


class Scaled(nn.Module):
    """A block whose forward reads a list and a dict of its own (each block a new list and dict)."""

    def __init__(self, d: int, scales: list[float], act: dict[str, object]) -> None:
        super().__init__()
        self.scales = list(scales)
        self.act = dict(act)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        for s in self.scales:
            y = y * s
        return x + (torch.relu(y) if self.act["kind"] == "relu" else torch.tanh(y))


def _task(make_block: Callable[[], nn.Module], layers: int) -> Task:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 16)
            self.blocks = nn.ModuleList(make_block() for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Task(name="scaled", build_model=Stack, sample_fn=lambda b: (torch.randn(b, 16), torch.randn(b, 16)),
                loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]))


def test_equal_lists_and_dicts_of_plain_values_are_the_same_block() -> None:
    blocks = [Scaled(16, [0.5, 2.0], {"kind": "relu", "dims": (16,)}) for _ in range(8)]
    assert len({id(b.scales) for b in blocks}) == 8  # each block its own list: equal by value only
    assert block_differences(blocks) is None


def test_a_stack_of_blocks_with_their_own_lists_composes_to_the_whole_trace() -> None:
    task = _task(lambda: Scaled(16, [0.5, 2.0], {"kind": "relu"}), 8)
    assert stack_facts(task).differs is None
    config = TrainConfig(micro_batch_size=2, checkpoint_segments=2)
    composed = trace_composed(task, config, batch_size=2, target="cuda", gain=False)
    assert any(n.startswith("block stack: 8 blocks composed") for n in composed.notes), composed.notes
    assert same_trace(composed, trace_step(task, config, target="cuda")) is None


def test_lists_or_dicts_that_differ_are_other_blocks() -> None:
    scales = [Scaled(16, [0.5, 2.0] if i % 2 else [0.5], {"kind": "relu"}) for i in range(4)]
    assert block_differences(scales) == "blocks differ in scales ('[0.5]' in block 0, '[0.5, 2.0]' in block 1)"
    acts = [Scaled(16, [1.0], {"kind": "tanh" if i == 3 else "relu"}) for i in range(4)]
    assert block_differences(acts) == ("blocks differ in act (\"{'kind': 'relu'}\" in block 0, "
                                       "\"{'kind': 'tanh'}\" in block 3)")
    # 1 and True are equal numbers but not the same setting in a list.
    flags = [Scaled(16, [True] if i else [1], {"kind": "relu"}) for i in range(4)]
    assert block_differences(flags) is not None


def test_containers_of_other_objects_compare_by_identity() -> None:
    # A list holding an object of each block's own is not a plain value: the blocks differ.
    owned = [Scaled(16, [1.0], {"kind": "relu"}) for _ in range(4)]
    for block in owned:
        block.hooks = [object()]
    assert block_differences(owned) is not None and "hooks" in block_differences(owned)
    # One object shared by every block (a config, say) is the same by identity.
    shared = object()
    same = [Scaled(16, [1.0], {"kind": "relu"}) for _ in range(4)]
    for block in same:
        block.config = shared
    assert block_differences(same) is None
    # A list that holds itself is not plain (compared by identity), and does not recurse forever.
    loops = [Scaled(16, [1.0], {"kind": "relu"}) for _ in range(4)]
    for block in loops:
        block.scales.append(block.scales)
    assert "scales" in (block_differences(loops) or "")


def test_names_that_number_the_blocks_are_one_module_and_other_names_are_not() -> None:
    # PEFT's LoRA layers each keep the name of the layer they wrap (kwargs["target_name"]).
    def named(names: list[str]) -> list[nn.Module]:
        blocks = []
        for name in names:
            block = nn.Linear(4, 4)
            block.target = name  # type: ignore[assignment]
            block.kwargs = {"r": 16, "target_name": name}  # type: ignore[assignment]
            blocks.append(block)
        return blocks

    assert block_differences(named([f"model.layers.{i}.self_attn.q_proj" for i in range(3, 7)])) is None
    assert block_differences(named(["layers.0.attn.v2", "layers.1.attn.v2", "layers.2.attn.v2"])) is None
    assert "target" in (block_differences(named(["layers.0.q", "layers.2.q", "layers.3.q"])) or "")
    assert "target" in (block_differences(named(["layers.0.q_proj", "layers.1.k_proj"])) or "")


def test_a_lora_decoders_blocks_are_one_module(tmp_path) -> None:
    import peft
    import transformers
    from helpers.hf import write_tiny

    config = transformers.AutoConfig.from_pretrained(write_tiny(tmp_path / "tiny"))
    config.num_hidden_layers = 4
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert block_differences(list(model.base_model.model.model.layers)) is None


def test_a_stack_refused_once_is_traced_whole_for_the_layouts_other_settings(monkeypatch) -> None:
    from estimators.tracing import _compose
    from estimators.tracing._depth import NotComposable

    def refuse(*args, **kwargs):
        raise NotComposable("an edge block refers to a neighbour unlike the cut's")

    monkeypatch.setattr(_compose, "_checked_composer", refuse)
    task = _task(lambda: Scaled(16, [0.5], {"kind": "relu"}), 8)
    cuts: list[object] = []

    def trace(*args, cut=None, **kwargs):
        cuts.append(cut)
        return trace_step(*args, cut=cut, **kwargs) if cut is not None else trace_step(*args, **kwargs)

    cache: dict = {}
    for b, segments in ((2, 0), (3, 0), (2, 4)):
        got = trace_composed(task, TrainConfig(micro_batch_size=b, checkpoint_segments=segments), batch_size=b,
                             target="cuda", gain=False, trace=trace, cache=cache)
        assert "block stack traced whole: an edge block refers to a neighbour unlike the cut's" in got.notes
    assert sum(c is not None for c in cuts) == 2 and cuts.count(None) == 3  # one pair of cuts, then whole
    other = trace_composed(task, TrainConfig(micro_batch_size=2, precision="bf16-mixed"), batch_size=2,
                           target="cuda", gain=False, trace=trace, cache=cache)
    assert other.notes and sum(c is not None for c in cuts) == 4  # another precision tries its own cuts
