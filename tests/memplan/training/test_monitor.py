"""The training monitor: per-layer gradient norms, and NVML readings of the device really used
(mocked: no GPU here), a no-op without one."""

from __future__ import annotations

import json
import math
import sys
import types
import uuid as uuidlib

import pytest
import torch
import torch.nn as nn

from memplan.training._monitor import GpuMonitor, TrainingMonitor, layer_grad_norms, nvml_index


class FakeNvml(types.ModuleType):
    """pynvml with two devices; records which handle was asked for."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        super().__init__("pynvml")
        self.asked: list[tuple[str, object]] = []
        self.devices = {"GPU-aaaa": 0, "GPU-bbbb": 1, 0: 0, 1: 1, 3: 3}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(("uuid", uuid))
        return self.devices[uuid]

    def nvmlDeviceGetHandleByIndex(self, index):
        self.asked.append(("index", index))
        return self.devices[index]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=40 + handle)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(1 + handle) * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000 + handle  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 60 + handle


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _props(monkeypatch, uuids):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


def test_cpu_is_a_no_op_and_never_imports_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would raise
    assert GpuMonitor("cpu").sample() == {}
    mon = TrainingMonitor("cpu", every=1)
    assert mon.fields() == {}


def test_the_device_really_used_is_found_by_its_uuid(nvml, monkeypatch):
    # CUDA device 1 of this process is NVML's "bbbb", whatever CUDA_VISIBLE_DEVICES says.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb,GPU-aaaa")
    _props(monkeypatch, {0: "bbbb", 1: "aaaa"})
    sample = GpuMonitor("cuda:0").sample()
    assert nvml.asked == [("uuid", "GPU-bbbb")]
    assert sample == {"gpu_util_percent": 41, "gpu_memory_used_bytes": 2 * 2**30,
                      "gpu_power_watts": 250.001, "gpu_temperature_c": 61}


def test_without_a_uuid_cuda_visible_devices_maps_the_index(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    _props(monkeypatch, {0: None, 1: None})
    GpuMonitor("cuda:1").sample()
    GpuMonitor("cuda:0").sample()
    assert nvml.asked == [("index", 1), ("index", 3)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_index(1) == 1


def test_an_nvml_error_turns_monitoring_off_for_good(nvml, monkeypatch):
    _props(monkeypatch, {0: "aaaa"})
    mon = GpuMonitor("cuda:0")
    assert mon.sample()
    monkeypatch.setattr(nvml, "nvmlDeviceGetPowerUsage", lambda h: (_ for _ in ()).throw(RuntimeError("gone")))
    assert mon.sample() == {} and mon.sample() == {}


def test_layer_grad_norms_combine_weight_and_bias_and_undo_clipping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    norms = layer_grad_norms(model)
    w, b = model[0].weight.grad.norm(), model[0].bias.grad.norm()
    assert norms["0"] == pytest.approx(math.hypot(float(w), float(b)))
    total = math.sqrt(sum(v * v for v in norms.values()))
    clipped = nn.utils.clip_grad_norm_(model.parameters(), total / 4)
    mon = TrainingMonitor("cpu", every=10)
    mon.capture(model, 3, grad_norm=float(clipped), clip=total / 4)
    assert "layer_grad_norms" not in mon.fields()  # step 3 is not due
    mon.capture(model, 10, grad_norm=float(clipped), clip=total / 4)
    after = mon.fields()["layer_grad_norms"]
    assert after["0"] == pytest.approx(norms["0"], rel=1e-5)  # as before clipping


def test_trainer_logs_layer_norms_at_step_1_and_every_nth(write_model, tmp_path, monkeypatch):
    monkeypatch.setattr("memplan.training._monitor.GRAD_NORMS_EVERY", 4)
    from estimators import TrainConfig, load_task
    from memplan.training import TrainOptions, train
    path = write_model("""
import torch, torch.nn as nn
from torch.utils.data import TensorDataset
def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
""")
    train(load_task(path), TrainConfig(micro_batch_size=8), TrainOptions(max_steps=9, out_dir=tmp_path, progress=False))
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    logged = [r["step"] for r in steps if "layer_grad_norms" in r]
    assert logged == [1, 4, 8]
    first = steps[0]
    assert set(first["layer_grad_norms"]) == {"0", "2"}
    assert math.sqrt(sum(v * v for v in first["layer_grad_norms"].values())) == pytest.approx(first["grad_norm"], rel=1e-5)
    assert not any(k.startswith("gpu_") for r in steps for k in r)  # a CPU run has no NVML fields


def test_uuid_objects_are_formatted_like_nvml(nvml, monkeypatch):
    u = uuidlib.UUID("12345678-1234-5678-1234-567812345678")
    nvml.devices[f"GPU-{u}"] = 1
    _props(monkeypatch, {0: u})
    assert GpuMonitor("cuda:0").sample()["gpu_temperature_c"] == 61
