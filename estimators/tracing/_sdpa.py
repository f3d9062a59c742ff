"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA card, and running it on CPU.

On CUDA, SDPA picks a backend at run time (``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): the first of the priority order
whose checks pass. Each saves different tensors for backward, through the autograd formula of
its own aten op (``derivatives.yaml``):

* flash (``_scaled_dot_product_flash_attention``): q, k, v, the output, a float32 logsumexp of
  ``B×H×L`` and the philox seed/offset — no attention matrix, no dropout mask;
* memory-efficient (``_scaled_dot_product_efficient_attention``): the same plus the mask bias;
* cuDNN (``_scaled_dot_product_cudnn_attention``): the same as flash, logsumexp ``B×H×L×1``;
* math (``_scaled_dot_product_attention_math``): the ``B×H×L×S`` softmax (in fp32 for fp16 and
  bf16 inputs: the math kernel upcasts them) and, with dropout, its mask.

The fused ops have meta kernels, so fake CPU tensors run them (forward and backward) with the
shapes and dtypes CUDA would produce. :func:`choose_backend` follows the checks of
``can_use_flash_attention``, ``can_use_mem_efficient_attention`` and
``can_use_cudnn_attention`` that depend on the card and the inputs. Assumptions (named in the
estimate's notes): a CUDA build with flash and memory-efficient attention; cuDNN
:data:`ASSUMED_CUDNN` (9.17), so cuDNN comes first on sm90 and sm100/103 as PyTorch
prefers it there from cuDNN 9.15.1 on, and its head size limit is 128; no user backend
selection (``sdpa_kernel``) and no nested tensors.
"""

from __future__ import annotations

import torch

__all__ = ["ASSUMED_CUDNN", "choose_backend", "run_backend", "priority_order"]

ASSUMED_CUDNN = 91700
"""cuDNN version assumed for the target's torch build (``torch.backends.cudnn.version()``)."""

Capability = tuple[int, int]


def priority_order(capability: Capability, cudnn: int = ASSUMED_CUDNN) -> tuple[str, ...]:
    """``priority_order()``: flash, efficient, math, cudnn; cuDNN first on sm90/sm10x when
    cuDNN > 9.15.00 (``check_prefer_cudnn_attention``, CUDA < 13 wheels: minor 0 or 3)."""
    major, minor = capability
    if cudnn > 91500 and major in (9, 10) and minor in (0, 3):
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math", "cudnn")


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, enable_gqa: bool,
              *, singleton_ok: bool) -> bool:
    # check_tensor_shapes, check_batch_size_and_num_heads_dense, check_nonzero_sequence_lengths
    # and check_last_dim_stride_equals_1: the checks every fused backend shares.
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if k.size(1) != v.size(1):
        return False
    if q.size(1) != k.size(1) and not (enable_gqa and q.size(1) % k.size(1) == 0):
        return False
    if min(q.size(2), k.size(2), q.size(3)) == 0:
        return False
    for t in (q, k, v):
        if t.stride(-1) != 1 and not (singleton_ok and t.size(-1) == 1):
            return False
    if isinstance(mask, torch.Tensor) and mask.stride(-1) != 1 and mask.size(-1) != 1:
        return False
    return True


def _requires_grad(*tensors: object) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _can_flash(cap: Capability, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               dropout: float, causal: bool, gqa: bool) -> bool:
    if mask is not None or not (8, 0) <= cap <= (12, 1):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1) and d <= 256):
        return False
    if ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)) and _requires_grad(q, k, v):
        if not (d <= 192 or (dropout == 0.0 and d > 224)):
            return False
    if causal and q.size(-2) != k.size(-2):
        return False
    return _dense_ok(q, k, v, mask, gqa, singleton_ok=True)


def _gemm_alignment(cap: Capability, dtype: torch.dtype) -> int:
    half = dtype in (torch.float16, torch.bfloat16)
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    mn = 4 if cap[0] >= 8 else 1
    return max(mn, 128 // (16 if half else 32)) if tensor_cores else mn


def _can_efficient(cap: Capability, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   gqa: bool) -> bool:
    if not (5, 0) <= cap <= (12, 1):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    align = _gemm_alignment(cap, q.dtype)
    dq, dv = q.size(-1), v.size(-1)
    if not (dq == k.size(-1) and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0):
        return False
    if cap[0] >= 8:
        bytes_align = align * q.element_size()
        if any((t.storage_offset() * t.element_size()) % bytes_align for t in (q, k, v) if t.numel()):
            return False
    if not _dense_ok(q, k, v, mask, gqa, singleton_ok=False):
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype in allowed and q.dtype == k.dtype == v.dtype


def _cudnn_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    h, d = q.size(1), q.size(3)

    def unpacked(t: torch.Tensor) -> bool:
        s = t.size(2)
        return t.stride() == (s * h * d, d, h * d, 1)

    def packed(t: torch.Tensor) -> bool:
        s = t.size(2)
        return t.stride() == (s * 3 * h * d, d, 3 * h * d, 1)

    return packed(v) or (unpacked(q) and unpacked(k) and unpacked(v))


def _can_cudnn(cap: Capability, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               dropout: float, cudnn: int) -> bool:
    if cudnn < 90000 or not (8, 0) <= cap <= (12, 1):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    if dropout * 16.0 != int(dropout * 16.0):
        return False  # cuDNN's dropout resolution is 1/16
    if not _dense_ok(q, k, v, mask, True, singleton_ok=True):
        return False
    if max(q.size(0), q.size(1)) > 65535:
        return False
    d_qk, d_v = q.size(3), v.size(3)
    if d_qk > 128 or d_v > 128 or d_qk % 8 or d_v % 8:
        return False
    if k.size(2) == 1 or (dropout != 0.0 and q.size(2) == 1):
        return False
    return _cudnn_layout_ok(q, k, v)


def choose_backend(capability: Capability, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   enable_gqa: bool = False, *, cudnn: int = ASSUMED_CUDNN) -> str:
    """The backend ``select_sdp_backend`` picks on a card of ``capability``:
    ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``."""
    for backend in priority_order(capability, cudnn):
        if backend == "cudnn" and _can_cudnn(capability, q, k, v, attn_mask, dropout_p, cudnn):
            return backend
        if backend == "flash" and _can_flash(capability, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa):
            return backend
        if backend == "efficient" and _can_efficient(capability, q, k, v, attn_mask, enable_gqa):
            return backend
        if backend == "math":
            return backend
    return "math"


def _additive_mask(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    # convert_boolean_attn_mask: a bool mask becomes an additive one in the query's dtype.
    if isinstance(mask, torch.Tensor) and mask.dtype is torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return mask


def run_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """The attention output of ``backend``'s aten op, whose autograd node saves what that
    backend saves on CUDA."""
    grad = _requires_grad(q, k, v)
    if backend == "flash":
        if enable_gqa and q.size(1) != k.size(1):
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        if enable_gqa and q.size(1) != k.size(1):
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _additive_mask(attn_mask, q), grad, dropout_p, is_causal, scale=scale)[0]
    if backend == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, _additive_mask(attn_mask, q), grad, dropout_p, is_causal, False, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, _additive_mask(attn_mask, q), dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]
