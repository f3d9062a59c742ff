"""The spec table of common NVIDIA GPUs (``GPUSpec`` rows), a data table kept in one place.

Lookup by name and detection of the local card are in ``_gpus``.

Conventions of the table (read these before using a number from it):

* ``memory_bytes`` is the total that NVML (and so ``nvidia-smi``) reports, e.g. 81,559 MiB for an
  H100 SXM sold as "80 GB". ``torch.cuda.get_device_properties().total_memory`` (CUDA's view)
  is a few hundred MiB smaller on most cards; budgets built on the table subtract
  ``context_bytes`` and a margin on top.
* ``tflops`` are *dense* (no 2:4 sparsity) peak rates in TFLOP/s from the vendor datasheet or
  whitepaper: ``"fp32"`` is the CUDA-core FP32 rate, ``"tf32"``/``"fp16"``/``"bf16"`` the
  tensor-core rates **with FP32 accumulation** (what PyTorch's matmuls use). GeForce cards run
  FP32-accumulate at half their FP16-accumulate rate, so their ``fp16`` is half the marketed
  "tensor TFLOPS". Every row holds all four keys; 0.0 means unsupported.
* ``interconnect_bytes_per_s`` is the per-GPU bandwidth in **one direction** (NVIDIA quotes
  both directions added: "600 GB/s NVLink" is 300e9 here). Cards without NVLink get their PCIe
  x16 link (Gen3 16e9, Gen4 32e9, Gen5 64e9). GeForce cards cannot do peer-to-peer over PCIe,
  so collectives between them go through host memory and are slower still.
* ``cublas_workspace_bytes`` mirrors PyTorch's default (``CublasHandlePool.cpp``): 32 MiB on
  compute capability 9.x/10.x/12.x, ``4096·1024·2 + 16·1024·8`` = 8,519,680 B otherwise.
* ``context_bytes`` is not measured per card: 400 MiB for every row, the upper end of the
  300–400 MB that a CUDA context takes with lazy loading (FACTS.md). Calibrate on a GPU.
  Published figures for comparison (``shared/data/published_gpu_runs.md``): 1343 MiB on a
  V100 with torch ~1.10 / CUDA 11.2 (no lazy loading; ``torch.ones(1, 1).to("cuda")`` alone,
  Hugging Face's perf_train_gpu_one page); 648.5 MB of NVML memory beyond
  ``max_memory_reserved`` on an A10G with torch 2.3–2.5 / CUDA 12 (optimum-benchmark), which
  also holds the cuBLAS/cuDNN handles' memory: a modern stack's context plus handles may exceed
  the table's figure by up to ~220 MiB.

Known limitations: MIG slices are seen as the whole GPU; PCIe variants of the V100 are not in the
table (detection treats them as unknown cards); clocks are boost clocks.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, NoReturn

from .._errors import ConfigError

__all__ = ["GPUSpec", "GPU_SPECS"]

# The dtypes ``GPUSpec.tflops`` always holds.
_DTYPES: Final = ("fp32", "tf32", "fp16", "bf16")

_MIB: Final = 2**20
_CUBLAS_DEFAULT: Final = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B
_CUBLAS_32MIB: Final = 4096 * 8 * 1024  # 33,554,432 B
_CONTEXT_BYTES: Final = 400 * _MIB

# Per direction, x16 link; GB/s as NVIDIA quotes them (rounded lane rates × 16).
_PCIE_GEN3: Final = 16e9
_PCIE_GEN4: Final = 32e9
_PCIE_GEN5: Final = 64e9


class _ReadOnlyRates(dict[str, float]):
    """The ``tflops`` mapping: a dict that refuses changes (and pickles, unlike mappingproxy)."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("GPUSpec.tflops is read-only; build a new spec with "
                        "dataclasses.replace(spec, tflops={...})")

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple[type, tuple[dict[str, float]]]:
        return (type(self), (dict(self),))


