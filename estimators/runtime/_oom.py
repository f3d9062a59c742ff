"""Is this error an out-of-memory error? The trainer's recovery and the probes ask the same way."""

from __future__ import annotations

from .._errors import MemplanError

__all__ = ["is_oom_error"]

_OOM_PATTERNS = (
    "out of memory",                          # CUDA/HIP/MPS, "CUDA error: out of memory", the guard
    "can't allocate memory",                  # c10 DefaultCPUAllocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's OOM in disguise (as Lightning treats it)
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory.

    True for ``torch.OutOfMemoryError`` (CUDA's and the memory guard's), Python's
    ``MemoryError``, and errors whose message is an allocator failure: "out of memory",
    "DefaultCPUAllocator: can't allocate memory", ``CUBLAS_STATUS_ALLOC_FAILED``,
    ``CUDNN_STATUS_ALLOC_FAILED``, cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` (which cuDNN raises
    when its workspace cannot be allocated). An error raised *because of* an OOM (its
    ``__cause__``/``__context__`` chain holds one, e.g. a ``ModelFileError`` wrapping an OOM
    in ``model()``) counts too.

    Example:
        >>> import torch
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."))
        True
        >>> is_oom_error(ValueError("shapes do not match"))
        False
    """
    import torch

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or len(seen) > 16:
            continue
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, (RuntimeError, MemplanError)):
            text = str(e)
            if any(p in text for p in _OOM_PATTERNS) or "OutOfMemoryError" in text:
                return True
        todo.extend((e.__cause__, e.__context__))
    return False
