"""Search and plan: fixed global batch, precision filtering, the margin, resumed studies,
NoFeasiblePlanError and the plan's JSON round-trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.models import TinyLM, lm_task
from helpers.search import PINNED_RATES, measured_probe, probe_estimator  # noqa: F401

from estimators import NoFeasiblePlanError, Task, TrainConfig
from memplan import Plan, search
from memplan.planning._space import build_space

# One task for the module: searches of the same task share its traces, as in the product.
_LM = Task(name="lm2", build_model=lambda: TinyLM(layers=2), sample_fn=lm_task().sample_fn)


def lm() -> Task:
    return _LM


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))




@pytest.fixture(autouse=True)
def _pinned_rates(monkeypatch):
    from estimators.estimator import _estimate
    monkeypatch.setattr(_estimate, "cpu_rates", lambda *args, **kwargs: PINNED_RATES)


def mlp_task() -> Task:
    return Task(name="mlp", build_model=lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                sample_fn=lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))))


def test_space_keeps_the_global_batch_fixed():
    space = build_space(dataset_size=1000, global_batch=24, precisions=("fp32",), max_segments=2)
    assert space.micro_batch_sizes == (1, 2, 3, 4, 6, 8, 12, 24)
    assert all(c.global_batch == 24 for c in space)
    assert space.checkpoint_segments == (0, 1, 2)
    # The global batch is a training hyper-parameter: the space never searches it (search()
    # fixes 32 when nobody gives one; tests/memplan/test_fit_defaults.py), only how it is reached.
    from estimators import ConfigError
    with pytest.raises(ConfigError, match="--global-batch must be a whole number"):
        build_space(dataset_size=100, global_batch=None, precisions=("fp32",), max_segments=0)


def test_plan_respects_budget_margin_and_global_batch(tmp_path):
    task = lm()
    plan = search(task, vram="1GB", global_batch=8, trials=40, probe_top=0, device="cpu")
    assert all(e.config.global_batch == 8 for e in plan.entries)
    limit = plan.budget_bytes * (1 - plan.margin)
    assert all(e.peak_bytes <= limit for e in plan.entries)
    speeds = [e.samples_per_s for e in plan.entries]
    assert speeds == sorted(speeds, reverse=True)
    # A budget just under the best plan's need (with the margin) excludes it.
    tight = int(plan.best.peak_bytes / (1 - plan.margin)) - 1
    plan2 = search(task, vram=tight, global_batch=8, trials=40, probe_top=0, device="cpu")
    assert plan.best.config not in [e.config for e in plan2.entries]
    assert all(e.peak_bytes <= tight * (1 - plan2.margin) for e in plan2.entries)


def test_precision_filtered_by_device():
    plan = search(lm(), vram="80GB", gpu="V100-32GB", global_batch=2, trials=200, probe_top=0)
    assert {e.config.precision for e in plan.entries} == {"fp32", "fp16-mixed"}
    plan = search(lm(), vram="80GB", gpu="A100-80GB", global_batch=2, trials=200, probe_top=0)
    # With bf16 on the card, fp16 (same rate, plus a GradScaler) is searched only when asked.
    assert {e.config.precision for e in plan.entries} == {"fp32", "bf16-mixed"}
    asked = search(lm(), vram="80GB", gpu="A100-80GB", global_batch=2, trials=200, probe_top=0,
                   precisions=["fp16", "bf16"])
    assert {e.config.precision for e in asked.entries} == {"fp16-mixed", "bf16-mixed"}
    cpu = search(lm(), vram="1GB", device="cpu", global_batch=4, trials=200, probe_top=0)
    assert "fp16-mixed" not in {e.config.precision for e in cpu.entries}


def test_no_feasible_plan_names_the_nearest_miss_and_the_fix():
    # 350 kB (315 kB after the margin): above the model's parameters, gradients and AdamW
    # state (302 kB, the lower bound), below any fp32 plan (370 kB+); fp32 pinned, so that the
    # search does not widen to bf16-true (which would fit).
    with pytest.raises(NoFeasiblePlanError) as info:
        search(lm(), vram="350kB", device="cpu", global_batch=4, probe_top=0, precisions=["fp32"])
    message = str(info.value)
    assert message.startswith("nothing fits in 350 kB")
    assert "the smallest plan (micro-batch 1" in message and "params" in message and "try" in message
    assert info.value.needed_bytes > 350_000


def test_resumed_study_reuses_its_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=0, storage=storage)
    import optuna
    summaries = optuna.get_all_study_summaries(storage)
    assert len(summaries) == 1 and summaries[0].n_trials == first.trials
    again = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=0, storage=storage)
    assert optuna.get_all_study_summaries(storage)[0].n_trials == first.trials  # nothing re-run
    assert again.config == first.config


def test_a_resumed_study_with_probes_traces_nothing_again(tmp_path, monkeypatch):
    # A new process resuming a study: a new task from the same file, so a new estimator
    # without traces. Its trials answer the predictions, and the probes' refit of the
    # unprobed ones comes from the predictions' stored parts, not from tracing them again.
    from helpers.models import SLEEPY

    from estimators import load_task
    from estimators.estimator import _traces
    path = tmp_path / "sleepy.py"
    path.write_text(SLEEPY)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, precisions=["fp32"],
                  storage=storage, race_fn=_race_answering([], ((0.4, 0.4, 0.4), (0.5, 0.5, 0.5))))
    # The fake probe estimates with an estimator of its own: it answers each configuration
    # once, so that only the search's own tracing is counted.
    answers: dict = {}

    def probe_once(task, config, budget):
        if config not in answers:
            answers[config] = measured_probe([], {})(task, config, budget)
        return answers[config]
    first = search(load_task(path), probe_fn=probe_once, **kwargs)
    traced: list[TrainConfig] = []
    original = _traces.trace_step
    monkeypatch.setattr(_traces, "trace_step",
                        lambda task, config, **kw: traced.append(config) or original(task, config, **kw))
    again = search(load_task(path), probe_fn=probe_once, **kwargs)
    assert traced == []
    assert [e.config for e in again.entries] == [e.config for e in first.entries]
    for a, b in zip(again.entries, first.entries):
        assert a.samples_per_s == pytest.approx(b.samples_per_s, rel=1e-9)


def test_same_seed_same_plan_with_sampling(tmp_path):
    kwargs = dict(vram="80GB", gpu="A100-80GB", trials=6, probe_top=0, seed=3)
    a = search(lm(), storage=f"sqlite:///{tmp_path / 'a.db'}", **kwargs)
    b = search(lm(), storage=f"sqlite:///{tmp_path / 'b.db'}", **kwargs)
    assert [e.config for e in a.entries] == [e.config for e in b.entries]


def test_plan_json_round_trip_and_ladder(tmp_path):
    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=0)
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    ladder = plan.ladder()
    peaks = [plan.best.peak_bytes] + [e.peak_bytes for e in ladder]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert all(e.config.global_batch == 8 for e in ladder)
    assert "micro" in plan.table()


def test_probes_rank_measured_first_and_drop_ooms():
    from estimators.probing._probe import ProbeResult
    calls = []

    def fake_probe(task, config: TrainConfig, budget: int):
        calls.append(config)
        if len(calls) == 1:
            return ProbeResult(status="oom", estimate=None, message="guard", overhead_s=0.0, wall_s=0.0)
        est = probe_estimator(task).estimate(config)
        from dataclasses import replace
        return ProbeResult(status="ok", estimate=replace(est, method="measured"), message="", overhead_s=0.0, wall_s=0.0)

    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, probe_fn=fake_probe)
    assert calls[0] not in [e.config for e in plan.entries]  # the OOM is dropped
    assert plan.best.measured is not None and plan.best.config in calls[1:]
    measured = [e for e in plan.entries if e.measured is not None]
    assert len(measured) == 2 and plan.best.samples_per_s == max(e.samples_per_s for e in measured)
    assert any("ran out of memory" in n for n in plan.notes)


def test_layouts_for_devices_and_nodes():
    from memplan.planning._space import layouts_for
    assert [lay.key for lay in layouts_for()] == ["single"]
    assert [lay.key for lay in layouts_for(8)] == ["ddp x8", "fsdp x8"]
    assert [lay.key for lay in layouts_for(8, 2, ("fsdp",))] == ["fsdp x16 on 2 nodes"]
    from estimators import ConfigError
    with pytest.raises(ConfigError, match="--gpus must be"):
        layouts_for(0)
    with pytest.raises(ConfigError, match="single runs on one device"):
        layouts_for(2, strategies=("single",))


def test_space_splits_the_fixed_global_batch_over_the_ranks():
    from memplan.planning._space import layouts_for
    space = build_space(dataset_size=1000, global_batch=32, precisions=("fp32",), max_segments=0,
                        layouts=layouts_for(4))
    # Every micro-batch size is valid for every layout: micro x accumulation x 4 ranks = 32.
    assert space.micro_batch_sizes == (1, 2, 4, 8)
    configs = list(space)
    assert {c.strategy for c in configs} == {"ddp", "fsdp"} and {c.world_size for c in configs} == {4}
    assert all(c.global_batch == 32 for c in configs)
    assert len(configs) == len(space) == 8
    with pytest.raises(Exception, match="does not divide over 4 processes"):
        build_space(dataset_size=1000, global_batch=30, precisions=("fp32",), max_segments=0, layouts=layouts_for(4))


def test_ladder_keeps_strategy_and_world_size_and_plan_says_how_to_launch():
    from estimators import Estimate
    from memplan import PlanEntry

    def entry(micro: int, strategy: str, world: int, peak: int, speed: float) -> PlanEntry:
        config = TrainConfig(micro_batch_size=micro, grad_accum_steps=8 // (micro * world), strategy=strategy,
                             world_size=world)
        est = Estimate(step_time_s=8 / speed, samples_per_s=speed, config=config, device="cuda", gpu="A100-80GB",
                       peak_allocated_bytes=peak, peak_reserved_bytes=peak, breakdown={}, peak_phase="forward",
                       context_bytes=0, workspace_bytes=0, method="traced", modelled=True, params=1,
                       trainable_params=1, notes=())
        return PlanEntry(config=config, predicted=est)

    entries = (entry(4, "ddp", 2, 900, 100.0), entry(4, "fsdp", 2, 500, 90.0), entry(2, "ddp", 2, 600, 80.0),
               entry(1, "ddp", 2, 400, 70.0), entry(8, "single", 1, 300, 60.0))
    plan = Plan(entries=entries, budget_bytes=1000, margin=0.1, device="cuda", gpu="A100-80GB", global_batch=8,
                trials=5)
    rungs = [e.config for e in plan.ladder()]
    assert rungs == [entries[2].config, entries[3].config]  # never fsdp, never single
    assert plan.launch == {"nproc_per_node": 2, "nnodes": 1}
    assert Plan.from_dict(plan.to_dict()).launch == plan.launch


def test_search_for_two_devices_splits_the_global_batch_and_shards():
    task = mlp_task()
    single = search(task, vram="1GB", device="cpu", global_batch=8, precisions=["fp32"], trials=40, probe_top=0)
    plan = search(task, vram="1GB", device="cpu", gpus=2, global_batch=8, precisions=["fp32"],
                  strategies=("fsdp",), trials=40, probe_top=0)
    assert {(e.config.strategy, e.config.world_size) for e in plan.entries} == {("fsdp", 2)}
    assert all(e.config.global_batch == 8 for e in plan.entries)
    assert plan.launch == {"nproc_per_node": 2, "nnodes": 1}
    assert any("ranked by prediction" in n for n in plan.notes)
    # The same micro-batch needs less memory per rank with FSDP2 (parameters, gradients and
    # optimizer state sharded over the two ranks).
    fsdp = {e.config.micro_batch_size: e.peak_bytes for e in plan.entries}
    one = {e.config.micro_batch_size: e.peak_bytes for e in single.entries}
    shared = set(fsdp) & set(one)
    assert shared and all(fsdp[k] < one[k] for k in shared)


def test_probes_cover_each_precision_early():
    from memplan.planning._probes import _probe_order
    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=0)
    order = _probe_order(list(plan.entries))
    assert order[0] == plan.entries[0]
    precisions = {e.config.precision for e in plan.entries}
    assert {e.config.precision for e in order[:len(precisions)]} == precisions
    assert sorted(map(id, order)) == sorted(map(id, plan.entries))  # a reordering, nothing lost


def test_interrupted_search_keeps_its_trials_and_resumes(tmp_path, monkeypatch):
    import optuna

    from estimators import Estimator
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    real_estimate = Estimator.estimate
    calls = []

    def interrupted_at_the_fifth(self, config, **kwargs):
        calls.append(config)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_estimate(self, config, **kwargs)

    monkeypatch.setattr(Estimator, "estimate", interrupted_at_the_fifth)
    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=0, storage=storage)
    # No plan from a part of the study: the search stops, saying how many trials it kept.
    from memplan import SearchInterrupted
    with pytest.raises(SearchInterrupted, match="after 4 trials, kept in its study; run the same command again"):
        search(lm(), **kwargs)
    assert optuna.get_all_study_summaries(storage)[0].n_trials == 4  # written before stopping

    monkeypatch.setattr(Estimator, "estimate", real_estimate)
    whole = search(lm(), **kwargs)
    assert not any("interrupted" in n for n in whole.notes) and whole.trials > 4
    assert optuna.get_all_study_summaries(storage)[0].n_trials == whole.trials
    fresh = search(lm(), **{**kwargs, "storage": f"sqlite:///{tmp_path / 'fresh.db'}"})
    assert [e.config for e in whole.entries] == [e.config for e in fresh.entries]


def test_study_writes_through_in_batches(tmp_path):
    import optuna

    from memplan.planning._study import MirroredStudy
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    mirrored = MirroredStudy(name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0),
                             tuned_sqlite=True, flush_s=0.0)
    seen = []

    def objective(trial):
        # Every earlier trial is already in the persistent storage when the next one runs.
        seen.append(len(optuna.load_study(study_name="s", storage=storage).trials))
        return trial.suggest_float("x", 0, 1)

    mirrored.optimize(objective, n_trials=3, progress=False)
    assert seen == [0, 1, 2]
    again = MirroredStudy(name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    assert [t.params for t in again.resumed()] == [t.params for t in mirrored.study.trials]


def test_equal_predictions_rank_the_simpler_config_and_are_probed_once():
    # Checkpointing a Linear is free: its backward needs only the block's input and weight,
    # so the estimator predicts every segment count alike and the twins must not crowd out
    # a configuration that differs.
    stack = Task(name="linear-stack",
                 build_model=lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                                   nn.Linear(64, 4)),
                 sample_fn=lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    probed = []

    def fake_probe(task, config: TrainConfig, budget: int):
        from dataclasses import replace

        from estimators.probing._probe import ProbeResult
        probed.append(config)
        est = probe_estimator(task).estimate(config)
        return ProbeResult(status="ok", estimate=replace(est, method="measured"), message="", overhead_s=0.0, wall_s=0.0)

    plan = search(stack, vram="1GB", device="cpu", global_batch=8, trials=100, probe_top=2, probe_fn=fake_probe,
                  precisions=["fp32"])
    twins = [e for e in plan.entries if e.config.micro_batch_size == 8]
    # The probed twin shows the prediction it was probed on; the others are refitted on the
    # probes: each group alike (a calibration that round-trips its own estimate may still
    # move the last bit, so the two groups are not compared).
    from estimators import Estimator
    uncalibrated = Estimator(stack, device="cpu")
    assert len(twins) == 4 and len({uncalibrated.estimate(e.config).step_time_s for e in twins}) == 1
    assert len({e.predicted.step_time_s for e in twins if e.measured is None}) == 1
    assert [e.config.checkpoint_segments for e in twins] == [0, 1, 2, 3]  # the simplest first
    # Two probes, of configurations the estimator tells apart: micro-batch 8 and 4 x 2.
    assert [(c.micro_batch_size, c.checkpoint_segments) for c in probed] == [(8, 0), (4, 0)]
    assert plan.best.config == probed[0] or plan.best.config == probed[1]


def test_probes_overturning_the_prediction_are_confirmed():
    from dataclasses import replace

    from estimators.probing._probe import ProbeResult
    calls: list[TrainConfig] = []
    # The second configuration measures fast once (noise), then as predicted.
    noisy_once = {"left": 1}

    def fake_probe(task, config: TrainConfig, budget: int):
        calls.append(config)
        est = probe_estimator(task).estimate(config)
        step = est.step_time_s
        if len(calls) == 2 and noisy_once["left"]:
            noisy_once["left"] = 0
            step = est.step_time_s / 3
        measured = replace(est, method="measured", step_time_s=step, samples_per_s=config.global_batch / step)
        return ProbeResult(status="ok", estimate=measured, message="", overhead_s=0.0, wall_s=0.0)

    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, probe_fn=fake_probe,
                  precisions=["fp32"])
    first, second = calls[0], calls[1]
    assert calls[2:] == [second, first]  # the overturning pair, probed again
    by_config = {e.config: e for e in plan.entries}
    assert any("mean of two probes" in n for n in by_config[second].measured.notes)
    assert any("ahead of the predicted best" in n for n in plan.notes)
    # The second's two probes lie 3x apart, further than any lead on the means: the probes
    # cannot tell the two apart, and the prediction's order is kept; the figure shown for the
    # second is then the first's times the prediction's ratio, not its faster mean.
    assert plan.best.config == first
    assert any("the predicted order is kept" in n for n in plan.notes)
    assert by_config[second].source == "predicted" and by_config[second].samples_per_s <= plan.best.samples_per_s
    speeds = [e.samples_per_s for e in plan.entries]
    assert speeds == sorted(speeds, reverse=True)

    # A lead both probes agree on stands.
    calls.clear()
    faster = {"config": None}

    def consistent_probe(task, config: TrainConfig, budget: int):
        calls.append(config)
        est = probe_estimator(task).estimate(config)
        if len(calls) == 2:
            faster["config"] = config
        step = est.step_time_s / (3 if config == faster["config"] else 1)
        measured = replace(est, method="measured", step_time_s=step, samples_per_s=config.global_batch / step)
        return ProbeResult(status="ok", estimate=measured, message="", overhead_s=0.0, wall_s=0.0)

    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, probe_fn=consistent_probe,
                  precisions=["fp32"])
    assert calls[2:] == [calls[1], calls[0]] and plan.best.config == calls[1]
    assert not any("the predicted order is kept" in n for n in plan.notes)

    # Probes that agree with the prediction are believed at once.
    calls.clear()
    noisy_once["left"] = 0
    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, probe_fn=fake_probe,
                  precisions=["fp32"])
    assert len(calls) == 2 and plan.best.config == calls[0]


def test_a_kept_prediction_ranks_only_against_its_rival():
    # Three probed: the rival leads once by noise, a third configuration measures faster
    # than both every time. The predicted best goes back above its rival, not above the third.
    from dataclasses import replace

    from estimators.probing._probe import ProbeResult
    calls: list[TrainConfig] = []
    base: dict[str, float] = {}

    def fake_probe(task, config: TrainConfig, budget: int):
        calls.append(config)
        est = probe_estimator(task).estimate(config)
        base.setdefault("t", est.step_time_s)
        t = base["t"]
        order = list(dict.fromkeys(calls))
        step = {0: t, 1: t / 3 if calls.count(config) == 1 else t, 2: t / 2}[order.index(config)]
        measured = replace(est, method="measured", step_time_s=step, samples_per_s=config.global_batch / step)
        return ProbeResult(status="ok", estimate=measured, message="", overhead_s=0.0, wall_s=0.0)

    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=3, probe_fn=fake_probe,
                  precisions=["fp32"])
    predicted, rival, third = list(dict.fromkeys(calls))
    assert any("the predicted order is kept" in n for n in plan.notes)
    ranked = [e.config for e in plan.entries if e.measured is not None]
    assert ranked == [third, predicted, rival]


def _race_answering(races: list, step_times):
    from estimators.probing._race import RaceResult

    def fake_race(task, pair):
        races.append(pair)
        if step_times is None:
            return RaceResult(status="error", configs=pair, message="the race process died by SIGSEGV")
        return RaceResult(status="ok", configs=pair, step_times=step_times)
    return fake_race


def test_the_two_best_are_raced_and_only_the_winner_is_probed_for_memory():
    calls: list[TrainConfig] = []
    races: list = []
    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, precisions=["fp32"])
    # The rival faster in 3 of 4 rounds, by 25% on the median ratio.
    plan = search(lm(), **kwargs, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_answering(races, ((0.5, 0.5, 0.5, 0.3), (0.4, 0.4, 0.4, 0.4))))
    # The two differ in checkpoint segments only, and the fake race lets the second of any
    # pair win: the walk races one more segment against the winner, which wins too; lm() has
    # no third segment to go on to. Only the last winner's memory is probed.
    (first, second), (_, third) = races
    assert races[1][0] == second and len(races) == 2
    assert (second.checkpoint_segments, third.checkpoint_segments) == (first.checkpoint_segments + 1, first.checkpoint_segments + 2)
    assert calls == [third]
    assert plan.best.config == third
    assert plan.best.measured.step_time_s == pytest.approx(0.4)  # the race's median, not the probe's
    assert f"raced step against step with {second.describe()}" in plan.best.measured.notes[-1]
    by_config = {e.config: e for e in plan.entries}
    assert by_config[first].measured is None and by_config[second].measured is None
    # The raced losers show the races' ratios on the winner's measured time, not their own
    # medians (second's 0.4 s came from its race against first, at another moment than
    # third's): second is 1.25x slower than third, first 1.25x slower than second.
    assert by_config[second].predicted.step_time_s == pytest.approx(0.5) and by_config[second].source == "raced"
    assert by_config[first].predicted.step_time_s == pytest.approx(0.625) and by_config[first].source == "raced"
    assert "0.80x the speed of" in by_config[second].predicted.notes[-1]
    assert "raced" in plan.table()
    assert any("faster than the predicted best" in n and "in 3 of 4 rounds (by 25% on the median): it goes above the "
               "predicted best" in n for n in plan.notes)
    assert any(n.startswith(f"one step further, {third.describe()} raced {second.describe()}: faster") for n in plan.notes)

    # The predicted best wins: it alone is probed, and nothing is walked.
    calls.clear()
    races.clear()
    plan = search(lm(), **kwargs, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_answering(races, ((0.4, 0.4, 0.4), (0.5, 0.5, 0.5))))
    assert len(races) == 1 and calls == [races[0][0]] and plan.best.config == races[0][0]
    assert any(f"the predicted best ({races[0][0].describe()}) was faster than {races[0][1].describe()} in 3 of 3 "
               "rounds (by 25% on the median): the predicted order is kept" in n for n in plan.notes)

    # A tie (the median ratio within 1%) keeps the prediction's order, even where the
    # medians of the times alone would put the rival first.
    calls.clear()
    races.clear()
    plan = search(lm(), **kwargs, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_answering(races, ((0.5, 0.4, 0.4), (0.5, 0.397, 0.3))))
    assert plan.best.config == races[0][0] == calls[0]
    assert any(f"tied with {races[0][1].describe()}: the predicted order is kept" in n for n in plan.notes)


def _race_sequence(races: list, answers: list):
    """A fake race answering each race in turn: step times, or None for a failed race."""
    from estimators.probing._race import RaceResult

    def fake_race(task, pair):
        races.append(pair)
        step_times = answers[len(races) - 1]
        if step_times is None:
            return RaceResult(status="error", configs=pair, message="the race process died by SIGSEGV")
        return RaceResult(status="ok", configs=pair, step_times=step_times)
    return fake_race


def test_a_race_won_along_one_axis_is_followed_until_a_race_is_lost():
    from estimators import Estimator

    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, precisions=["fp32"])
    rival_wins, first_wins = ((0.5, 0.5, 0.5), (0.4, 0.4, 0.4)), ((0.4, 0.4, 0.4), (0.5, 0.5, 0.5))
    # The walk's race is lost: the first race's winner stays first and is the one probed;
    # the walk's loser is unmeasured, its race still refits the time model.
    calls: list[TrainConfig] = []
    races: list = []
    plan = search(lm(), **kwargs, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_sequence(races, [rival_wins, first_wins]))
    (first, second), (_, third) = races
    assert races[1][0] == second and third.checkpoint_segments == second.checkpoint_segments + 1
    assert calls == [second] and plan.best.config == second
    assert next(e for e in plan.entries if e.config == third).measured is None
    assert any("was not faster (median ratio 0.80): the walk stops" in n for n in plan.notes)

    # A walk step won by under 5% is kept, but not followed further (micro-batch 8 lost to
    # 4 x2; 2 x4 then wins by 3%, and 1 x8 is not raced).
    from memplan.planning import PlanEntry
    from memplan.planning._races import _follow_trend
    est = Estimator(lm(), device="cpu")
    m8, m4, m2, m1 = (TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m) for m in (8, 4, 2, 1))
    entry = {c: PlanEntry(config=c, predicted=est.estimate(c)) for c in (m8, m4, m2, m1)}
    races.clear()
    order = [entry[m4], entry[m8]]
    timed = {m4: (0.4, 3, m8), m8: (0.5, 3, m4)}
    small_win = ((0.412, 0.412, 0.412), (0.4, 0.4, 0.4))
    rest = _follow_trend(lm(), est, order, [entry[m2], entry[m1]], timed,
                         _race_sequence(races, [small_win, rival_wins]), [])
    assert races == [(m4, m2)] and [e.config for e in order] == [m2, m4, m8]
    assert [e.config for e in rest] == [m1] and timed[m2] == (pytest.approx(0.4), 3, m4)

    # A race won by under 5% is not followed.
    calls.clear()
    races.clear()
    plan = search(lm(), **kwargs, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_sequence(races, [((0.412, 0.412, 0.412), (0.4, 0.4, 0.4))]))
    assert len(races) == 1 and plan.best.config == races[0][1] == calls[0]
    assert not any("one step further" in n for n in plan.notes)

    # The walk's winner fails its memory probe: dropped, and the one it beat is probed.
    calls.clear()
    races.clear()
    measured = measured_probe(calls, {})

    def probe_ooms_first(task, config, budget):
        result = measured(task, config, budget)
        return replace(result, status="oom", estimate=None) if len(calls) == 1 else result
    from dataclasses import replace
    plan = search(lm(), **kwargs, probe_fn=probe_ooms_first, race_fn=_race_sequence(races, [rival_wins, rival_wins]))
    (first, second), (_, third) = races
    assert calls == [third, second] and plan.best.config == second
    assert third not in {e.config for e in plan.entries}
    assert any(f"{third.describe()} raced fastest but ran out of memory when probed; dropped" in n for n in plan.notes)

    # The race's winner differs from the predicted best in more than one axis, or the
    # predicted best won: there is no walk.
    from memplan.planning._races import _next_along
    a = TrainConfig(micro_batch_size=8, grad_accum_steps=1)
    b = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=1)
    beyond = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint_segments=1)
    entries = [PlanEntry(config=c, predicted=est.estimate(c)) for c in (beyond,)]
    assert _next_along(b, a, entries) is None
    smaller = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    further = TrainConfig(micro_batch_size=2, grad_accum_steps=4)
    entries = [PlanEntry(config=c, predicted=est.estimate(c)) for c in (further, beyond)]
    assert _next_along(smaller, a, entries).config == further
    assert _next_along(a, smaller, entries) is None


def test_after_a_race_memory_failures_and_a_larger_probe_top():
    from dataclasses import replace
    kwargs = dict(vram="1GB", device="cpu", global_batch=8, trials=40, precisions=["fp32"])
    first_wins = ((0.4, 0.4, 0.4), (0.5, 0.5, 0.5))
    # probe_top=3: the race measures two, and the next configuration races the measured best
    # (a probe of its own, in another process at another moment, would not compare with the
    # race's figures). It loses: its figure is the best's times the race's ratio, and its
    # memory is not probed.
    calls: list[TrainConfig] = []
    races: list = []
    plan = search(lm(), **kwargs, probe_top=3, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_sequence(races, [first_wins, first_wins]))
    (first, second), (again, third) = races
    assert again == first and third not in (first, second) and calls == [first]
    by_config = {e.config: e for e in plan.entries}
    assert plan.best.config == first and by_config[third].source == "raced"
    assert by_config[third].predicted.step_time_s == pytest.approx(0.5)
    assert any(f"{third.describe()} raced the measured best ({first.describe()}) and was not faster" in n
               for n in plan.notes)
    # It wins: its memory is probed, it is the measured best, and the others' figures are
    # taken from its time (first 1.25x slower, second 1.25x slower than first).
    calls.clear()
    races.clear()
    plan = search(lm(), **kwargs, probe_top=3, probe_fn=measured_probe(calls, {}),
                  race_fn=_race_sequence(races, [first_wins, ((0.5, 0.5, 0.5), (0.4, 0.4, 0.4))]))
    (first, second), (_, third) = races
    assert calls == [first, third] and plan.best.config == third and plan.best.source == "measured"
    by_config = {e.config: e for e in plan.entries}
    assert by_config[first].source == "raced" and by_config[first].measured.step_time_s == pytest.approx(0.5)
    assert by_config[second].predicted.step_time_s == pytest.approx(0.625)
    speeds = [e.samples_per_s for e in plan.entries]
    assert speeds == sorted(speeds, reverse=True)

    # Both raced configurations run out of memory: the next two are probed in full instead.
    calls.clear()
    races.clear()
    measured = measured_probe(calls, {})

    def oom_twice(task, config, budget):
        result = measured(task, config, budget)
        return replace(result, status="oom", estimate=None) if len(calls) <= 2 else result
    plan = search(lm(), **kwargs, probe_top=2, probe_fn=oom_twice, race_fn=_race_sequence(races, [first_wins]))
    (first, second), = races
    assert calls[:2] == [first, second] and len(calls) == 4 and not {first, second} & set(calls[2:])
    assert {e.config for e in plan.entries if e.measured is not None} == set(calls[2:])
    assert first not in {e.config for e in plan.entries} and second not in {e.config for e in plan.entries}

    # A memory probe that fails for another reason keeps the configuration, unmeasured, and
    # probes nothing further.
    calls.clear()
    races.clear()

    def crashes(task, config, budget):
        result = measured(task, config, budget)
        return replace(result, status="error", estimate=None, message="the probe process died by SIGSEGV")
    plan = search(lm(), **kwargs, probe_top=2, probe_fn=crashes, race_fn=_race_sequence(races, [first_wins]))
    (first, second), = races
    assert calls == [first] and all(e.measured is None for e in plan.entries)
    assert {first, second} <= {e.config for e in plan.entries}
    assert any("memory probe error (the probe process died by SIGSEGV); kept unmeasured" in n for n in plan.notes)


def test_a_failed_race_falls_back_to_probing():
    calls: list[TrainConfig] = []
    races: list = []
    plan = search(lm(), vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, precisions=["fp32"],
                  probe_fn=measured_probe(calls, {2: 3.0}), race_fn=_race_answering(races, None))
    first, second = races[0]
    assert len(races) == 1 and calls == [first, second, second, first]
    assert any("did not finish (error: the race process died by SIGSEGV); both are probed instead" in n
               for n in plan.notes)
    # The second's two probes lie 3x apart: the prediction's order is kept, as without a race.
    assert plan.best.config == first
    assert any("the predicted order is kept" in n for n in plan.notes)


def test_search_races_for_real(tmp_path):
    # Real races of a model whose blocks sleep: more micro-batches or checkpointed blocks
    # sleep more, so the predicted best is also the truly fastest, and the race says so.
    from helpers.models import SLEEPY

    from estimators import load_task
    from estimators.probing._probe import shutdown
    from estimators.probing._race import race
    path = tmp_path / "sleepy.py"
    path.write_text(SLEEPY)
    task = load_task(path)
    calls: list[TrainConfig] = []
    races: list = []

    def real_race(t, pair):
        races.append(pair)
        return race(t, pair, rounds=4, warmup=1)
    try:
        plan = search(task, vram="1GB", device="cpu", global_batch=8, trials=40, probe_top=2, precisions=["fp32"],
                      probe_fn=measured_probe(calls, {}), race_fn=real_race)
    finally:
        shutdown()
    (first, second), = races
    assert (first.micro_batch_size, first.checkpoint_segments) == (8, 0)
    assert calls == [first] and plan.best.config == first
    # The race's own step time: two 50 ms sleeps a plain step at least.
    assert plan.best.measured.step_time_s >= 0.1
    assert "raced step against step" in plan.best.measured.notes[-1]
    assert next(e for e in plan.entries if e.config == second).measured is None
    assert any("the predicted order is kept" in n for n in plan.notes)


def test_a_race_on_cuda_needs_both_configurations_to_fit_together(monkeypatch):
    # No GPU here: the free-memory query is stubbed; the rule is what is tested.
    from estimators import Estimator
    from memplan.planning import PlanEntry
    from memplan.planning._races import fit_together as _fit_together
    config_a, config_b = TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    est = Estimator(lm(), device="cpu")

    def entry(config, peak):
        from dataclasses import replace
        predicted = est.estimate(config)
        measured = replace(predicted, method="measured", peak_allocated_bytes=peak - 100, peak_reserved_bytes=peak)
        return PlanEntry(config=config, predicted=predicted, measured=measured, probe_status="ok")
    a, b = entry(config_a, 6_000), entry(config_b, 5_000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000, 80_000))
    assert not _fit_together("cuda", a, b)  # 11 000 reserved bytes, 10 000 free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (11_000, 80_000))
    assert _fit_together("cuda", a, b) and _fit_together("cuda:1", a, b)
    assert _fit_together("cpu", a, b)
