"""Selective activation checkpointing (``checkpoint_policy="selective"``): the checkpointed
blocks keep their matmul and attention outputs and recompute the rest. The estimate follows
the CPU allocator, the peak sits between no and full checkpointing, and the step is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from estimators import ConfigError, Estimator, Task, TrainConfig
from estimators.probing._measure import measure_cpu_peak
from estimators.runtime import _checkpoint
from estimators.runtime._build import build_for_training, checkpoint_more
from estimators.runtime._checkpoint import SAVED_OPS, apply_checkpointing, block_policy
from estimators.task._task import load_task
from estimators.tracing._trace import trace_step

ROOT = Path(__file__).resolve().parents[3]
aten = torch.ops.aten


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class _GPT(nn.Module):
    """Small GPT with dropout inside the blocks: recomputation must replay the same masks."""

    def __init__(self, vocab: int = 96, d: int = 48, heads: int = 4, layers: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln(h), self.emb.weight)


def _gpt_task(dropout: float = 0.1) -> Task:
    def sample(b: int):
        g = torch.Generator().manual_seed(b)
        x = torch.randint(0, 96, (b, 24), generator=g)
        return x, torch.roll(x, -1, dims=1)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _GPT(dropout=dropout)
    return Task(name="sac-gpt", build_model=build, sample_fn=sample)


def _config(policy: str, segments: int, **more: object) -> TrainConfig:
    return TrainConfig(micro_batch_size=more.pop("micro_batch_size", 8), checkpoint_segments=segments,  # type: ignore[arg-type]
                       checkpoint_policy=policy, **more)  # type: ignore[arg-type]


# -- the configuration ---------------------------------------------------------------------

def test_the_policy_is_validated_and_round_trips() -> None:
    with pytest.raises(ConfigError, match="checkpoint_segments >= 1"):
        TrainConfig(micro_batch_size=4, checkpoint_policy="selective")
    with pytest.raises(ConfigError, match="use full, selective or op"):
        TrainConfig(micro_batch_size=4, checkpoint_segments=2, checkpoint_policy="ops")  # type: ignore[arg-type]
    config = _config("selective", 2)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "2 checkpoint segments (selective)" in config.describe()
    # A full policy writes configurations as before the field existed.
    assert "checkpoint_policy" not in _config("full", 2).to_dict()


# -- the runtime ---------------------------------------------------------------------------

def test_selective_blocks_become_full_and_never_back() -> None:
    model = _GPT()
    assert apply_checkpointing(model, 2, policy="selective") == 2
    assert [block_policy(b) for b in model.blocks] == ["selective", "selective", None]
    apply_checkpointing(model, 3, policy="full")
    assert [block_policy(b) for b in model.blocks] == ["full"] * 3
    apply_checkpointing(model, 3, policy="selective")  # a ladder only steps down
    assert [block_policy(b) for b in model.blocks] == ["full"] * 3


def test_checkpoint_more_turns_a_running_selective_model_full() -> None:
    task = _gpt_task()
    built = build_for_training(task, _config("selective", 3), "cpu")
    checkpoint_more(built, task, 3, policy="full")
    assert [block_policy(b) for b in built.model.blocks] == ["full"] * 3  # type: ignore[union-attr]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_loss_and_gradients_equal_the_plain_step(precision: str) -> None:
    task = _gpt_task(dropout=0.1)
    batch = task.real_batch(8)
    results = []
    for config in (_config("full", 0, precision=precision), _config("selective", 3, precision=precision)):
        built = build_for_training(task, config, "cpu")
        torch.manual_seed(123)  # the same dropout masks in both runs
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = task.compute_loss(built.forward_model, batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in built.model.named_parameters()}))
    (plain_loss, plain_grads), (sac_loss, sac_grads) = results
    assert torch.allclose(sac_loss, plain_loss, rtol=0, atol=1e-6)
    assert plain_grads.keys() == sac_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.allclose(sac_grads[name], grad, rtol=0, atol=1e-6), name


# -- the trace -----------------------------------------------------------------------------

def _recording_policy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, bool, bool]]:
    seen: list[tuple[object, bool, bool]] = []
    original = _checkpoint.selective_policy

    def policy(ctx, func, *args, **kwargs):  # type: ignore[no-untyped-def]
        fake = any(isinstance(a, FakeTensor) for a in args)
        seen.append((func, ctx.is_recompute, fake))
        return original(ctx, func, *args, **kwargs)

    monkeypatch.setitem(_checkpoint._POLICIES, "selective", lambda: policy)
    return seen


def test_the_policy_sees_the_fake_ops_of_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording_policy(monkeypatch)
    trace_step(_gpt_task(), _config("selective", 3), batch_size=4, steps=1)
    assert seen and all(fake for _, _, fake in seen), "the policy ran on real tensors"
    ops = {f for f, _, _ in seen}
    # Asked about every op of the checkpointed forward: the kept ones and the recomputed ones.
    assert {aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default} <= ops
    assert {aten.gelu.default, aten.native_layer_norm.default} <= ops
    # Three blocks, each with four linear layers and one attention.
    assert sum(f is aten.addmm.default for f, _, _ in seen) == 3 * 4


def test_a_cuda_target_keeps_the_cuda_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording_policy(monkeypatch)
    estimator = Estimator(_gpt_task(dropout=0.0), gpu="A100-80GB")
    peaks = [estimator.estimate(c, exact=True).peak_allocated_bytes
             for c in (_config("full", 0), _config("selective", 3), _config("full", 3))]
    cuda_attention = {aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default}
    assert cuda_attention & {f for f, _, _ in seen}
    assert cuda_attention <= SAVED_OPS
    assert peaks[0] > peaks[1] > peaks[2], peaks


# -- the estimate against the CPU allocator ------------------------------------------------

def _rel(pred: int, ref: int) -> float:
    return abs(pred - ref) / ref


@pytest.mark.parametrize("source,batch,precision", [
    ("tests", 8, "fp32"),
    ("benchmarks/models/gpt_tied.py", 16, "fp32"),
    ("benchmarks/models/gpt_tied.py", 12, "bf16-mixed"),
    ("examples/tiny_gpt.py", 8, "bf16-mixed"),
])
def test_selective_estimate_is_within_1_percent_and_between_none_and_full(
        source: str, batch: int, precision: str, one_thread: None) -> None:
    task = _gpt_task() if source == "tests" else load_task(ROOT / source)
    estimator = Estimator(task, device="cpu")
    blocks = _checkpoint.max_checkpoint_segments(task.build_model(), task.checkpoint_blocks)
    none, selective, full = (TrainConfig(micro_batch_size=batch, precision=precision,  # type: ignore[arg-type]
                                         checkpoint_segments=s, checkpoint_policy=p)
                             for s, p in ((0, "full"), (blocks, "selective"), (blocks, "full")))
    est = estimator.estimate(selective)
    ref = measure_cpu_peak(task, selective).peak_bytes
    assert _rel(est.peak_allocated_bytes, ref) < 0.01, (est.peak_allocated_bytes, ref, est.method)
    measured = [measure_cpu_peak(task, c).peak_bytes for c in (none, full)]
    assert measured[0] > ref > measured[1], (measured[0], ref, measured[1])
    estimated = [estimator.estimate(c).peak_allocated_bytes for c in (none, full)]
    assert estimated[0] > est.peak_allocated_bytes > estimated[1]