def _cublas_workspace_for(capability: tuple[int, int]) -> int:
    """PyTorch's default cuBLAS workspace per (handle, stream) on a card of this capability."""
    return _CUBLAS_32MIB if capability[0] in (9, 10, 12) else _CUBLAS_DEFAULT


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """What memplan needs to know about one GPU model.

    Build one yourself for a card that is not in :data:`GPU_SPECS` (``dataclasses.replace`` on
    a similar row is the easy way). Validation names the field that is wrong.

    Example:
        >>> from estimators import get_gpu
        >>> spec = get_gpu("A100-80GB")
        >>> spec.memory_bytes, spec.tflops["bf16"], spec.bf16
        (85899345920, 312.0, True)
    """

    name: str
    """Canonical name such as ``"A100-80GB"``; for a card detected outside the table, the
    name NVML reports (``"NVIDIA GeForce RTX 4060"``)."""
    memory_bytes: int
    """Total device memory in bytes as NVML reports it (see the module docstring)."""
    compute_capability: tuple[int, int]
    """CUDA compute capability, e.g. ``(8, 0)``; ``(0, 0)`` when NVML could not tell."""
    bf16: bool
    """Whether bf16 tensor cores exist (compute capability ≥ 8.0); always equal to
    ``tflops["bf16"] > 0``."""
    tflops: Mapping[str, float] = field(hash=False)
    """Dense peak TFLOP/s per dtype (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``); missing
    keys are filled with 0.0 (unsupported) and the mapping is made read-only."""
    bandwidth_bytes_per_s: float
    """Peak device-memory (HBM/GDDR) bandwidth in bytes per second."""
    cublas_workspace_bytes: int
    """PyTorch's default cuBLAS workspace per (handle, stream) on this card."""
    context_bytes: int
    """Device memory the CUDA context and loaded kernels take outside PyTorch's allocator."""
    interconnect_bytes_per_s: float
    """Per-GPU, one-direction bandwidth to the other GPUs (NVLink, else the PCIe link)."""
    aliases: tuple[str, ...] = ()
    """Other names :func:`get_gpu` accepts, including the names NVML reports."""
    from_table: bool = True
    """``False`` for a spec :func:`detect_local_gpu` built from NVML readings for a card that is
    not in the table; its ``tflops`` are then conservative guesses, not datasheet numbers."""

    def __post_init__(self) -> None:
        where = f"GPUSpec(name={self.name!r})"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"GPUSpec: name must be a non-empty string, got {self.name!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) \
                or self.memory_bytes <= 0:
            raise ConfigError(f"{where}: memory_bytes must be an int > 0, "
                              f"got {self.memory_bytes!r}")
        try:
            capability = tuple(self.compute_capability)
        except TypeError:
            capability = ()
        if len(capability) != 2 or not all(isinstance(v, int) and v >= 0 for v in capability):
            raise ConfigError(f"{where}: compute_capability must be two ints such as (8, 0), "
                              f"got {self.compute_capability!r}")
        object.__setattr__(self, "compute_capability", capability)
        unknown = set(self.tflops) - set(_DTYPES)
        if unknown:
            raise ConfigError(f"{where}: tflops has unknown dtype(s) {sorted(unknown)}; "
                              f"use {', '.join(_DTYPES)}")
        rates = {dtype: float(self.tflops.get(dtype, 0.0)) for dtype in _DTYPES}
        for dtype, rate in rates.items():
            if not math.isfinite(rate) or rate < 0:
                raise ConfigError(f"{where}: tflops[{dtype!r}] must be a finite number ≥ 0, "
                                  f"got {rate!r}")
        if rates["fp32"] <= 0:
            raise ConfigError(f"{where}: tflops['fp32'] must be > 0")
        if self.bf16 != (rates["bf16"] > 0):
            raise ConfigError(f"{where}: bf16={self.bf16} disagrees with "
                              f"tflops['bf16']={rates['bf16']}; set both or neither")
        object.__setattr__(self, "tflops", _ReadOnlyRates(rates))
        for name in ("bandwidth_bytes_per_s", "interconnect_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                    or (name == "bandwidth_bytes_per_s" and value == 0):
                raise ConfigError(f"{where}: {name} must be a finite number "
                                  f"{'> 0' if name == 'bandwidth_bytes_per_s' else '≥ 0'}, "
                                  f"got {value!r}")
        for name in ("cublas_workspace_bytes", "context_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}: {name} must be an int ≥ 0, got {value!r}")
        object.__setattr__(self, "aliases", tuple(self.aliases))


def _row(name: str, *, memory_mib: int, cc: tuple[int, int], fp32: float, tf32: float,
         fp16: float, bf16: float, bandwidth: float, interconnect: float,
         aliases: Iterable[str] = ()) -> GPUSpec:
    return GPUSpec(
        name=name,
        memory_bytes=memory_mib * _MIB,
        compute_capability=cc,
        bf16=bf16 > 0,
        tflops={"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": bf16},
        bandwidth_bytes_per_s=bandwidth,
        cublas_workspace_bytes=_cublas_workspace_for(cc),
        context_bytes=_CONTEXT_BYTES,
        interconnect_bytes_per_s=interconnect,
        aliases=tuple(aliases),
    )


# memory_mib: the total nvidia-smi prints for the card (checked in published nvidia-smi output
# for every row). Rates: dense, FP32 accumulation (see the module docstring).
_TABLE: Final[tuple[GPUSpec, ...]] = (
    # NVIDIA V100 datasheet (SXM2): 15.7 FP32, 125 tensor (FP16), 900 GB/s, NVLink2 300 GB/s.
    _row("V100-16GB", memory_mib=16160, cc=(7, 0), fp32=15.7, tf32=0.0, fp16=125.0, bf16=0.0,
         bandwidth=900e9, interconnect=150e9,
         aliases=("Tesla V100-SXM2-16GB", "V100-SXM2-16GB", "V100 SXM2 16GB")),
    _row("V100-32GB", memory_mib=32768, cc=(7, 0), fp32=15.7, tf32=0.0, fp16=125.0, bf16=0.0,
         bandwidth=900e9, interconnect=150e9,
         aliases=("Tesla V100-SXM2-32GB", "V100-SXM2-32GB", "V100 SXM2 32GB")),
    # NVIDIA T4 datasheet: 8.1 FP32, 65 mixed-precision FP16/FP32, 320 GB/s, PCIe Gen3.
    _row("T4", memory_mib=15360, cc=(7, 5), fp32=8.1, tf32=0.0, fp16=65.0, bf16=0.0,
         bandwidth=320e9, interconnect=_PCIE_GEN3, aliases=("Tesla T4", "T4-16GB")),
    # NVIDIA A10 datasheet: 31.2 FP32, 62.5 TF32, 125 BF16/FP16, 600 GB/s, PCIe Gen4.
    _row("A10", memory_mib=23028, cc=(8, 6), fp32=31.2, tf32=62.5, fp16=125.0, bf16=125.0,
         bandwidth=600e9, interconnect=_PCIE_GEN4, aliases=("A10-24GB",)),
    # AWS's A10G (g5 instances) has no NVIDIA datasheet; figures as compared by Baseten
    # ("NVIDIA A10 vs A10G"): 35 FP32, 35 TF32, 70 BF16/FP16, 600 GB/s.
    _row("A10G", memory_mib=23028, cc=(8, 6), fp32=35.0, tf32=35.0, fp16=70.0, bf16=70.0,
         bandwidth=600e9, interconnect=_PCIE_GEN4, aliases=("A10G-24GB",)),
    # NVIDIA A100 datasheet: 19.5 FP32, 156 TF32, 312 BF16/FP16; SXM4 NVLink3 600 GB/s.
    _row("A100-40GB", memory_mib=40960, cc=(8, 0), fp32=19.5, tf32=156.0, fp16=312.0,
         bf16=312.0, bandwidth=1.555e12, interconnect=300e9,
         aliases=("A100-SXM4-40GB", "A100-SXM-40GB", "A100 40GB SXM")),
    _row("A100-80GB", memory_mib=81920, cc=(8, 0), fp32=19.5, tf32=156.0, fp16=312.0,
         bf16=312.0, bandwidth=2.039e12, interconnect=300e9,
         aliases=("A100-SXM4-80GB", "A100-SXM-80GB", "A100 80GB SXM")),
    # NVIDIA A100 datasheet, PCIe columns: same compute, 1,555 / 1,935 GB/s, PCIe Gen4
    # (the optional NVLink bridge pairs two cards only and is not modelled).
    _row("A100-40GB-PCIE", memory_mib=40960, cc=(8, 0), fp32=19.5, tf32=156.0, fp16=312.0,
         bf16=312.0, bandwidth=1.555e12, interconnect=_PCIE_GEN4,
         aliases=("A100-PCIE-40GB", "A100 40GB PCIe")),
    _row("A100-80GB-PCIE", memory_mib=81920, cc=(8, 0), fp32=19.5, tf32=156.0, fp16=312.0,
         bf16=312.0, bandwidth=1.935e12, interconnect=_PCIE_GEN4,
         aliases=("A100 80GB PCIe", "A100-PCIE-80GB")),
    # NVIDIA H100 datasheet, SXM5: 67 FP32, 494.7 TF32, 989.4 BF16/FP16, 3.35 TB/s,
    # NVLink4 900 GB/s.
    _row("H100-80GB", memory_mib=81559, cc=(9, 0), fp32=67.0, tf32=494.7, fp16=989.4,
         bf16=989.4, bandwidth=3.35e12, interconnect=450e9,
         aliases=("H100 80GB HBM3", "H100-SXM", "H100-SXM5", "H100-SXM5-80GB", "H100 SXM")),
    # NVIDIA H100 datasheet, PCIe: 51 FP32, 378 TF32, 756 BF16/FP16, 2.0 TB/s, PCIe Gen5.
    _row("H100-PCIE", memory_mib=81559, cc=(9, 0), fp32=51.0, tf32=378.0, fp16=756.0,
         bf16=756.0, bandwidth=2.0e12, interconnect=_PCIE_GEN5,
         aliases=("H100 PCIe", "H100-PCIE-80GB", "H100-80GB-PCIE")),
    # NVIDIA H200 datasheet (SXM): H100 SXM compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _row("H200", memory_mib=143771, cc=(9, 0), fp32=67.0, tf32=494.7, fp16=989.4,
         bf16=989.4, bandwidth=4.8e12, interconnect=450e9,
         aliases=("H200-141GB", "H200-SXM", "H200 SXM", "H200-SXM-141GB")),
    # NVIDIA L4 datasheet: 30.3 FP32, 120/242 TF32/FP16 with sparsity -> 60/121 dense, 300 GB/s.
    _row("L4", memory_mib=23034, cc=(8, 9), fp32=30.3, tf32=60.0, fp16=121.0, bf16=121.0,
         bandwidth=300e9, interconnect=_PCIE_GEN4, aliases=("L4-24GB",)),
    # NVIDIA L40S datasheet: 91.6 FP32, 183 TF32, 362.05 BF16/FP16 dense, 864 GB/s.
    _row("L40S", memory_mib=46068, cc=(8, 9), fp32=91.6, tf32=183.0, fp16=362.05,
         bf16=362.05, bandwidth=864e9, interconnect=_PCIE_GEN4, aliases=("L40S-48GB",)),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): 35.6 FP32, 35.6 TF32, 71 FP16/BF16 with FP32
    # accumulate, 936 GB/s.
    _row("RTX-3090", memory_mib=24576, cc=(8, 6), fp32=35.6, tf32=35.6, fp16=71.0, bf16=71.0,
         bandwidth=936e9, interconnect=_PCIE_GEN4, aliases=("3090", "RTX 3090 24GB")),
    # NVIDIA Ada whitepaper (RTX 4090): 82.6 FP32, 82.6 TF32, 165.2 FP16/BF16 with FP32
    # accumulate, 1,008 GB/s.
    _row("RTX-4090", memory_mib=24564, cc=(8, 9), fp32=82.6, tf32=82.6, fp16=165.2, bf16=165.2,
         bandwidth=1008e9, interconnect=_PCIE_GEN4, aliases=("4090", "RTX 4090 24GB")),
    # NVIDIA GA102 whitepaper (RTX A6000): 38.7 FP32, 77.4 TF32, 154.8 FP16/BF16, 768 GB/s.
    _row("RTX-A6000", memory_mib=49140, cc=(8, 6), fp32=38.7, tf32=77.4, fp16=154.8,
         bf16=154.8, bandwidth=768e9, interconnect=_PCIE_GEN4, aliases=("A6000",)),
    # Consumer cards: NVIDIA spec pages give FP32 and memory bandwidth; tensor rates derived from
    # SM count × 512 FP16 FMA/clock/SM (GA10x, AD10x) × boost clock, halved for FP32 accumulate.
    # RTX 3060 12GB: 28 SMs at 1.777 GHz, 360 GB/s.
    _row("RTX-3060", memory_mib=12288, cc=(8, 6), fp32=12.7, tf32=12.7, fp16=25.5, bf16=25.5,
         bandwidth=360e9, interconnect=_PCIE_GEN4, aliases=("3060", "RTX 3060 12GB")),
    # RTX 3070 8GB: 46 SMs at 1.725 GHz, 448 GB/s.
    _row("RTX-3070", memory_mib=8192, cc=(8, 6), fp32=20.3, tf32=20.3, fp16=40.6, bf16=40.6,
         bandwidth=448e9, interconnect=_PCIE_GEN4, aliases=("3070", "RTX 3070 8GB")),
    # RTX 4070 12GB: 46 SMs at 2.475 GHz, 504 GB/s.
    _row("RTX-4070", memory_mib=12282, cc=(8, 9), fp32=29.1, tf32=29.1, fp16=58.3, bf16=58.3,
         bandwidth=504e9, interconnect=_PCIE_GEN4, aliases=("4070", "RTX 4070 12GB")),
)

#: The spec table, canonical name → spec: datacenter cards by generation, then workstation and
#: consumer cards. Read-only.
GPU_SPECS: Final[Mapping[str, GPUSpec]] = types.MappingProxyType({s.name: s for s in _TABLE})
