"""torch.compile measured by probes (memplan.planning._compile): compiled faster and within
the budget -> the plan says so and fit trains compiled; slower, over the budget or failing ->
eager, with the figures (or the failure) in the notes; no device to probe -> not evaluated."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.models import TinyLM, lm_task

from estimators import Estimator, Task, TrainConfig
from memplan import Plan, search
from memplan.planning._compile import COMPILED_NOTE, CompiledFigures, evaluate_compile
from memplan.planning._plan import PlanEntry

_LM = Task(name="lm-compile", build_model=lambda: TinyLM(layers=2), sample_fn=lm_task().sample_fn)


def _eager_probe(task: Task, config: TrainConfig, budget: int):
    """The search's own probes, replaced: each configuration's estimate, as measured."""
    from estimators.probing._probe import ProbeResult
    return ProbeResult(status="ok", estimate=replace(Estimator(task, device="cpu").estimate(config), method="measured"))


_SEARCH = dict(vram="1GB", device="cpu", global_batch=8, trials=12, probe_top=1, precisions=["fp32"],
               probe_fn=_eager_probe)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))


@pytest.fixture(autouse=True)
def _pinned_rates(monkeypatch):
    # The CPU's rates pinned (as in the search's tests: helpers.search): measuring them again in every test's fresh
    # cache costs seconds, and the decisions here hang on the fake probes' figures only.
    from helpers.search import PINNED_RATES as _PINNED_RATES

    from estimators.estimator import _estimate
    monkeypatch.setattr(_estimate, "cpu_rates", lambda *args, **kwargs: _PINNED_RATES)


def _answers(calls: list, *, speedup: float = 1.0, memory: float = 1.0, raise_compiled: bool = False):
    """The compiled figures of each configuration: its estimate's peak times ``memory``, its
    step ``speedup`` times faster than eager (or raising, as a compile without a compiler)."""
    def fake(task: Task, config: TrainConfig, budget: int) -> CompiledFigures:
        calls.append(config)
        if raise_compiled:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")
        est = replace(Estimator(task, device="cpu").estimate(config), method="measured")
        est = replace(est, peak_allocated_bytes=int(est.peak_allocated_bytes * memory))
        return CompiledFigures(status="ok", estimate=est, compile_s=3.5, speedup=speedup, rounds=8)
    return fake


def test_compiled_faster_and_within_the_budget_is_chosen_and_saved(tmp_path):
    calls: list = []
    eager = search(_LM, **_SEARCH, compile_top=0)
    plan = search(_LM, **_SEARCH, compile_fn=_answers(calls, speedup=1.5))
    assert plan.compile is True
    assert calls == [plan.config]  # compile_top 1: one compiled measurement
    assert any(n.startswith(COMPILED_NOTE) for n in plan.best.measured.notes)
    assert plan.best.samples_per_s == pytest.approx(1.5 * eager.best.samples_per_s, rel=0.05)
    note = next(n for n in plan.notes if n.startswith("torch.compile of"))
    assert "eager/compiled step time 1.50" in note and "compile ~3.5 s" in note
    assert "torch.compile: on" in plan.table()
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.compile is True and loaded.to_dict() == plan.to_dict()


@pytest.mark.parametrize("speedup, memory, why", [(0.8, 1.0, "slower"), (1.03, 1.0, "within the noise"),
                                                  (1.5, 1e4, "over the budget")])
def test_compiled_slower_or_over_the_budget_stays_eager(speedup, memory, why):
    calls: list = []
    plan = search(_LM, **_SEARCH, compile_fn=_answers(calls, speedup=speedup, memory=memory))
    assert plan.compile is False, why
    assert len(calls) == 1
    assert not any(n.startswith(COMPILED_NOTE) for n in (plan.best.measured or plan.best.predicted).notes)
    assert any("trained eager" in n for n in plan.notes)
    assert "torch.compile: off" in plan.table()
    if why == "over the budget":
        assert any("does not fit the budget" in n for n in plan.notes if n.startswith("torch.compile of"))


def test_a_compile_that_raises_is_a_note_and_not_evaluated():
    plan = search(_LM, **_SEARCH, compile_fn=_answers([], raise_compiled=True))
    assert plan.compile is None
    failed = next(n for n in plan.notes if n.startswith("torch.compile of"))
    assert "failed when measured (error: RuntimeError: InvalidCxxCompiler: No working C++ compiler found)" in failed
    assert any("no compiled measurement finished" in n for n in plan.notes)


def test_not_evaluated_without_a_device_or_when_opted_out():
    absent = search(_LM, vram="80GB", gpu="A100-80GB", global_batch=8, trials=12, precisions=["fp32"])
    assert absent.compile is None and "torch.compile not evaluated (no device to probe)" in absent.notes
    calls: list = []
    off = search(_LM, **_SEARCH, compile_top=0, compile_fn=_answers(calls, speedup=2.0))
    assert off.compile is None and calls == []
    assert any(n.startswith("torch.compile not evaluated (no compiled probes") for n in off.notes)
    # Probes replaced without the compiled measurement: none runs, and the plan says so.
    from helpers.search import measured_probe as _measured_probe
    replaced = search(_LM, **{**_SEARCH, "probe_fn": _measured_probe([], {})})
    assert replaced.compile is None and any("the probes are replaced" in n for n in replaced.notes)


def test_the_second_candidate_compiled_can_win_on_its_figure_times_the_speedup():
    task = _LM
    estimator = Estimator(task, device="cpu")
    configs = [TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=4, grad_accum_steps=2)]
    speeds = {configs[0]: 10.0, configs[1]: 9.0}
    entries = [PlanEntry(config=c, predicted=replace(estimator.estimate(c), samples_per_s=speeds[c],
                                                     step_time_s=8 / speeds[c])) for c in configs]

    def fake(t: Task, config: TrainConfig, budget: int) -> CompiledFigures:
        est = replace(estimator.estimate(config), method="measured")
        return CompiledFigures(status="ok", estimate=est, speedup=1.1 if config == configs[0] else 1.4, rounds=8)
    notes: list[str] = []
    ranked, compiled = evaluate_compile(task, estimator, entries, 2, 10**9, None, fake, None, notes)
    # 9 x 1.4 = 12.6 beats 10 x 1.1 = 11: the second goes first, compiled.
    assert compiled is True and [e.config for e in ranked] == [configs[1], configs[0]]
    assert ranked[0].samples_per_s == pytest.approx(12.6) and ranked[1].measured is None
    with pytest.raises(Exception, match="compile_top must be a whole number >= 0"):
        evaluate_compile(task, estimator, entries, -1, 10**9, None, fake, None, [])


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
    assert "eager/compiled step time" in note and "rounds raced in one process" in note and "compile ~" in note
    marked = ranked[0].measured is not None and any(n.startswith(COMPILED_NOTE) for n in ranked[0].measured.notes)
    assert (compiled is True) == marked
    ranked, compiled, notes = _real(tmp_path, _NO_CXX, "nocxx.py")
    assert compiled is None and ranked[0].measured is None  # the eager figures stand
    failed = next(n for n in notes if n.startswith("torch.compile of"))
    assert "failed when measured" in failed and "InvalidCxxCompiler" in failed, notes


def test_a_race_takes_one_configuration_eager_against_itself_compiled():
    from estimators import ConfigError
    from estimators.probing._race import check_race_args
    config = TrainConfig(micro_batch_size=4)
    assert check_race_args((config, config), 8, 2, 60.0, compiled=(False, True)) == (config, config)
    with pytest.raises(ConfigError, match="two different configurations"):
        check_race_args((config, config), 8, 2, 60.0, compiled=(True, True))
    with pytest.raises(ConfigError, match="compiled must be two booleans"):
        check_race_args((config, config), 8, 2, 60.0, compiled=(1, 0))


@pytest.mark.parametrize("flags, top, said", [((), 1, None), (("--no-compile",), 0, False),
                                              (("--compile",), 1, True), (("--compile-top", "2"), 2, None)])
def test_fit_on_the_command_line_passes_what_was_said_of_compiling(tmp_path, monkeypatch, flags, top, said):
    from memplan import _fit, cli
    path = tmp_path / "tiny.py"
    path.write_text(_TINY)
    plan = search(_LM, vram="1GB", device="cpu", global_batch=8, trials=12, probe_top=0)
    seen: dict = {}
    # memplan fit is memplan.fit: the search it runs is the one _fit imported.
    monkeypatch.setattr(_fit, "search", lambda task, **kw: seen.update(top=kw["compile_top"]) or plan)
    monkeypatch.setattr(_fit, "train_plan", lambda *a, **kw: seen.update(said=kw["compile"]))
    assert cli.main(["fit", str(path), "--out", str(tmp_path / "run"), "--no-progress", *flags]) == 0
    assert seen == {"top": top, "said": said}
