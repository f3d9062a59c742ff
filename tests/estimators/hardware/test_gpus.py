"""Tests for estimators.hardware._gpus: the spec table, name lookup and NVML detection (faked on CPU)."""

from __future__ import annotations

import dataclasses
import doctest
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from estimators._errors import ConfigError, UnknownGPUError
from estimators.hardware import _gpus
from estimators.hardware._gpus import GPU_SPECS, GPUSpec, detect_local_gpu, get_gpu, gpu_names

REQUIRED = [
    "V100-16GB", "V100-32GB", "T4", "A10G", "A100-40GB", "A100-80GB", "H100-80GB", "H100-PCIE",
    "H200", "L4", "L40S", "RTX-3090", "RTX-4090", "RTX-A6000", "RTX-3060", "RTX-4070", "RTX-3070",
]


# ---------------------------------------------------------------------------- the table


def test_required_cards_are_in_the_table() -> None:
    assert set(REQUIRED) <= set(gpu_names())
    assert gpu_names() == list(GPU_SPECS)


@pytest.mark.parametrize("spec", list(GPU_SPECS.values()), ids=list(GPU_SPECS))
def test_table_rows_are_sane(spec: GPUSpec) -> None:
    assert spec.from_table
    assert spec.memory_bytes > 0
    assert spec.bf16 == (spec.compute_capability >= (8, 0))
    assert (spec.tflops["bf16"] > 0) == spec.bf16
    assert (spec.tflops["tf32"] > 0) == (spec.compute_capability >= (8, 0))
    assert set(spec.tflops) == {"fp32", "tf32", "fp16", "bf16"}
    # Tensor cores never lose to CUDA cores; FP16 tensor rates are at least twice FP32.
    assert spec.tflops["fp16"] >= 2 * spec.tflops["fp32"] * 0.99
    assert spec.tflops["tf32"] <= spec.tflops["fp16"]
    assert 1e11 < spec.bandwidth_bytes_per_s < 1e13
    assert spec.interconnect_bytes_per_s >= 16e9
    hopper = spec.compute_capability[0] == 9
    assert spec.cublas_workspace_bytes == (33_554_432 if hopper else 8_519_680)
    assert 300 * 10**6 <= spec.context_bytes <= 10**9
    # Memory within 10% of the marketed size in the name, where the name has one.
    for word in spec.name.split("-"):
        if word.endswith("GB") and word[:-2].isdigit():
            assert abs(spec.memory_bytes / (int(word[:-2]) * 2**30) - 1) < 0.1


def test_datasheet_figures() -> None:
    a100 = get_gpu("A100-80GB")
    assert a100.memory_bytes == 85_899_345_920
    assert dict(a100.tflops) == {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}
    assert a100.bandwidth_bytes_per_s == 2.039e12
    h100 = get_gpu("H100-80GB")
    assert h100.memory_bytes == 85_520_809_984
    assert h100.tflops["bf16"] == 989.4 and h100.tflops["tf32"] == 494.7
    assert h100.bandwidth_bytes_per_s == 3.35e12
    h200 = get_gpu("H200")
    assert dict(h200.tflops) == dict(h100.tflops)
    assert h200.bandwidth_bytes_per_s == 4.8e12
    assert 140e9 < h200.memory_bytes < 152e9
    assert get_gpu("RTX-4090").memory_bytes == 25_757_220_864
    assert get_gpu("V100-16GB").tflops["bf16"] == 0.0


def test_specs_are_frozen_hashable_and_picklable() -> None:
    spec = get_gpu("H200")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="read-only"):
        spec.tflops["bf16"] = 1.0  # type: ignore[index]
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert len({spec, get_gpu("h200"), get_gpu("A100-80GB")}) == 2


def _kwargs(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        name="Test", memory_bytes=2**30, compute_capability=(8, 0), bf16=True,
        tflops={"fp32": 1.0, "bf16": 2.0}, bandwidth_bytes_per_s=1e11,
        cublas_workspace_bytes=0, context_bytes=0, interconnect_bytes_per_s=0.0,
    )
    base.update(changes)
    return base


