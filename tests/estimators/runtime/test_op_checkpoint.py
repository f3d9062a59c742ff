"""torchtitan's selective "op" checkpointing (``checkpoint_policy="op"``): a checkpointed block
keeps its attention outputs and every other ``mm``'s, counted per call. The decisions are
torchtitan's, the step is exact, a ladder only steps towards full, and the estimate follows
the CPU allocator between the selective and the full policy."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from estimators import Estimator, Task, TrainConfig
from estimators.probing._measure import measure_cpu_peak
from estimators.runtime import _checkpoint
from estimators.runtime._build import build_for_training, checkpoint_more
from estimators.runtime._checkpoint import apply_checkpointing, block_policy, recomputes_more

aten = torch.ops.aten


class _Block(nn.Module):
    """A Llama-style block: bias-free projections (each an ``mm``), attention, SwiGLU."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


MMS_PER_BLOCK = 7


class _Llama(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _task() -> Task:
    def sample(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 128, (b, 32), generator=torch.Generator().manual_seed(b))
        return x, torch.roll(x, -1, dims=1)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _Llama()
    return Task(name="op-llama", build_model=build, sample_fn=sample)


def _config(policy: str, segments: int, **more: object) -> TrainConfig:
    return TrainConfig(micro_batch_size=more.pop("micro_batch_size", 4), checkpoint_segments=segments,  # type: ignore[arg-type]
                       checkpoint_policy=policy, **more)  # type: ignore[arg-type]


def test_the_policy_round_trips_and_describes_itself() -> None:
    config = _config("op", 2)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["checkpoint_policy"] == "op"
    assert "2 checkpoint segments (op policy)" in config.describe()


def test_every_other_mm_and_the_attention_are_kept_in_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    decisions: list[tuple[object, bool, CheckpointPolicy]] = []

    def recording() -> object:
        policy = _checkpoint.op_policy()

        def record(ctx, func, *args, **kwargs):  # type: ignore[no-untyped-def]
            decision = policy(ctx, func, *args, **kwargs)
            decisions.append((func, ctx.is_recompute, decision))
            return decision
        return record

    monkeypatch.setitem(_checkpoint._POLICIES, "op", recording)
    task = _task()
    built = build_for_training(task, _config("op", 3), "cpu")
    task.compute_loss(built.forward_model, task.real_batch(2)).backward()

    mms = {r: [d for f, rr, d in decisions if f is aten.mm.default and rr is r] for r in (False, True)}
    # Three calls, each counting its own mms from one: the first, third, ... are kept.
    one_call = [CheckpointPolicy.MUST_SAVE if i % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
                for i in range(MMS_PER_BLOCK)]
    assert mms[False] == one_call * 3, mms[False]
    # torch 2.13 replays the forward's decisions in the recomputation; one that asks again
    # must hear the same.
    assert mms[True] in ([], one_call * 3), mms[True]
    attention = [d for f, r, d in decisions if f is aten._scaled_dot_product_flash_attention_for_cpu.default and not r]
    assert attention == [CheckpointPolicy.MUST_SAVE] * 3
    others = {f for f, r, d in decisions if d is CheckpointPolicy.MUST_SAVE} - {
        aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    assert not others, others


def test_a_ladder_only_steps_towards_full() -> None:
    assert recomputes_more("op", "selective") and recomputes_more("full", "op")
    assert not recomputes_more("selective", "op") and not recomputes_more("op", "full")
    model = _Llama()
    apply_checkpointing(model, 3, policy="selective")
    apply_checkpointing(model, 3, policy="op")
    assert [block_policy(b) for b in model.layers] == ["op"] * 3
    apply_checkpointing(model, 3, policy="selective")
    assert [block_policy(b) for b in model.layers] == ["op"] * 3
    task = _task()
    built = build_for_training(task, _config("op", 2), "cpu")
    checkpoint_more(built, task, 3, policy="full")
    assert [block_policy(b) for b in built.model.layers] == ["full"] * 3  # type: ignore[union-attr]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_loss_and_gradients_equal_the_plain_step(precision: str) -> None:
    task = _task()
    batch = task.real_batch(4)
    results = []
    for config in (_config("full", 0, precision=precision), _config("op", 3, precision=precision)):
        built = build_for_training(task, config, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = task.compute_loss(built.forward_model, batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in built.model.named_parameters()}))
    (plain_loss, plain_grads), (op_loss, op_grads) = results
    assert torch.equal(op_loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.allclose(op_grads[name], grad, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_estimate_is_the_cpu_allocators_between_selective_and_full(precision: str, one_thread: None) -> None:
    task = _task()
    estimator = Estimator(task, device="cpu")
    configs = [_config(p, s, micro_batch_size=8, precision=precision)
               for p, s in (("full", 0), ("selective", 3), ("op", 3), ("full", 3))]
    measured = [measure_cpu_peak(task, c).peak_bytes for c in configs]
    estimated = [estimator.estimate(c).peak_allocated_bytes for c in configs]
    assert measured == sorted(measured, reverse=True) and len(set(measured)) == 4, measured
    op_est, op_ref = estimated[2], measured[2]
    assert abs(op_est - op_ref) / op_ref < 0.01, (op_est, op_ref)
    assert estimated == sorted(estimated, reverse=True) and len(set(estimated)) == 4, estimated
