"""When nothing fits with the standard configurations, the search widens to the techniques that
trade precision or speed for memory (bf16-true, selective checkpointing) and says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from estimators import NoFeasiblePlanError, Task
from memplan import search


def _wide_task() -> Task:
    # 8M parameters: fp32 weights, gradients and AdamW's two moments need 128 MB (bf16-mixed as
    # much: it keeps fp32 weights); bf16-true half of it. Activations are small.
    return Task(name="wide", build_model=lambda: nn.Sequential(nn.Linear(2000, 2000), nn.ReLU(), nn.Linear(2000, 2000)),
                sample_fn=lambda b: (torch.randn(b, 2000), torch.randint(0, 2000, (b,))))


def test_a_model_that_fits_only_in_bf16_true_gets_a_plan_that_says_why() -> None:
    plan = search(_wide_task(), vram="110MB", device="cpu", global_batch=4, probe_top=0, trials=20)
    assert plan.best.config.precision == "bf16-true"
    assert any("searched again with bf16-true" in note for note in plan.notes), plan.notes
    assert plan.best.predicted.peak_bytes <= 110e6


def test_the_standard_space_is_searched_first() -> None:
    plan = search(_wide_task(), vram="1GB", device="cpu", global_batch=4, probe_top=0, trials=20)
    assert plan.best.config.precision != "bf16-true"
    assert not any("searched again" in note for note in plan.notes)


def test_pinned_precisions_are_not_widened() -> None:
    with pytest.raises(NoFeasiblePlanError):
        search(_wide_task(), vram="110MB", device="cpu", global_batch=4, probe_top=0, trials=20, precisions=["fp32"])


def test_the_optimizer_steps_in_backward_when_only_that_fits_and_clipping_allows() -> None:
    # fp32 pinned: weights, gradients, AdamW's moments and its step's temporaries peak at
    # 176 MB; stepping each parameter as its gradient is ready holds one layer's gradient and
    # temporaries at a time (144 MB).
    from estimators import StepOptions
    task = _wide_task().with_step(StepOptions(clip="off"))
    plan = search(task, vram="170MB", device="cpu", global_batch=4, probe_top=0, trials=30, precisions=["fp32"])
    assert plan.best.config.optimizer_in_backward and plan.best.config.grad_accum_steps == 1
    assert any("optimizer-in-backward" in note for note in plan.notes), plan.notes
    # Clipping by the global norm (the default step) excludes it, and the refusal says what was tried.
    with pytest.raises(NoFeasiblePlanError):
        search(_wide_task(), vram="170MB", device="cpu", global_batch=4, probe_top=0, trials=30, precisions=["fp32"])


def test_configurations_pruned_without_a_trace_cost_none_of_the_trial_budget(tmp_path, monkeypatch) -> None:
    # 110 MB: fp32 and bf16-mixed are known not to fit from the model's states alone (128 MB),
    # so every such trial is pruned; the widened study still estimates its budget of trials.
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))  # a study of its own, not resumed
    # A trial budget given is the enumeration's limit: this space, larger than 8, is sampled.
    plan = search(_wide_task(), vram="110MB", device="cpu", global_batch=4, probe_top=0, trials=8, seed=3)
    assert plan.best.config.precision == "bf16-true"
    assert plan.trials == 8


def test_the_widened_space_checkpoints_with_the_selective_and_the_op_policy() -> None:
    from estimators import Estimator
    from memplan.planning._space import build_space, frugal_space
    space = build_space(dataset_size=None, global_batch=4, precisions=("fp32",), max_segments=2)
    wide = frugal_space(space, Estimator(_wide_task(), device="cpu"), precisions_pinned=True)
    assert wide is not None
    policies = {c.checkpoint_policy for c in wide if c.checkpoint_segments}
    assert policies == {"full", "selective", "op"}, policies
    # Never without checkpointed blocks: a policy of nothing is the plain configuration.
    assert all(c.checkpoint_policy == "full" for c in wide if not c.checkpoint_segments)
