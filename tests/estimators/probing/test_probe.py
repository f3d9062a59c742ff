"""Tests of probes (estimators.probing._probe): real steps in a child process, measured figures equal
to the in-process reference, and every failure — OOM, error, hang, crash — reported as a
status, with no child process left behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

# Shared with tests/estimators/probing/test_race.py: a 60 s bound per test, one probe server for the module.
from helpers.probe import assert_no_probe_children, gone, probe_server, time_bound, write_model  # noqa: F401

from estimators import ProbeError, Task, TrainConfig, load_task
from estimators._errors import ConfigError, ModelFileError
from estimators.probing._measure import measure_cpu_peak
from estimators.probing._probe import Prober, ProbeResult, is_oom_error, probe

TINY = """
import os, time, signal
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"lr": 1e-3}

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g))
"""

BLOCKS = """
import torch, torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), *[Block() for _ in range(4)], nn.Linear(64, 5))

def train_data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 5, (128,), generator=g))
"""


QUICK = {"steps": 1, "warmup": 0}


# --------------------------------------------------------------------------- ok


def test_probe_of_a_model_file_measures_memory_and_time(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY)
    config = TrainConfig(micro_batch_size=16)
    result = probe(str(path), config, **QUICK)
    assert result.status == "ok", result.message
    est = result.estimate
    assert est is not None and est.method == "measured" and not est.modelled
    params = 32 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert est.params == est.trainable_params == params
    assert est.breakdown["params"] == 4 * params
    # params + grads + two AdamW moments at least
    assert est.peak_allocated_bytes >= 4 * 4 * params
    assert est.peak_reserved_bytes is None and est.device == "cpu" and est.gpu is None
    assert est.step_time_s is not None and est.step_time_s > 0
    assert est.samples_per_s == pytest.approx(16 / est.step_time_s)
    assert est.peak_phase.startswith("step ")
    assert 0 < result.overhead_s < result.wall_s
    # The reference: the CPU allocator measured in this process.
    reference = measure_cpu_peak(load_task(path), config).peak_bytes
    assert est.peak_allocated_bytes == pytest.approx(reference, rel=0.02)
    assert_no_probe_children()


def test_probe_applies_accumulation_checkpointing_and_precision(tmp_path: Path) -> None:
    path = write_model(tmp_path, BLOCKS)
    task = load_task(path)
    prober = Prober(task)  # a Task loaded from a file is probed through its file
    peaks = {}
    for segments in (0, 4):
        config = TrainConfig(micro_batch_size=16, grad_accum_steps=2, precision="bf16-mixed",
                             checkpoint_segments=segments)
        result = prober.probe(config, **QUICK)
        assert result.status == "ok", result.message
        assert result.estimate is not None and result.estimate.config == config
        assert result.estimate.samples_per_s == pytest.approx(32 / result.estimate.step_time_s)
        reference = measure_cpu_peak(task, config).peak_bytes
        assert result.estimate.peak_allocated_bytes == pytest.approx(reference, rel=0.02)
        peaks[segments] = result.estimate.peak_allocated_bytes
    assert peaks[4] < peaks[0]  # checkpointing every block saves activations
    assert_no_probe_children()


def test_warm_probes_have_small_overhead(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY)
    prober = Prober(path)
    results = [prober.probe(TrainConfig(micro_batch_size=b), steps=1, warmup=0) for b in (8, 16)]
    assert all(r.ok for r in results)
    # The server has imported torch: what is left is a fork, the task and the model build.
    assert min(r.overhead_s for r in results) < 3.0


def test_in_memory_task_is_sent_with_cloudpickle() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    sample = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    task = Task.from_module(module, sample, loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    result = probe(task, TrainConfig(micro_batch_size=8), **QUICK)
    assert result.status == "ok", result.message
    assert result.estimate is not None and result.estimate.params == 8 * 16 + 16 + 16 * 3 + 3


def test_unpicklable_in_memory_task_is_a_clear_error() -> None:
    lock = threading.Lock()

    def loss(model: nn.Module, batch: object) -> torch.Tensor:
        with lock:
            return model(batch).sum()

    task = Task.from_module(nn.Linear(2, 2), torch.randn(2, 2), loss=loss)
    with pytest.raises(ProbeError, match="cannot be sent to a probe process.*model file"):
        probe(task, TrainConfig(micro_batch_size=2))


def test_result_round_trips_through_a_dict(tmp_path: Path) -> None:
    result = probe(write_model(tmp_path, TINY), TrainConfig(micro_batch_size=4), steps=1, warmup=0)
    assert ProbeResult.from_dict(result.to_dict()) == result


# --------------------------------------------------------------------------- failures


def test_oom_under_a_tiny_budget(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY)
    result = probe(path, TrainConfig(micro_batch_size=16), budget_bytes=100_000, **QUICK)
    assert result.status == "oom"
    assert result.estimate is None
    assert "out of memory" in result.message and "budget" in result.message
    assert_no_probe_children()


def test_budget_that_fits_is_ok(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY)
    result = probe(path, TrainConfig(micro_batch_size=16), budget_bytes=50_000_000, **QUICK)
    assert result.status == "ok", result.message
    assert any("budget" in n for n in result.estimate.notes)


def test_loss_that_raises_is_an_error_with_the_message(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY, """
    def loss(model, batch):
        raise ValueError("the loss is broken")
    """)
    result = probe(path, TrainConfig(micro_batch_size=4), **QUICK)
    assert result.status == "error"
    assert "ValueError: the loss is broken" in result.message
    line = path.read_text().splitlines().index('    raise ValueError("the loss is broken")') + 1
    assert f"(line {line})" in result.message  # where, in the model file
    assert "\n" not in result.message
    assert_no_probe_children()


def test_model_file_error_is_reported(tmp_path: Path) -> None:
    path = write_model(tmp_path, "import torch\n\ndef train_data():\n    return []\n")
    result = probe(path, TrainConfig(micro_batch_size=4), **QUICK)
    assert result.status == "error" and "defines no model()" in result.message


def test_oom_raised_by_the_model_is_an_oom(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY, """
    def loss(model, batch):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 10000000000000 bytes")
    """)
    result = probe(path, TrainConfig(micro_batch_size=4), **QUICK)
    assert result.status == "oom" and "can't allocate memory" in result.message


def test_hang_times_out_and_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "grandchild.pid"
    path = write_model(tmp_path, TINY, f"""
    def loss(model, batch):
        if os.environ.get("MEMPLAN_TEST_HANG") == "1":
            import subprocess
            child = subprocess.Popen(["sleep", "1000"])  # a process the probe starts itself
            open({str(marker)!r}, "w").write(str(child.pid))
            time.sleep(1000)
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    """)
    # The server started before this variable was set: the child must see it all the same.
    monkeypatch.setenv("MEMPLAN_TEST_HANG", "1")
    start = time.monotonic()
    result = probe(path, TrainConfig(micro_batch_size=4), timeout_s=4, **QUICK)
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert "4 s" in result.message
    assert 4 <= elapsed < 10
    assert gone(int(marker.read_text()))  # killed with the probe's process group
    assert_no_probe_children()
    monkeypatch.setenv("MEMPLAN_TEST_HANG", "0")
    assert probe(path, TrainConfig(micro_batch_size=4), **QUICK).ok


def test_segfault_is_an_error(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY, """
    def loss(model, batch):
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    result = probe(path, TrainConfig(micro_batch_size=4), **QUICK)
    assert result.status == "error"
    assert "SIGSEGV" in result.message
    # faulthandler's report, down to the line of the model file that crashed
    line = path.read_text().splitlines().index("    os.kill(os.getpid(), signal.SIGSEGV)") + 1
    assert "Fatal Python error: Segmentation fault" in result.message
    assert f'File "{path.resolve()}", line {line} in loss' in result.message
    assert_no_probe_children()