def test_spec_fills_missing_dtypes_with_zero() -> None:
    spec = GPUSpec(**_kwargs())
    assert dict(spec.tflops) == {"fp32": 1.0, "tf32": 0.0, "fp16": 0.0, "bf16": 2.0}


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"compute_capability": (8,)}, "compute_capability"),
        ({"tflops": {"fp32": 1.0, "bf16": 2.0, "fp8": 4.0}}, "fp8"),
        ({"tflops": {"fp32": 1.0, "bf16": -2.0}}, "tflops"),
        ({"tflops": {"fp32": 1.0}}, "bf16"),
        ({"bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s"),
        ({"context_bytes": -1}, "context_bytes"),
        ({"name": ""}, "name"),
    ],
)
def test_spec_validation_names_the_field(changes: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError, match=field_name):
        GPUSpec(**_kwargs(**changes))


# ---------------------------------------------------------------------------- lookup


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("A100-80GB", "A100-80GB"),
        ("a100 80gb", "A100-80GB"),
        ("A100_80GB", "A100-80GB"),
        ("  a100-80GB ", "A100-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIE"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB-PCIE"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("h100 sxm", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIE"),
        ("NVIDIA H200", "H200"),
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("rtx4090", "RTX-4090"),
        ("4090", "RTX-4090"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA GeForce RTX 3060", "RTX-3060"),
        ("RTX 3060 12GB", "RTX-3060"),
        ("NVIDIA GeForce RTX 3070", "RTX-3070"),
        ("NVIDIA GeForce RTX 4070", "RTX-4070"),
    ],
)
def test_get_gpu_normalises_names(query: str, expected: str) -> None:
    assert get_gpu(query).name == expected


def test_every_name_and_alias_finds_its_row() -> None:
    for spec in GPU_SPECS.values():
        for label in (spec.name, *spec.aliases):
            assert get_gpu(label) is spec
            assert get_gpu(label.lower().replace("-", "_")) is spec


def test_unknown_gpu_suggests_the_closest_and_lists_the_known() -> None:
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("A100-80G")
    message = str(info.value)
    assert "\n" not in message
    assert "'A100-80G'" in message
    assert "did you mean 'A100-80GB'" in message
    for name in gpu_names():
        assert name in message
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    ("query", "suggested"),
    [("A100", ["A100-40GB", "A100-80GB"]), ("h100", ["H100-80GB", "H100-PCIE"]),
     ("V100", ["V100-16GB", "V100-32GB"]), ("L40", ["L40S"]), ("H20O", ["H200"]),
     ("RTX 4080", ["RTX-4090"])],
)
def test_ambiguous_or_misspelt_names_are_not_guessed(query: str, suggested: list[str]) -> None:
    with pytest.raises(UnknownGPUError) as info:
        get_gpu(query)
    hint = str(info.value).split("; known GPUs")[0]
    for name in suggested:
        assert repr(name) in hint


def test_unknown_gpu_without_a_close_match() -> None:
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("Radeon MI300X")
    assert "did you mean" not in str(info.value)
    with pytest.raises(UnknownGPUError):
        get_gpu("")


# ---------------------------------------------------------------------------- detection


def test_detect_returns_none_without_nvml() -> None:
    """This machine has pynvml but no NVIDIA driver: nvmlInit raises NVMLError_LibraryNotFound."""
    pytest.importorskip("pynvml")
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        assert detect_local_gpu() is None
    else:  # pragma: no cover - only on a machine with a GPU
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here")


def test_detect_returns_none_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert detect_local_gpu() is None


class _NVMLError(Exception):
    pass


