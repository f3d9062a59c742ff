"""GPUs by name (the spec table of ``_gpu_table``), and detection of the local one through NVML.

Names are matched loosely (case, punctuation and vendor words do not matter; aliases such as
"Tesla V100-SXM2-16GB" are rows' other names); an unknown name is refused with the closest
names the table has. Detection reads NVML, and describes a card the table lacks from what
NVML reports (see :func:`detect_local_gpu`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable
from types import ModuleType
from typing import Final, SupportsFloat, SupportsInt, TypedDict, cast

from .._errors import ConfigError, UnknownGPUError
from ._gpu_table import _CONTEXT_BYTES, _DTYPES, _PCIE_GEN3, _TABLE, GPU_SPECS, GPUSpec, _cublas_workspace_for

__all__ = ["GPUSpec", "GPU_SPECS", "get_gpu", "detect_local_gpu", "gpu_names"]


# Words that vendors put in front of model names and that never tell two cards apart.
_NOISE_WORDS: Final = frozenset({"nvidia", "geforce", "tesla"})


def _normalize(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` → ``"a100sxm480gb"``: lower case, punctuation and vendor
    words dropped, so that spaces, dashes and underscores do not matter."""
    words = re.split(r"[^0-9a-z]+", name.lower())
    return "".join(w for w in words if w and w not in _NOISE_WORDS)


def _build_index(specs: Iterable[GPUSpec]) -> dict[str, GPUSpec]:
    index: dict[str, GPUSpec] = {}
    for spec in specs:
        for label in (spec.name, *spec.aliases):
            key = _normalize(label)
            other = index.setdefault(key, spec)
            if other is not spec:
                raise RuntimeError(f"GPU table: {label!r} of {spec.name} collides with "
                                   f"{other.name} (both normalise to {key!r})")
    return index


_INDEX: Final = _build_index(_TABLE)


def gpu_names() -> list[str]:
    """The canonical names in the table.

    Example:
        >>> "H100-80GB" in gpu_names()
        True
    """
    return list(GPU_SPECS)


def _lookup(name: str) -> GPUSpec | None:
    return _INDEX.get(_normalize(name))


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name.

    Matching ignores case, spaces, dashes, underscores and the words "NVIDIA", "GeForce" and
    "Tesla", and knows the aliases of each row, including the names NVML reports.

    Args:
        name: ``"A100-80GB"``, ``"a100 80gb"``, ``"A100_80GB"``, ``"NVIDIA A100-SXM4-80GB"``...

    Returns:
        The table row.

    Raises:
        UnknownGPUError: with one line naming the closest known names and listing all of them.

    Example:
        >>> get_gpu("NVIDIA A100-SXM4-80GB").name, get_gpu("rtx 4090").name
        ('A100-80GB', 'RTX-4090')
    """
    spec = _lookup(name) if isinstance(name, str) else None
    if spec is not None:
        return spec
    suggestion = _suggest(name) if isinstance(name, str) else []
    hint = ""
    if suggestion:
        quoted = [repr(s) for s in suggestion]
        options = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        hint = f" (did you mean {options}?)"
    raise UnknownGPUError(
        f"unknown GPU {name!r}{hint}; known GPUs: {', '.join(GPU_SPECS)} "
        "(case, spaces and dashes do not matter)"
    )


def _suggest(name: str) -> list[str]:
    """Canonical names to suggest for an unknown name: every row the query is a prefix of
    (``"A100"`` → both A100s), else difflib's closest matches."""
    query = _normalize(name)
    if not query:
        return []
    found: list[str] = []
    for key, spec in _INDEX.items():
        if key.startswith(query) and spec.name not in found:
            found.append(spec.name)
    if not found:
        for key in difflib.get_close_matches(query, list(_INDEX), n=3, cutoff=0.6):
            if _INDEX[key].name not in found:
                found.append(_INDEX[key].name)
    order = list(GPU_SPECS)
    return sorted(found, key=order.index)[:4]


# --------------------------------------------------------------------------------------------
# Detection through NVML


