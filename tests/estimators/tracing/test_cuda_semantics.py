"""CUDA kernel semantics on CPU tensors: autocast policy, weight cache, attention, dropout."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from estimators.tracing import _sdpa
from estimators.tracing._cuda_autocast import CUDA_POLICY, cuda_autocast_ops, cuda_autocast_policy
from estimators.tracing._cuda_semantics import cuda_semantics

LOW = "low"
FP32 = torch.float32
DTYPES = (torch.float16, torch.bfloat16)


def _t(*shape: int, dtype: torch.dtype = FP32, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


# (name, build inputs, op, expected output dtype under CUDA autocast). Inputs are fp32 unless
# the case needs low-precision ones (the fp32 ops matter most for activations coming out of a
# low-precision matmul).
def _low(dtype: torch.dtype) -> torch.Tensor:
    return _t(4, 8, dtype=dtype)


CASES: list[tuple[str, Callable[[torch.dtype], Any]]] = [
    ("matmul", lambda d: (torch.matmul(_t(4, 8), _t(8, 3)), LOW)),
    ("linear", lambda d: (F.linear(_t(4, 8), _t(3, 8), _t(3)), LOW)),
    ("mm", lambda d: (torch.mm(_t(4, 8), _t(8, 3)), LOW)),
    ("bmm", lambda d: (torch.bmm(_t(2, 4, 8), _t(2, 8, 3)), LOW)),
    ("baddbmm", lambda d: (torch.baddbmm(_t(2, 4, 3), _t(2, 4, 8), _t(2, 8, 3)), LOW)),
    ("addmm", lambda d: (torch.addmm(_t(4, 3), _t(4, 8), _t(8, 3)), LOW)),
    ("conv2d", lambda d: (F.conv2d(_t(1, 2, 5, 5), _t(3, 2, 3, 3)), LOW)),
    ("conv1d", lambda d: (F.conv1d(_t(1, 2, 5), _t(3, 2, 3)), LOW)),
    ("einsum", lambda d: (torch.einsum("ij,jk->ik", _t(4, 8), _t(8, 3)), LOW)),
    ("softmax", lambda d: (torch.softmax(_low(d), -1), FP32)),
    ("log_softmax", lambda d: (torch.log_softmax(_low(d), -1), FP32)),
    ("softmax explicit dtype", lambda d: (torch.softmax(_low(d), -1, dtype=d), LOW)),
    ("layer_norm", lambda d: (F.layer_norm(_low(d), (8,)), FP32)),
    ("group_norm", lambda d: (F.group_norm(_t(2, 4, 3, dtype=d), 2), FP32)),
    ("exp", lambda d: (torch.exp(_low(d)), FP32)),
    ("log", lambda d: (torch.log(_low(d)), FP32)),
    ("rsqrt", lambda d: (torch.rsqrt(_low(d)), FP32)),
    ("pow", lambda d: (torch.pow(_low(d), 2), FP32)),
    ("sum", lambda d: (_low(d).sum(), FP32)),
    ("sum dim", lambda d: (_low(d).sum(-1), FP32)),
    ("cumsum", lambda d: (torch.cumsum(_low(d), -1), FP32)),
    ("norm", lambda d: (_low(d).norm(), FP32)),
    ("cross_entropy", lambda d: (F.cross_entropy(_low(d), torch.zeros(4, dtype=torch.long)), FP32)),
    ("mse_loss", lambda d: (F.mse_loss(_low(d), _low(d)), FP32)),
    ("l1_loss", lambda d: (F.l1_loss(_low(d), _low(d)), FP32)),
    ("bce_with_logits", lambda d: (F.binary_cross_entropy_with_logits(_low(d), _low(d)), FP32)),
    ("addcmul promote", lambda d: (torch.addcmul(_low(d), _t(4, 8), _low(d)), FP32)),
    ("addcmul low", lambda d: (torch.addcmul(_low(d), _low(d), _low(d)), LOW)),
    # Only CPU autocast lists these (stack: promote, cat: promote): on CUDA they fall through.
    ("stack", lambda d: (torch.stack([_low(d), _low(d)]), LOW)),
    # Not in any list: runs in its inputs' dtype on both.
    ("gelu", lambda d: (F.gelu(_low(d)), LOW)),
]


@pytest.fixture(scope="module")
def fake() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def test_policy_covers_every_op_cuda_autocast_registers() -> None:
    registered = cuda_autocast_ops()
    assert "softmax.int" in registered and "layer_norm" in registered
    assert registered <= set(CUDA_POLICY)
    # Every table entry the installed torch has as an op is one CUDA autocast registers (the
    # named-tensor overloads of the source lists are gone from this build).
    existing = {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()}
    assert set(CUDA_POLICY) & existing == registered


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_output_dtype_follows_cuda_policy(fake: FakeTensorMode, dtype: torch.dtype, name: str, case: Any) -> None:
    with fake, cuda_autocast_policy(), torch.autocast("cpu", dtype=dtype):
        out, expected = case(dtype)
    assert out.dtype == (dtype if expected == LOW else expected), name


def test_cpu_autocast_is_back_after_the_policy(fake: FakeTensorMode) -> None:
    # CPU autocast keeps softmax in the low dtype (its own list): the override is undone.
    with fake, cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(_low(torch.bfloat16), -1).dtype == FP32
    with fake, torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(_low(torch.bfloat16), -1).dtype == torch.bfloat16
        assert torch.mm(_t(4, 8), _t(8, 3)).dtype == torch.bfloat16
        # cross_entropy is fp32 on CPU as a whole op; on CUDA its log_softmax is.
        assert F.cross_entropy(_low(torch.bfloat16), torch.zeros(4, dtype=torch.long)).dtype == FP32


def _saved_dtypes(fn: Callable[[], torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_tensors_follow_cuda_policy(fake: FakeTensorMode, dtype: torch.dtype) -> None:
    with fake, cuda_autocast_policy(), torch.autocast("cpu", dtype=dtype):
        x, w = _t(4, 8), _t(3, 8)
        # linear saves its cast (low-precision) input and weight.
        assert {d for d, _ in _saved_dtypes(lambda: F.linear(x, w))} == {dtype}
        h = _low(dtype)
        # softmax runs in fp32 and saves its fp32 output; layer_norm its fp32 input and stats.
        assert [d for d, s in _saved_dtypes(lambda: torch.softmax(h, -1)) if s == (4, 8)] == [FP32]
        assert {d for d, s in _saved_dtypes(lambda: F.layer_norm(h, (8,), _t(8), _t(8))) if s == (4, 8)} == {FP32}
    with fake, torch.autocast("cpu", dtype=dtype):
        # CPU autocast saves softmax's output in the low dtype: the difference being modelled.
        assert [d for d, s in _saved_dtypes(lambda: torch.softmax(h, -1)) if s == (4, 8)] == [dtype]


class _Casts(TorchDispatchMode):
    """Counts casts (``_to_copy``) to fp16 of tensors of one shape (a weight's forward casts;
    the backward of a cast is a cast of the gradient back to fp32)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.count, self.outputs = shape, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape
                and out.dtype is torch.float16):
            self.count += 1
            self.outputs.append(weakref.ref(out))
        return out