def _fake_pynvml(*, name: Any, total: int, capability: tuple[int, int] | None = None,
                 bus_width: int | None = None, mem_clock: int | None = None,
                 sm_clock: int | None = None, cores: int | None = None,
                 pcie: tuple[int, int] | None = None, count: int = 1,
                 init_error: bool = False) -> types.ModuleType:
    """A stand-in for ``pynvml`` with one kind of device; calls are recorded in ``calls``."""
    fake = types.ModuleType("pynvml")
    calls: list[tuple[Any, ...]] = []
    state = {"initialised": False}

    def unsupported() -> Any:
        raise _NVMLError("Not Supported")

    def init() -> None:
        if init_error:
            raise _NVMLError("NVML Shared Library Not Found")
        state["initialised"] = True
        calls.append(("init",))

    def shutdown() -> None:
        state["initialised"] = False
        calls.append(("shutdown",))

    def by_index(i: int) -> Any:
        calls.append(("index", i))
        if i >= count:
            raise _NVMLError("Invalid Argument")
        return ("handle", i)

    def by_uuid(uuid: str) -> Any:
        calls.append(("uuid", uuid))
        return ("handle", uuid)

    def max_clock(handle: Any, kind: int) -> int:
        value = mem_clock if kind == fake.NVML_CLOCK_MEM else sm_clock
        return value if value is not None else unsupported()

    fake.NVMLError = _NVMLError  # type: ignore[attr-defined]
    fake.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    fake.NVML_CLOCK_MEM = 2  # type: ignore[attr-defined]
    fake.calls = calls  # type: ignore[attr-defined]
    fake.nvmlInit = init  # type: ignore[attr-defined]
    fake.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = by_index  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByUUID = by_uuid  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: name  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=total, free=total, used=0)
    fake.nvmlDeviceGetCudaComputeCapability = (  # type: ignore[attr-defined]
        lambda h: capability if capability is not None else unsupported())
    fake.nvmlDeviceGetMemoryBusWidth = (  # type: ignore[attr-defined]
        lambda h: bus_width if bus_width is not None else unsupported())
    fake.nvmlDeviceGetMaxClockInfo = max_clock  # type: ignore[attr-defined]
    fake.nvmlDeviceGetNumGpuCores = (  # type: ignore[attr-defined]
        lambda h: cores if cores is not None else unsupported())
    fake.nvmlDeviceGetMaxPcieLinkGeneration = (  # type: ignore[attr-defined]
        lambda h: pcie[0] if pcie is not None else unsupported())
    fake.nvmlDeviceGetMaxPcieLinkWidth = (  # type: ignore[attr-defined]
        lambda h: pcie[1] if pcie is not None else unsupported())
    return fake


