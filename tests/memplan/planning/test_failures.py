"""A search survives configurations that cannot run, and stops at once on a broken model."""

from __future__ import annotations

import optuna
import pytest
import torch
import torch.nn as nn

from estimators import Estimator, ModelFileError, Task, TrainConfig
from estimators.timing._timing import DeviceRates
from memplan import Plan, search
from memplan.planning._failures import contrast
from memplan.planning._space import build_space

_PINNED_RATES = DeviceRates("pinned-cpu", {"float32": 8e10, "bfloat16": 1e10, "float16": 3e9}, 2e10, 1.5e-5, {})


@pytest.fixture(autouse=True)
def _pinned_rates(monkeypatch):
    from estimators.estimator import _estimate
    monkeypatch.setattr(_estimate, "cpu_rates", lambda *args, **kwargs: _PINNED_RATES)


class NoBF16(nn.Module):
    """A model with a layer that has no low-precision kernel: it refuses autocast's bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.dtype != torch.float32:
            raise RuntimeError(f"custom_kernel has no {h.dtype} implementation")
        return self.fc2(torch.relu(h))


def _sample(b: int):
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 16, generator=g), torch.randint(0, 4, (b,), generator=g)


def _counting(task: Task, monkeypatch) -> list[TrainConfig]:
    from estimators.estimator import _estimate
    asked: list[TrainConfig] = []
    original = _estimate.Estimator.estimate

    def counted(self, config, **kw):
        asked.append(config)
        return original(self, config, **kw)
    monkeypatch.setattr(_estimate.Estimator, "estimate", counted)
    return asked


def test_a_precision_that_cannot_run_is_an_infeasible_trial_and_the_search_goes_on(tmp_path):
    task = Task(name="nobf16", build_model=NoBF16, sample_fn=_sample)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    plan = search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=0, storage=storage)
    assert {e.config.precision for e in plan.entries} == {"fp32"}
    assert plan.failures and all(c.precision == "bf16-mixed" for c in plan.failures)
    assert all("no torch.bfloat16 implementation" in r for r in plan.failures.values())
    n = len(plan.failures)
    line = next(n_ for n_ in plan.notes if "could not run" in n_)
    assert line.startswith(f"{n} configurations could not run: ") and "bf16-mixed" in line
    assert f"note: {line}" in plan.table()
    assert plan.trials == len(plan.entries) + n  # every configuration was tried
    # Failed configurations are completed, infeasible trials (the sampler learns from them).
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    failed = [t for t in study.trials if "failed" in t.user_attrs]
    assert len(failed) == n and all(t.state == optuna.trial.TrialState.COMPLETE for t in failed)
    assert all(t.constraints["memory"] > 0 for t in failed)
    # The plan keeps them through JSON.
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.failures == plan.failures


def test_a_resumed_study_does_not_trace_its_failures_again(tmp_path, monkeypatch):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=0, storage=storage)
    first = search(Task(name="nobf16", build_model=NoBF16, sample_fn=_sample), **kwargs)
    asked = _counting(first, monkeypatch)
    again = search(Task(name="nobf16", build_model=NoBF16, sample_fn=_sample), **kwargs)
    assert asked == []
    assert again.failures == first.failures


def test_a_micro_batch_the_model_refuses_is_skipped(tmp_path):
    # BatchNorm1d refuses a training batch of one; every larger micro-batch trains.
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    task = Task(name="bn1d", build_model=build, sample_fn=_sample)
    plan = search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=0,
                  precisions=["fp32"], storage=f"sqlite:///{tmp_path / 's.db'}")
    assert plan.failures and {c.micro_batch_size for c in plan.failures} == {1}
    assert {e.config.micro_batch_size for e in plan.entries} == {2, 4, 8}
    assert all("Expected more than 1 value per channel" in r for r in plan.failures.values())


def test_a_model_that_fails_everywhere_stops_the_search_at_once(tmp_path, monkeypatch):
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(15, 4))  # the data has 16 features
    task = Task(name="broken", build_model=build, sample_fn=_sample)
    asked = _counting(task, monkeypatch)
    with pytest.raises(ModelFileError) as info:
        search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=0,
               storage=f"sqlite:///{tmp_path / 's.db'}")
    message = str(info.value)
    assert "\n" not in message and "broken: a training step with batch size" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    # The first configuration, its contrast and at most the plainest one; not the whole space.
    assert 2 <= len(asked) <= 3 and len(set(asked)) == len(asked)
    first, second = asked[:2]
    assert (first.micro_batch_size, first.precision) != (second.micro_batch_size, second.precision)


def test_the_contrast_differs_along_every_axis_with_a_choice():
    space = build_space(dataset_size=100, global_batch=8, precisions=("fp32", "bf16-mixed"), max_segments=2)
    c = space.config(1, "bf16-mixed", 2)
    other = contrast(space, c)
    assert other is not None
    assert (other.micro_batch_size, other.precision, other.checkpoint_segments) == (2, "fp32", 0)
    last = contrast(space, space.config(8, "fp32", 0))
    assert last is not None and last.micro_batch_size == 4 and last.precision == "bf16-mixed" and last.checkpoint_segments == 2
    single = build_space(dataset_size=100, global_batch=1, precisions=("fp32",), max_segments=0)
    assert contrast(single, single.config(1, "fp32", 0)) is None


class ConvBN(nn.Module):
    """Conv + BatchNorm blocks (digits' shape): FSDP2 in bf16 at a micro-batch of one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()) for c in (1, 8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def test_fsdp_in_bf16_keeps_batch_norm_in_fp32_at_any_micro_batch():
    def sample(b: int):
        return torch.rand(b, 1, 8, 8), torch.randint(0, 10, (b,))
    task = Task(name="convbn", build_model=ConvBN, sample_fn=sample,
                checkpoint_blocks=lambda model: list(model.blocks))
    estimator = Estimator(task, device="cpu")
    peaks = []
    for b in (1, 2):
        est = estimator.estimate(TrainConfig(micro_batch_size=b, precision="bf16-mixed", strategy="fsdp", world_size=2),
                                 exact=True)
        assert est.peak_bytes > 0
        peaks.append(est.peak_bytes)
    assert peaks[1] > peaks[0]  # the activations of a second sample: each batch size was traced

    # The same wrapping for real (two simulated ranks): inside forward, each batch-norm layer
    # holds fp32 parameters while the convolutions and the head are gathered in bf16.
    from estimators.runtime._parallel import apply_fsdp
    from estimators.tracing._simulated_ranks import simulated_ranks

    seen: dict[str, torch.dtype] = {}
    with simulated_ranks(2):
        model = apply_fsdp(ConvBN(), precision="bf16-mixed", finder=lambda m: list(m.blocks))
        for name, module in model.named_modules():
            if isinstance(module, (nn.BatchNorm2d, nn.Conv2d, nn.Linear)):
                module.register_forward_pre_hook(
                    lambda mod, args, name=name: seen.__setitem__(name, mod.weight.dtype))
        for b in (1, 2):
            seen.clear()
            x, y = sample(b)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            nn.functional.cross_entropy(out.float(), y).backward()
            assert seen["blocks.0.1"] == seen["blocks.1.1"] == torch.float32
            assert seen["blocks.0.0"] == seen["blocks.1.0"] == seen["head"] == torch.bfloat16


def test_a_configuration_whose_step_raises_when_probed_is_dropped_and_the_next_probed(tmp_path):
    from estimators.probing._probe import ProbeResult

    task = Task(name="mlp-run", build_model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                sample_fn=_sample)
    predicted = search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=0,
                       precisions=["fp32"], storage=f"sqlite:///{tmp_path / 'a.db'}")
    best = predicted.config
    calls: list[TrainConfig] = []

    def probe_fn(t, config, budget):
        calls.append(config)
        if config == best:
            return ProbeResult(status="error", message="RuntimeError: no kernel for this size", raised=True)
        est = Estimator(t, device="cpu").estimate(config)
        return ProbeResult(status="ok", estimate=est)
    plan = search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=1, precisions=["fp32"],
                  storage=f"sqlite:///{tmp_path / 'b.db'}", probe_fn=probe_fn)
    assert calls[0] == best and len(calls) == 2  # the failed one, then the next in its place
    assert best not in [e.config for e in plan.entries] and best not in [e.config for e in plan.ladder()]
    assert plan.failures == {best: "RuntimeError: no kernel for this size"}
    assert plan.best.measured is not None and plan.best.config == calls[1]
    assert any("could not run" in n and "no kernel for this size" in n for n in plan.notes)
    assert plan.trials == predicted.trials


