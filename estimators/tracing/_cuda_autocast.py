"""CUDA's autocast policy, applied to CPU tensors, for traces of a CUDA target.

``torch.autocast("cuda")`` is silently disabled without a GPU, and fake CUDA tensors abort in
backward (FACTS.md), so a trace for a CUDA card runs CPU tensors under CPU autocast. CPU
autocast's op lists differ from CUDA's: under it softmax, log_softmax, layer_norm, exp, sum
and the losses stay in bf16/fp16, while CUDA runs them in fp32 and saves fp32 tensors for
backward. :func:`cuda_autocast_policy` swaps the kernels of the ``AutocastCPU`` dispatch key
for CUDA's policy while it is active:

* every op with an ``AutocastCUDA`` kernel gets a Python kernel that casts as CUDA's does
  (``CastPolicy`` in ``aten/src/ATen/autocast_mode.h``, the op lists ``AT_FORALL_*`` there and
  the ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` block of ``autocast_mode.cpp``, PyTorch 2.x);
* every op only CPU autocast lists (``cat``, ``stack``, ``cross_entropy_loss``, ...) falls
  through, as on CUDA, so composite ops decompose into the ops CUDA's policy sees;
* ``binary_cross_entropy`` raises CUDA autocast's error (it is banned there).

Casts go through the dispatcher above autograd, as the real wrappers do, so autograd saves the
cast tensors (fp16 inputs of a matmul, fp32 inputs of a softmax). The weight cache is CUDA's:
fp32 leaves that require grad, cast to the lower dtype, are cast once and kept until the
outermost autocast context exits (``torch.clear_autocast_cache``). ``torch.utils.checkpoint``
re-enters autocast for its recomputation inside backward, so a recomputed block casts its
weights again and frees them when the recomputation ends, as on a GPU.

Known limits: CUDA-only kernels registered outside ``autocast_mode.cpp`` (cuDNN RNNs'
``_cudnn_rnn`` cast-and-reflatten) are not modelled; CPU-only ops have no CUDA counterpart.
The override is process-wide while active: CUDA-target traces in threads of one process take
turns, and a CPU-target trace must not run beside one (each estimator's lock serialises its
own traces; one search uses one target).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TypeGuard

import torch

__all__ = ["CUDA_POLICY", "cuda_autocast_policy", "policy_of", "cuda_autocast_ops"]

# CastPolicy per op overload, copied from PyTorch's AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE and
# AT_FORALL_PROMOTE (autocast_mode.h) plus the two cuDNN convolutions and the banned
# binary_cross_entropy that autocast_mode.cpp registers for CUDA only. Overloads named but
# not registered by the installed torch (the Dimname ones) are skipped at registration.
_LOWER = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
    "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
    "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
    "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
# Registered overload -> the dtype-taking overload it redispatches to.
_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}
_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)
_BANNED = ("binary_cross_entropy",)

CUDA_POLICY: dict[str, str] = {
    **{op: "lower_precision_fp" for op in _LOWER},
    **{op: "fp32" for op in _FP32},
    **{op: "fp32_set_opt_dtype" for op in _FP32_SET_OPT_DTYPE},
    **{op: "fp32_append_dtype" for op in _FP32_APPEND_DTYPE},
    **{op: "promote" for op in _PROMOTE},
    **{op: "banned" for op in _BANNED},
}
"""CUDA autocast's cast policy per aten overload (``"addmm"`` is ``aten::addmm.default``)."""

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA)


def policy_of(op: str) -> str | None:
    """CUDA's cast policy of an aten overload name (``"softmax.int"``), or None (fallthrough)."""
    return CUDA_POLICY.get(op[len("aten::"):] if op.startswith("aten::") else op)


def _registered(key: str) -> set[str]:
    """Overloads the installed torch registers a kernel for on an autocast dispatch key."""
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            out.add(name[len("aten::"):])
    return out


def cuda_autocast_ops() -> set[str]:
    """The overloads the installed torch's CUDA autocast registers (its AutocastCUDA kernels)."""
    return _registered("AutocastCUDA")


def _overload(name: str) -> torch._ops.OpOverload | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


# -- casts ---------------------------------------------------------------------------------