Installer = Callable[[types.ModuleType], types.ModuleType]


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Installer:
    """Puts a fake ``pynvml`` into ``sys.modules`` (with no CUDA_VISIBLE_DEVICES set)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def _install(fake: types.ModuleType) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return _install


def test_detect_maps_a_known_card_to_its_row(install: Installer) -> None:
    fake = install(_fake_pynvml(name="NVIDIA H100 80GB HBM3", total=85_520_809_984,
                                capability=(9, 0), bus_width=5120, mem_clock=2619))
    spec = detect_local_gpu()
    assert spec is get_gpu("H100-80GB")
    assert spec.from_table
    assert fake.calls[0] == ("init",) and fake.calls[-1] == ("shutdown",)
    assert ("index", 0) in fake.calls


def test_detect_accepts_bytes_names_and_keeps_the_reported_memory(install: Installer) -> None:
    eight_gb = 8192 * 2**20
    install(_fake_pynvml(name=b"NVIDIA GeForce RTX 3060", total=eight_gb, capability=(8, 6)))
    spec = detect_local_gpu()
    assert spec is not None
    assert spec.name == "RTX-3060" and spec.from_table
    assert spec.memory_bytes == eight_gb
    assert dict(spec.tflops) == dict(get_gpu("RTX-3060").tflops)


def test_detect_builds_a_spec_for_an_unknown_card(install: Installer) -> None:
    # An RTX 4060 Ti 16GB as NVML would report it: AD106, 4352 cores, 2535 MHz, 128-bit GDDR6
    # at 9001 MHz (288 GB/s), PCIe Gen4 x8.
    total = 16380 * 2**20
    install(_fake_pynvml(name="NVIDIA GeForce RTX 4060 Ti", total=total, capability=(8, 9),
                         bus_width=128, mem_clock=9001, sm_clock=2535, cores=4352,
                         pcie=(4, 8)))
    spec = detect_local_gpu()
    assert spec is not None
    assert not spec.from_table
    assert spec.name == "NVIDIA GeForce RTX 4060 Ti"
    assert spec.memory_bytes == total
    assert spec.compute_capability == (8, 9)
    assert spec.bf16 and spec.tflops["bf16"] > 0
    assert spec.tflops["fp32"] == pytest.approx(4352 * 2 * 2535e6 / 1e12)  # 22.1 TFLOP/s
    assert spec.tflops["fp16"] == pytest.approx(2 * spec.tflops["fp32"])
    assert spec.bandwidth_bytes_per_s == pytest.approx(288e9, rel=0.01)
    assert spec.interconnect_bytes_per_s == pytest.approx(8 * 1.969e9)
    assert spec.cublas_workspace_bytes == 8_519_680
    assert spec.context_bytes == get_gpu("L4").context_bytes


def test_detect_unknown_card_with_little_nvml_support(install: Installer) -> None:
    """Only name, memory and capability: rates fall back to the weakest similar table row."""
    install(_fake_pynvml(name="NVIDIA GH200 480GB", total=97_871 * 2**20, capability=(9, 0)))
    spec = detect_local_gpu()
    assert spec is not None and not spec.from_table
    hopper_rows = [s for s in GPU_SPECS.values() if s.compute_capability[0] == 9]
    for dtype in ("fp32", "tf32", "fp16", "bf16"):
        assert spec.tflops[dtype] == min(s.tflops[dtype] for s in hopper_rows)
    assert spec.bandwidth_bytes_per_s == min(s.bandwidth_bytes_per_s for s in GPU_SPECS.values())
    assert spec.cublas_workspace_bytes == 33_554_432
    assert spec.interconnect_bytes_per_s == 16e9


def test_detect_unknown_pre_ampere_card_has_no_bf16(install: Installer) -> None:
    install(_fake_pynvml(name="Tesla P100-PCIE-16GB", total=16280 * 2**20, capability=(6, 0)))
    spec = detect_local_gpu()
    assert spec is not None and not spec.from_table
    assert not spec.bf16
    assert spec.tflops["bf16"] == 0.0 and spec.tflops["tf32"] == 0.0
    assert spec.tflops["fp32"] > 0


def test_detect_unknown_newer_card_and_missing_capability(install: Installer) -> None:
    install(_fake_pynvml(name="NVIDIA B200", total=183_359 * 2**20, capability=(10, 0),
                         bus_width=8192, mem_clock=3996))
    spec = detect_local_gpu()
    assert spec is not None and spec.bf16 and spec.tflops["bf16"] > 0
    assert spec.cublas_workspace_bytes == 33_554_432
    install(_fake_pynvml(name="Mystery GPU", total=2**30))
    spec = detect_local_gpu()
    assert spec is not None
    assert spec.compute_capability == (0, 0) and not spec.bf16


def test_detect_honours_cuda_visible_devices(
    install: Installer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = install(_fake_pynvml(name="NVIDIA L4", total=23034 * 2**20, capability=(8, 9),
                                count=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert detect_local_gpu() is get_gpu("L4")
    assert ("index", 2) in fake.calls
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d1f0e7a-0000")
    assert detect_local_gpu() is get_gpu("L4")
    assert ("uuid", "GPU-8d1f0e7a-0000") in fake.calls
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert detect_local_gpu() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert detect_local_gpu(index=3) is get_gpu("L4")
    assert detect_local_gpu(index=7) is None  # NVML error on the handle -> None
    assert fake.calls[-1] == ("shutdown",)


def test_detect_returns_none_when_nvml_fails(install: Installer) -> None:
    install(_fake_pynvml(name="NVIDIA L4", total=1, init_error=True))
    assert detect_local_gpu() is None
    install(_fake_pynvml(name="NVIDIA L4", total=1, count=0))
    assert detect_local_gpu() is None
    install(_fake_pynvml(name="Odd vGPU", total=0, capability=(8, 0)))
    assert detect_local_gpu() is None


def test_docstring_examples_run() -> None:
    from estimators.hardware import _gpu_table
    for module in (_gpus, _gpu_table):
        failures, tried = doctest.testmod(module, raise_on_error=False)
        assert tried > 0
        assert failures == 0
