"""Run a traced step on CPU tensors the way a CUDA card would run it.

A trace for a CUDA target runs fake CPU tensors (FACTS.md: fake CUDA tensors abort in
backward). Wherever PyTorch's CPU and CUDA kernels keep different tensors, the trace takes
CUDA's, for the whole step (forward, backward with checkpoint recomputation, optimizer):

* autocast casts as CUDA's does (:mod:`estimators.tracing._cuda_autocast`);
* ``scaled_dot_product_attention`` runs the backend the card would pick (:mod:`estimators.tracing._sdpa`);
* ``dropout`` runs CUDA's fused ``native_dropout`` (``at::native::dropout`` takes it when the
  input is on CUDA, 0 < p < 1 and the input is not empty), which keeps a bool mask for
  backward, where the CPU path (``_dropout_impl``) keeps a noise tensor of the input's dtype
  (4 bytes per element in fp32, not 1);
* the optimizer runs its foreach implementation unless the model file chose otherwise (done
  by the trace itself, see ``estimators.runtime._step._use_foreach``).

Overrides are registered on the dispatcher while :func:`cuda_semantics` is active and removed
after; the CPU target never sees them.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from .._config import Precision
from ..runtime._precision import autocast_dtype
from . import _sdpa
from ._cuda_autocast import cuda_autocast_policy

__all__ = ["cuda_semantics", "CudaRun", "DEFAULT_CAPABILITY", "cuda_notes", "trace_semantics", "semantics_notes"]

_TURN = threading.Lock()  # the overrides are process-wide: one CUDA-semantics step at a time

DEFAULT_CAPABILITY = (8, 0)
"""Compute capability assumed when the target card's is unknown."""


class CudaRun:
    """What a CUDA-semantics trace met (which attention backends), for the estimate's notes."""

    def __init__(self, capability: tuple[int, int], autocast: bool) -> None:
        self.capability = capability
        self.autocast = autocast
        self.attention: Counter[str] = Counter()


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if train and 0.0 < p < 1.0 and x.numel() > 0:
        return torch.ops.aten.native_dropout.default(x, p, train)[0]
    # _dropout_impl for the cases the fused kernel does not take.
    if p == 0.0 or not train or x.numel() == 0:
        return x
    return x * torch.zeros((), dtype=x.dtype, device=x.device)


def _sdpa_kernel(run: CudaRun) -> Callable[..., torch.Tensor]:
    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        backend = _sdpa.choose_backend(run.capability, query, key, value, attn_mask, dropout_p,
                                       is_causal, enable_gqa)
        run.attention[backend] += 1
        return _sdpa.run_backend(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return sdpa


@contextlib.contextmanager
def cuda_semantics(capability: tuple[int, int] | None, *, autocast: bool,
                   fused_attention: bool = True) -> Iterator[CudaRun]:
    """CUDA's kernels' memory semantics on CPU tensors while active (see the module docstring).

    ``autocast=True`` also swaps CPU autocast's policy for CUDA's (mixed precision); the caller
    still enters ``torch.autocast("cpu", dtype)`` around the forward pass.
    ``fused_attention=False`` leaves attention to the CPU's kernels: CUDA's fused attention ops
    have meta kernels (fake tensors) but no CPU ones (a real run).
    """
    cap = capability if capability and capability != (0, 0) else DEFAULT_CAPABILITY
    run = CudaRun(cap, autocast)
    lib = torch.library.Library("aten", "IMPL")
    with contextlib.ExitStack() as stack:
        _TURN.acquire()
        stack.callback(_TURN.release)
        stack.callback(lib._destroy)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
            warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
            lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
            if fused_attention:
                lib.impl("scaled_dot_product_attention", _sdpa_kernel(run), "CompositeImplicitAutograd")
        if autocast:
            stack.enter_context(cuda_autocast_policy())
        yield run


def cuda_notes(run: CudaRun | None, op_names: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The assumptions a CUDA-semantics trace made, for ``Estimate.notes`` (``op_names``: the
    aten ops the trace ran)."""
    if run is None:
        return []
    modelled = "CUDA autocast op policy and weight cache, " if run.autocast else ""
    notes = [f"CUDA kernels modelled on CPU: {modelled}bool dropout masks (native_dropout)"]
    if run.attention:
        used = ", ".join(f"{name} x{n}" for name, n in sorted(run.attention.items()))
        notes.append(f"attention backend on sm{run.capability[0]}{run.capability[1]}: {used} "
                     f"(assumes cuDNN {_sdpa.ASSUMED_CUDNN // 10000}.{_sdpa.ASSUMED_CUDNN // 100 % 100}, "
                     "flash/mem-efficient built in, no sdpa_kernel selection)")
    if any("convolution" in name for name in op_names):
        notes.append("cuDNN convolution workspaces not modelled: cuDNN may pick algorithms whose "
                     "workspace takes free memory up to its limit; keep headroom")
    return notes


@contextlib.contextmanager
def trace_semantics(
    precision: Precision | str, *, cuda: bool, capability: tuple[int, int] | None = None, fake: bool = True
) -> Iterator[CudaRun | None]:
    """Around a whole traced step (forward, backward, optimizer) for a CUDA target: the trace's
    CPU tensors take CUDA's kernel semantics, so that ``runtime._precision.forward_context``'s CPU autocast
    casts as ``torch.autocast("cuda", dtype)`` does (see :func:`cuda_semantics`). The
    trainer on a real GPU runs real CUDA autocast and needs none of this. Yields what the
    trace met (for :func:`semantics_notes`), or None for a CPU target.
    """
    if not cuda:
        yield None
        return
    with cuda_semantics(capability, autocast=autocast_dtype(precision) is not None, fused_attention=fake) as run:
        yield run


def semantics_notes(run: CudaRun | None, op_names: set[str] | None = None) -> list[str]:
    """The assumptions a :func:`trace_semantics` trace made (``op_names``: the aten ops it ran),
    for the estimate's notes."""
    if run is None:
        return []
    return cuda_notes(run, op_names or set())
