"""torch.compile measured by probes (memplan.planning._compile): compiled faster and within
the budget -> the plan says so and fit trains compiled; slower, over the budget or failing ->
eager, with the figures (or the failure) in the notes; no device to probe -> not evaluated."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch.nn as nn

from estimators import Estimator, Task, TrainConfig
from estimators.probing._probe import ProbeResult
from memplan import Plan, search
from memplan.planning._compile import COMPILED_NOTE, evaluate_compile
from memplan.planning._plan import PlanEntry

from test_estimator import TinyLM, lm_task  # noqa: E402

_LM = Task(name="lm-compile", build_model=lambda: TinyLM(layers=2), sample_fn=lm_task().sample_fn)
_SEARCH = dict(vram="1GB", device="cpu", global_batch=8, trials=12, probe_top=1, precisions=["fp32"])


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))


@pytest.fixture(autouse=True)
def _pinned_rates(monkeypatch):
    # The CPU's rates pinned (as in test_search): measuring them again in every test's fresh
    # cache costs seconds, and the decisions here hang on the fake probes' figures only.
    from estimators import _estimate
    from test_search import _PINNED_RATES
    monkeypatch.setattr(_estimate, "cpu_rates", lambda *args, **kwargs: _PINNED_RATES)


def _answers(calls: list, *, speedup: float = 1.0, memory: float = 1.0, raise_compiled: bool = False):
    """A probe answering each configuration's estimate as measured; the compiled step (a task
    with ``step.compile``) ``speedup`` times faster and ``memory`` times the peak, or raising."""
    cache: dict = {}

    def fake(task: Task, config: TrainConfig, budget: int) -> ProbeResult:
        compiled = task.step.compile
        calls.append((config, compiled))
        if compiled and raise_compiled:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")
        if config not in cache:
            cache[config] = replace(Estimator(task, device="cpu").estimate(config), method="measured")
        est = cache[config]
        step = est.step_time_s / (speedup if compiled else 1.0)
        est = replace(est, step_time_s=step, samples_per_s=config.global_batch / step,
                      peak_allocated_bytes=int(est.peak_allocated_bytes * (memory if compiled else 1.0)))
        return ProbeResult(status="ok", estimate=est, first_step_extra_s=3.5 if compiled else 0.1)
    return fake


def test_compiled_faster_and_within_the_budget_is_chosen_and_saved(tmp_path):
    calls: list = []
    fake = _answers(calls, speedup=1.5)
    plan = search(_LM, **_SEARCH, probe_fn=fake, compile_fn=fake)
    assert plan.compile is True
    assert [c for c, compiled in calls if compiled] == [plan.config]  # compile_top 1: one compiled probe
    assert any(n.startswith(COMPILED_NOTE) for n in plan.best.measured.notes)
    note = next(n for n in plan.notes if n.startswith("torch.compile of"))
    assert "x1.50" in note and "compile ~3.5 s" in note
    assert "torch.compile: on" in plan.table()
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.compile is True and loaded.to_dict() == plan.to_dict()


@pytest.mark.parametrize("speedup, memory, why", [(0.8, 1.0, "slower"), (1.5, 1e4, "over the budget")])
def test_compiled_slower_or_over_the_budget_stays_eager(speedup, memory, why):
    calls: list = []
    fake = _answers(calls, speedup=speedup, memory=memory)
    plan = search(_LM, **_SEARCH, probe_fn=fake, compile_fn=fake)
    assert plan.compile is False, why
    assert sum(compiled for _, compiled in calls) == 1
    assert not any(n.startswith(COMPILED_NOTE) for n in plan.best.measured.notes)
    assert any("trained eager" in n for n in plan.notes)
    assert "torch.compile: off" in plan.table()
    if why == "over the budget":
        assert any("over the budget" in n for n in plan.notes if n.startswith("torch.compile of"))


def test_a_compile_that_raises_is_a_note_and_not_evaluated():
    calls: list = []
    fake = _answers(calls, raise_compiled=True)
    plan = search(_LM, **_SEARCH, probe_fn=fake, compile_fn=fake)
    assert plan.compile is None
    failed = next(n for n in plan.notes if n.startswith("torch.compile of"))
    assert "failed when probed (RuntimeError: InvalidCxxCompiler: No working C++ compiler found)" in failed
    assert any("no compiled probe finished" in n for n in plan.notes)


def test_not_evaluated_without_a_device_or_when_opted_out():
    absent = search(_LM, vram="80GB", gpu="A100-80GB", global_batch=8, trials=12, precisions=["fp32"])
    assert absent.compile is None and "torch.compile not evaluated (no device to probe)" in absent.notes
    calls: list = []
    fake = _answers(calls, speedup=2.0)
    off = search(_LM, **{**_SEARCH, "probe_top": 1}, compile_top=0, probe_fn=fake, compile_fn=fake)
    assert off.compile is None and not any(compiled for _, compiled in calls)
    assert any(n.startswith("torch.compile not evaluated (no compiled probes") for n in off.notes)


def test_the_second_candidate_compiled_can_win_and_an_unmeasured_one_is_probed_eager_first():
    # Two candidates, neither measured: each is probed eager, then compiled; the second's
    # compiled step is the fastest, so it goes first with its compiled figures.
    task = _LM
    estimator = Estimator(task, device="cpu")
    configs = [TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=4, grad_accum_steps=2)]
    entries = [PlanEntry(config=c, predicted=estimator.estimate(c)) for c in configs]
    calls: list = []

    def fake(t: Task, config: TrainConfig, budget: int) -> ProbeResult:
        calls.append((config, t.step.compile))
        est = replace(estimator.estimate(config), method="measured", step_time_s=1.0, samples_per_s=8.0)
        if t.step.compile:
            step = 0.9 if config == configs[0] else 0.5
            est = replace(est, step_time_s=step, samples_per_s=8 / step)
        return ProbeResult(status="ok", estimate=est)
    notes: list[str] = []
    ranked, compiled = evaluate_compile(task, estimator, entries, 2, 10**9, fake, fake, None, notes)
    assert compiled is True and ranked[0].config == configs[1] and ranked[1].config == configs[0]
    assert calls == [(configs[0], False), (configs[0], True), (configs[1], False), (configs[1], True)]
    assert ranked[0].measured.samples_per_s == pytest.approx(16.0)
    with pytest.raises(Exception, match="compile_top must be a whole number >= 0"):
        evaluate_compile(task, estimator, entries, -1, 10**9, fake, fake, None, [])


def test_plans_without_the_field_still_load(tmp_path):
    plan = search(_LM, vram="1GB", device="cpu", global_batch=8, trials=12, probe_top=0)
    data = plan.to_dict()
    del data["compile"]  # a plan file written before torch.compile was evaluated
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Plan.load(path).compile is None
    data["compile"] = "yes"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="compile must be true, false or null"):
        Plan.load(path)


def test_train_plan_compiles_when_the_plan_says_so_unless_the_user_said(tmp_path, monkeypatch):
    from memplan import _fit
    from memplan.training import TrainOptions
    seen: list[bool] = []
    monkeypatch.setattr(_fit, "train", lambda task, config, options, **kw: seen.append(options.compile))
    monkeypatch.setattr(_fit, "_with_report", lambda result, options: result)
    plan = search(_LM, vram="1GB", device="cpu", global_batch=8, trials=12, probe_top=0)
    options = TrainOptions(out_dir=tmp_path / "run", progress=False)
    for flag, said in ((True, None), (True, False), (False, None), (None, None)):
        _fit.train_plan(_LM, replace(plan, compile=flag), options, compile=said)
    assert seen == [True, False, False, False]
    assert _fit.compile_said(None, {"compile": False}, {"compile": True}) is False
    assert _fit.compile_said(None, {}, {}) is None and _fit.compile_said(True, {}, {}) is True


# A small model whose forward Inductor compiles in seconds on a CPU.
_TINY = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g))
"""