class _Cache:
    """CUDA autocast's cast cache (``cached_casts`` in autocast_mode.cpp), keyed by tensor."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def clear(self) -> None:
        self.casts.clear()


def _eligible(t: object) -> TypeGuard[torch.Tensor]:
    # is_eligible for a CUDA tensor: defined, floating point, not double. The traced CPU
    # tensors stand for the CUDA tensors of the run.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


def _cached_cast(cache: _Cache, lower: torch.dtype, to: torch.dtype, arg: object) -> object:
    if isinstance(arg, (list, tuple)):
        return type(arg)(_cached_cast(cache, lower, to, a) for a in arg)
    if not _eligible(arg) or arg.dtype == to:
        return arg
    can_cache = (to == lower and arg.dtype is torch.float32 and arg.requires_grad and arg.is_leaf
                 and not arg._is_view() and torch.is_autocast_cache_enabled())
    if not can_cache:
        return arg.to(to)
    hit = cache.casts.get(id(arg))
    if hit is not None and hit[0]() is arg:
        return hit[1]
    cast = arg.to(to)
    cache.casts[id(arg)] = (weakref.ref(arg), cast)
    return cast


def _promote_type(lower: torch.dtype, tensors: list[torch.Tensor]) -> torch.dtype:
    current = lower
    for t in tensors:
        if not _eligible(t):
            continue  # doubles and non-float tensors are ignored, as in prioritize()
        if current is torch.float32 or t.dtype is torch.float32:
            current = torch.float32
        elif current == lower and t.dtype == lower:
            current = lower
        else:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _flat_tensors(args: tuple[object, ...], kwargs: Mapping[str, object]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _dtype_position(op: torch._ops.OpOverload) -> int:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dtype":
            return -1 if arg.kwarg_only else i
    raise ValueError(f"{op} has no dtype argument")


def _kernel(name: str, policy: str, cache: _Cache) -> Callable[..., object]:
    op = _overload(name)
    assert op is not None
    if policy == "banned":
        def banned(*args: object, **kwargs: object) -> object:
            raise RuntimeError(_BCE_BANNED)
        return banned
    if policy == "fp32_set_opt_dtype":
        position = _dtype_position(op)

        def set_opt_dtype(*args: object, **kwargs: object) -> object:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                # If the first argument is ineligible, the op runs unaltered (no dtype set).
                if _eligible(args[0]):
                    if 0 <= position < len(args):
                        if args[position] is None:
                            args = (*args[:position], torch.float32, *args[position + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return set_opt_dtype
    if policy == "fp32_append_dtype":
        target = _overload(_FP32_APPEND_DTYPE[name])
        assert target is not None

        def append_dtype(*args: object, **kwargs: object) -> object:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                first = args[0]
                assert isinstance(first, torch.Tensor)  # ``self`` of the norm overloads
                out_type = torch.float32 if _eligible(first) else first.dtype
                return target(*args, **kwargs, dtype=out_type)
        return append_dtype

    def cast(*args: object, **kwargs: object) -> object:
        lower = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            if policy == "lower_precision_fp":
                to = lower
            elif policy == "fp32":
                to = torch.float32
            else:  # promote
                to = _promote_type(lower, _flat_tensors(args, kwargs))
            args = tuple(_cached_cast(cache, lower, to, a) for a in args)
            kwargs = {k: _cached_cast(cache, lower, to, v) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return cast


# -- the override ----------------------------------------------------------------------------

_ACTIVE = threading.Lock()


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active, CPU autocast casts as CUDA autocast does (see the module docstring).

    Enter it around the whole step (forward, backward, optimizer): checkpointed blocks
    recompute under autocast inside backward. Autocast itself is still entered by the caller
    (``torch.autocast("cpu", dtype)``), which sets the dtype and the cache's lifetime.
    """
    # The override is process-wide: two traces in threads take turns.
    _ACTIVE.acquire()
    cache = _Cache()
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        original_clear()
        cache.clear()

    try:
        with warnings.catch_warnings():
            # Overriding a kernel warns once per process; here it is the point.
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
            warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
            cuda_ops = _registered_cuda_ops()
            for name in sorted(cuda_ops):
                lib.impl(name, _kernel(name, CUDA_POLICY[name], cache), "AutocastCPU")
            for name in sorted(_registered_cpu_ops() - cuda_ops):
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        torch.clear_autocast_cache = clear_autocast_cache
        yield
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()
        lib._destroy()
        _ACTIVE.release()


_CPU_OPS: set[str] | None = None
_CUDA_OPS: set[str] | None = None


def _registered_cpu_ops() -> set[str]:
    # Read once, before any override of ours is registered on the key.
    global _CPU_OPS
    if _CPU_OPS is None:
        _CPU_OPS = _registered("AutocastCPU")
    return _CPU_OPS


def _registered_cuda_ops() -> set[str]:
    """CUDA's policy for the overloads the installed torch registers on AutocastCUDA; an
    overload it registers that the table lacks would be cast wrongly, so it is an error."""
    global _CUDA_OPS
    if _CUDA_OPS is None:
        _registered_cpu_ops()
        registered = cuda_autocast_ops()
        unknown = registered - set(CUDA_POLICY)
        if unknown:
            raise RuntimeError(f"CUDA autocast policy unknown for {sorted(unknown)} in torch "
                               f"{torch.__version__}; add them to estimators.tracing._cuda_autocast")
        _CUDA_OPS = registered
    return _CUDA_OPS