def test_weight_cache_casts_once_per_autocast_context_and_frees_at_exit(fake: FakeTensorMode) -> None:
    with fake, cuda_autocast_policy():
        lin = nn.Linear(8, 8)
        x = _t(4, 8, grad=False)
        casts = _Casts((8, 8))
        with casts:
            with torch.autocast("cpu", dtype=torch.float16):
                lin(x)
                lin(x)
                assert casts.count == 1  # the fp16 weight is kept for the whole context
                cached = casts.outputs[0]
                assert cached() is not None
            assert cached() is None  # freed at the outermost autocast exit
            with torch.autocast("cpu", dtype=torch.float16):
                lin(x)
            assert casts.count == 2  # a new context casts again


def test_checkpoint_recompute_casts_weights_again_in_backward(fake: FakeTensorMode) -> None:
    with fake, cuda_autocast_policy():
        lin = nn.Linear(8, 8)
        x = _t(4, 8)
        casts = _Casts((8, 8))
        with casts:
            with torch.autocast("cpu", dtype=torch.float16):
                y = checkpoint(lambda t: torch.softmax(lin(t), -1), x, use_reentrant=False)
                assert y.dtype == FP32
            forward_casts = casts.count
            y.sum().backward()
        assert forward_casts == 1
        assert casts.count == 2  # the recomputation, under autocast restored by checkpoint
        assert lin.weight.grad is not None and lin.weight.grad.dtype == FP32


def test_binary_cross_entropy_is_banned_as_on_cuda(fake: FakeTensorMode) -> None:
    with fake, cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.float16):
        p = torch.sigmoid(_low(torch.float16))
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, torch.rand(4, 8))


# -- attention ---------------------------------------------------------------------------