# The same, with Inductor pointed at a C++ compiler that does not exist: what a machine
# without one meets (set in the model file, so that the probe's child sees it).
_NO_CXX = _TINY + """
import torch._inductor.config as inductor_config
inductor_config.cpp.cxx = (None, "/nonexistent/memplan-test-g++")
"""


def _real(tmp_path: Path, source: str, name: str) -> tuple[list[PlanEntry], bool | None, list[str]]:
    from estimators import load_task
    path = tmp_path / name
    path.write_text(source)
    task = load_task(path)
    estimator = Estimator(task, device="cpu")
    config = TrainConfig(micro_batch_size=16)
    entries = [PlanEntry(config=config, predicted=estimator.estimate(config))]
    notes: list[str] = []
    ranked, compiled = evaluate_compile(task, estimator, entries, 1, 2**31, None, None, None, notes)
    return ranked, compiled, notes


def test_a_real_compiled_probe_on_this_cpu(tmp_path, monkeypatch):
    # Inductor's caches in the test's folder: a cached kernel would hide the compiler's absence.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ranked, compiled, notes = _real(tmp_path, _TINY, "tiny.py")
    # Compiled was measured (faster or not: a timing is not a test), its figures noted.
    assert compiled in (True, False), notes
    note = next(n for n in notes if n.startswith("torch.compile of"))
    assert "samples/s (eager" in note and "compile ~" in note
    assert (compiled is True) == any(n.startswith(COMPILED_NOTE) for n in ranked[0].measured.notes)
    ranked, compiled, notes = _real(tmp_path, _NO_CXX, "nocxx.py")
    assert compiled is None and ranked[0].measured is not None  # the eager figures stand
    failed = next(n for n in notes if n.startswith("torch.compile of"))
    assert "failed when probed" in failed, notes