def test_a_probe_whose_process_died_keeps_the_configuration_unmeasured():
    # Not the configuration's fault: it stays, unmeasured, as before.
    from estimators.probing._probe import ProbeResult

    task = Task(name="mlp-died", build_model=lambda: nn.Sequential(nn.Linear(16, 4)), sample_fn=_sample)
    plan = search(task, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=1, precisions=["fp32"],
                  probe_fn=lambda t, c, b: ProbeResult(status="error", message="the probe process died by SIGSEGV"))
    assert not plan.failures and plan.best.probe_status == "error"


def test_a_model_whose_states_cannot_fit_is_refused_without_a_trace(monkeypatch):
    # 400M parameters: 3.2 GB of fp32 weights and gradients and 3.2 GB of AdamW's two moments
    # (found by a step of the optimizer on meta), before anything else; half of it in bf16-true,
    # the most frugal precision a CPU search may widen to.
    from estimators import NoFeasiblePlanError
    from estimators.estimator import _traces
    traced: list = []
    monkeypatch.setattr(_traces, "trace_step", lambda *a, **k: traced.append(a) or (_ for _ in ()).throw(AssertionError))
    task = Task(name="huge", build_model=lambda: nn.Sequential(nn.Linear(20000, 20000), nn.Linear(20000, 4)),
                sample_fn=lambda b: (torch.randn(b, 20000), torch.randint(0, 4, (b,))))
    with pytest.raises(NoFeasiblePlanError) as info:
        search(task, vram="1GB", device="cpu", global_batch=8, probe_top=0)
    message = str(info.value)
    assert ("400,100,004 parameters, their gradients and the optimizer's state alone need 3.20 GB even in "
            "bf16-true" in message and "--vram 4GB" in message)
    assert traced == [] and info.value.needed_bytes == 4 * 2 * 400_100_004
    # Sharded over 8 FSDP2 ranks the floor is an eighth: it is searched, not refused at once.
    from estimators import Estimator, TrainConfig
    from memplan.planning._refusal import refuse_from_lower_bound, state_floor
    from memplan.planning._space import layouts_for
    space = build_space(dataset_size=None, global_batch=8, precisions=("fp32",), max_segments=0,
                        layouts=layouts_for(8, 1))
    with torch.device("meta"):
        floor = state_floor(task, task.build_model())
    single, sharded = TrainConfig(micro_batch_size=1), TrainConfig(micro_batch_size=1, strategy="fsdp", world_size=8)
    # fp32 weights and gradients, AdamW's two moments: 16 bytes a parameter, an eighth per rank.
    assert floor.device(single) == 16 * 400_100_004 and floor.device(sharded) == 16 * 400_100_004 // 8
    refuse_from_lower_bound(task, floor, space, 10**9, 9 * 10**8, Estimator(task, device="cpu"))  # 800 MB: no refusal