def detect_local_gpu(*, index: int | None = None) -> GPUSpec | None:
    """Describe the local GPU from NVML, or return ``None`` when there is none to describe.

    The card is the first one ``CUDA_VISIBLE_DEVICES`` names (an index or a ``GPU-…`` UUID),
    else NVML's device 0; ``index`` picks an NVML index explicitly. ``CUDA_VISIBLE_DEVICES``
    set to ``""`` or ``-1`` means no GPU.

    A card in the table comes back as its row, with ``memory_bytes`` replaced by what NVML
    reports (variants such as an 8 GB RTX 3060 differ from the row). Any other card comes back
    with ``from_table=False``, the NVML name, memory and compute capability, bandwidth from
    bus width × memory clock, and conservative guesses for ``tflops``: FP32 from CUDA cores ×
    SM clock, tensor rates at 1× (TF32) and 2× (FP16/BF16) of that — the lowest ratios any card
    in the table has. Without core counts, the lowest rates among table rows of the same
    architecture are used.

    Returns:
        The spec, or ``None`` when ``pynvml`` is missing, NVML fails (no driver:
        ``NVMLError_LibraryNotFound``) or no device is visible.

    Example:
        >>> spec = detect_local_gpu()
        >>> spec is None or spec.memory_bytes > 0
        True
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, OSError...
        return None
    try:
        readings = _read_nvml(pynvml, index)
    except Exception:  # any NVMLError while reading: report "cannot tell", never crash
        readings = None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    if readings is None:
        return None
    try:
        return _spec_from_readings(readings)
    except ConfigError:  # NVML reported what no usable GPU has (0 bytes of memory, say)
        return None


class _Readings(TypedDict):
    """What NVML says of a device; the optional readings as NVML gave them, or None."""

    name: str
    memory_total: int
    capability: object
    bus_width_bits: object
    mem_clock_mhz: object
    sm_clock_mhz: object
    cuda_cores: object
    pcie_gen: object
    pcie_width: object


def _read_nvml(pynvml: ModuleType, index: int | None) -> _Readings | None:
    """The raw facts about the chosen device; optional ones are ``None`` when NVML lacks them."""
    if pynvml.nvmlDeviceGetCount() < 1:
        return None
    if index is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible is not None else "0"
        if not first or first.startswith("-"):
            return None
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
    else:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def optional(fn_name: str, *args: int) -> object:
        fn = getattr(pynvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(handle, *args)
        except Exception:  # NVML_ERROR_NOT_SUPPORTED on some cards and drivers
            return None

    name = pynvml.nvmlDeviceGetName(handle)
    if isinstance(name, bytes):  # older pynvml returns bytes
        name = name.decode(errors="replace")
    clock_mem = getattr(pynvml, "NVML_CLOCK_MEM", 2)
    clock_sm = getattr(pynvml, "NVML_CLOCK_SM", 1)
    return {
        "name": str(name).strip(),
        "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        "capability": optional("nvmlDeviceGetCudaComputeCapability"),
        "bus_width_bits": optional("nvmlDeviceGetMemoryBusWidth"),
        "mem_clock_mhz": optional("nvmlDeviceGetMaxClockInfo", clock_mem),
        "sm_clock_mhz": optional("nvmlDeviceGetMaxClockInfo", clock_sm),
        "cuda_cores": optional("nvmlDeviceGetNumGpuCores"),
        "pcie_gen": optional("nvmlDeviceGetMaxPcieLinkGeneration"),
        "pcie_width": optional("nvmlDeviceGetMaxPcieLinkWidth"),
    }


# Usable bytes per second per lane and direction, by PCIe generation (after line encoding).
_PCIE_LANE_BYTES: Final = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.877e9}


def _positive(value: object) -> float | None:
    try:
        number = float(cast(SupportsFloat, value))  # an NVML reading: what is no number raises
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _spec_from_readings(r: _Readings) -> GPUSpec:
    memory = r["memory_total"]
    row = _lookup(r["name"])
    if row is not None:
        return row if row.memory_bytes == memory else dataclasses.replace(row, memory_bytes=memory)

    try:
        major, minor = (int(v) for v in cast(Iterable[SupportsInt], r["capability"]))  # raises if not numbers
        capability = (major, minor)
    except (TypeError, ValueError):
        capability = (0, 0)
    has_bf16 = capability >= (8, 0)
    has_tf32 = capability >= (8, 0)

    cores, sm_clock = _positive(r["cuda_cores"]), _positive(r["sm_clock_mhz"])
    if cores and sm_clock:
        fp32 = cores * 2 * sm_clock * 1e6 / 1e12
        tflops = {"fp32": fp32, "tf32": fp32 if has_tf32 else 0.0,
                  "fp16": 2 * fp32, "bf16": 2 * fp32 if has_bf16 else 0.0}
    else:
        tflops = _weakest_similar(capability)

    bus, mem_clock = _positive(r["bus_width_bits"]), _positive(r["mem_clock_mhz"])
    if bus and mem_clock:
        # Double data rate: NVML's memory clock counts one edge (A100-80GB: 5120 bit, 1593 MHz
        # -> 2.039e12 B/s; RTX 4090: 384 bit, 10501 MHz -> 1.008e12 B/s).
        bandwidth = bus / 8 * mem_clock * 1e6 * 2
    else:
        bandwidth = min(s.bandwidth_bytes_per_s for s in _TABLE)

    gen, width = _positive(r["pcie_gen"]), _positive(r["pcie_width"])
    lane = _PCIE_LANE_BYTES.get(int(gen)) if gen else None
    interconnect = lane * width if lane and width else _PCIE_GEN3

    return GPUSpec(
        name=r["name"] or "unknown NVIDIA GPU",
        memory_bytes=memory,
        compute_capability=capability,
        bf16=has_bf16,
        tflops=tflops,
        bandwidth_bytes_per_s=bandwidth,
        cublas_workspace_bytes=_cublas_workspace_for(capability),
        context_bytes=_CONTEXT_BYTES,
        interconnect_bytes_per_s=interconnect,
        from_table=False,
    )


def _weakest_similar(capability: tuple[int, int]) -> dict[str, float]:
    """Per dtype, the lowest rate among table rows of the same architecture family (same major
    version, not newer), else among older rows, else among all rows."""
    rows = [s for s in _TABLE
            if s.compute_capability[0] == capability[0] and s.compute_capability <= capability]
    rows = rows or [s for s in _TABLE if s.compute_capability <= capability] or list(_TABLE)
    rates: dict[str, float] = {}
    for dtype in _DTYPES:
        supported = [s.tflops[dtype] for s in rows if s.tflops[dtype] > 0]
        rates[dtype] = min(supported) if supported else 0.0
    if capability < (8, 0):  # no bf16 / tf32 tensor cores before Ampere
        rates["bf16"] = rates["tf32"] = 0.0
    elif rates["bf16"] == 0.0:  # only pre-Ampere rows to learn from
        rates["bf16"], rates["tf32"] = rates["fp16"], rates["fp32"]
    return rates