def _qkv(dtype: torch.dtype, d: int = 64, length: int = 128) -> tuple[torch.Tensor, ...]:
    # (B, L, H, D) transposed to (B, H, L, D): the layout attention modules produce.
    return tuple(torch.randn(2, length, 4, d, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("cap,dtype,mask,dropout,d,expected", [
    ((8, 0), torch.float16, False, 0.1, 64, "flash"),
    ((8, 0), torch.bfloat16, True, 0.1, 64, "efficient"),   # flash takes no mask
    ((8, 0), torch.float32, False, 0.0, 64, "efficient"),   # flash is fp16/bf16 only
    ((7, 0), torch.float16, False, 0.1, 64, "efficient"),   # V100: no flash
    ((9, 0), torch.bfloat16, False, 0.0, 64, "cudnn"),      # cuDNN first on sm90
    ((9, 0), torch.bfloat16, False, 0.1, 64, "flash"),      # 0.1 is no multiple of 1/16
    ((8, 6), torch.float16, False, 0.1, 200, "efficient"),  # flash bwd limit on sm86
    ((7, 0), torch.float16, False, 0.0, 60, "math"),        # 60 % 8: no fused kernel
])
def test_attention_backend_choice(fake: FakeTensorMode, cap: tuple[int, int], dtype: torch.dtype, mask: bool,
                                  dropout: float, d: int, expected: str) -> None:
    with fake:
        q, k, v = _qkv(dtype, d)
        m = torch.ones(128, 128, dtype=torch.bool).tril() if mask else None
        assert _sdpa.choose_backend(cap, q, k, v, m, dropout) == expected


@pytest.mark.parametrize("cap,d,math", [((8, 0), 64, False), ((7, 0), 64, False), ((7, 0), 60, True)])
def test_only_math_attention_saves_the_attention_matrix(fake: FakeTensorMode, cap: tuple[int, int], d: int,
                                                        math: bool) -> None:
    with fake, cuda_semantics(cap, autocast=True) as run, torch.autocast("cpu", dtype=torch.float16):
        q, k, v = _qkv(FP32, d)
        saved = _saved_dtypes(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    assert run.attention[("math" if math else _sdpa.choose_backend(cap, *(_qkv(torch.float16, d))))] == 1
    # The math kernel saves the B x H x L x L probabilities (fp32: it upcasts fp16) and a
    # bool dropout mask; the fused kernels save a float32 logsumexp of B x H x L instead.
    matrices = [dt for dt, s in saved if s[-2:] == (128, 128)]
    if math:
        assert FP32 in matrices and torch.bool in matrices
    else:
        assert matrices == []
        assert (FP32, (2, 4, 128)) in saved or any(dt == FP32 and s[:3] == (2, 4, 128) for dt, s in saved)


def test_dropout_keeps_a_bool_mask_on_cuda(fake: FakeTensorMode) -> None:
    with fake:
        x = _t(64, 64)
        with cuda_semantics((8, 0), autocast=False):
            cuda_saved = _saved_dtypes(lambda: F.dropout(x, 0.1))
        cpu_saved = _saved_dtypes(lambda: F.dropout(x, 0.1))
    assert [d for d, _ in cuda_saved] == [torch.bool]
    assert [d for d, _ in cpu_saved] == [FP32]  # the CPU path's noise tensor


# -- through the trace -------------------------------------------------------------------

class _AttnLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.ln = nn.LayerNorm(32)
        self.qkv = nn.Linear(32, 96)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        q, k, v = self.qkv(self.ln(self.emb(idx))).split(32, dim=-1)
        q, k, v = (x.view(b, t, 4, 8).transpose(1, 2) for x in (q, k, v))
        scores = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)
        y = self.drop(scores) @ v
        return self.head(y.transpose(1, 2).reshape(b, t, 32))


def _task() -> Any:
    from estimators import Task

    def sample(n: int) -> Any:
        return torch.randint(0, 64, (n, 16)), torch.randint(0, 64, (n, 16))

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return Task.from_module(_AttnLM(), sample, loss=loss)


def _op_bytes(trace: Any, name: str) -> list[int]:
    return [op.new_bytes for op in trace.ops if op.name == name and op.phase == 1]


@pytest.mark.parametrize("precision,low", [("bf16-mixed", 2), ("fp16-mixed", 2)])
def test_cuda_target_trace_runs_softmax_in_fp32_and_cpu_target_does_not(precision: str, low: int) -> None:
    from estimators import TrainConfig
    from estimators.tracing._trace import trace_step

    task, config = _task(), TrainConfig(micro_batch_size=2, precision=precision)
    cuda = trace_step(task, config, target="cuda", capability=(8, 0))
    cpu = trace_step(task, config, target="cpu")
    probs = 2 * 4 * 16 * 16  # B x H x L x L
    assert _op_bytes(cuda, "aten._softmax") == [probs * 4]
    assert _op_bytes(cpu, "aten._softmax") == [probs * low]
    # Dropout: a bool mask (native_dropout) on CUDA, a noise tensor on the CPU.
    assert "aten.native_dropout" in {op.name for op in cuda.ops}
    assert "aten.native_dropout" not in {op.name for op in cpu.ops}
    assert any("CUDA autocast op policy" in n for n in cuda.notes) and not cpu.notes


def test_a_conv_net_is_told_that_cudnn_workspaces_are_not_modelled() -> None:
    from estimators import Task, TrainConfig
    from estimators.tracing._trace import trace_step

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    task = Task.from_module(net, lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 2, (n,))))
    cuda = trace_step(task, TrainConfig(micro_batch_size=2), target="cuda", capability=(8, 0))
    assert any("cuDNN convolution workspaces" in n for n in cuda.notes)
    mlp = trace_step(_task(), TrainConfig(micro_batch_size=2), target="cuda", capability=(8, 0))
    assert not any("cuDNN convolution" in n for n in mlp.notes)