def test_sigkill_from_outside_is_taken_for_the_oom_killer(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY, """
    def loss(model, batch):
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = probe(path, TrainConfig(micro_batch_size=4), **QUICK)
    assert result.status == "oom" and "OOM killer" in result.message
    assert_no_probe_children()


def test_probes_recover_after_failures(tmp_path: Path) -> None:
    # After the crashes above (whatever order tests run in), probes still work.
    result = probe(write_model(tmp_path, TINY), TrainConfig(micro_batch_size=4), steps=1, warmup=0)
    assert result.ok


def test_bad_arguments_raise_before_any_process_starts(tmp_path: Path) -> None:
    path = write_model(tmp_path, TINY)
    with pytest.raises(ConfigError, match="not found"):
        probe(tmp_path / "missing.py", TrainConfig(micro_batch_size=4))
    with pytest.raises(ConfigError, match="strategy"):
        probe(path, TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2))
    with pytest.raises(ConfigError, match="steps"):
        probe(path, TrainConfig(micro_batch_size=4), steps=0)
    with pytest.raises(ConfigError, match="no GPU"):
        probe(path, TrainConfig(micro_batch_size=4), device="cuda")


@pytest.mark.slow
def test_fresh_interpreter_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_PROBE_START", "spawn")
    path = write_model(tmp_path, TINY)
    config = TrainConfig(micro_batch_size=8)
    result = probe(path, config, steps=1, warmup=0, timeout_s=50)
    assert result.status == "ok", result.message
    reference = measure_cpu_peak(load_task(path), config).peak_bytes
    assert result.estimate.peak_allocated_bytes == pytest.approx(reference, rel=0.02)
    assert_no_probe_children()


# --------------------------------------------------------------------------- is_oom_error


@pytest.mark.parametrize("exc, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (MemoryError(), True),
    (ModelFileError("model.py: model() raised OutOfMemoryError: CUDA out of memory; fix model()"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom_error(exc: BaseException, expected: bool) -> None:
    assert is_oom_error(exc) is expected


def test_is_oom_error_follows_the_chain() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("boom")
        except torch.OutOfMemoryError:
            raise ModelFileError("model() failed") from None
    except ModelFileError as exc:
        assert is_oom_error(exc)
