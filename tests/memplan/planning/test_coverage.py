"""How much of its space a search estimated: enumerated when what the model states leave is
small (beyond the default trial budget; a budget given is the limit), said in the plan's notes
and provenance when sampled."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from estimators import Task
from memplan import Plan, search
from memplan.planning import _search
from memplan.planning._coverage import Coverage


def _task() -> Task:
    # 8M parameters: fp32 states (weights, gradients, AdamW's moments) need 128 MB.
    return Task(name="cov", build_model=lambda: nn.Sequential(nn.Linear(2000, 2000), nn.ReLU(), nn.Linear(2000, 2000)),
                sample_fn=lambda b: (torch.randn(b, 2000), torch.randint(0, 2000, (b,))))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))  # a study of its own, never resumed


def test_a_sampled_space_says_how_much_was_estimated_and_how_to_ask_for_more(monkeypatch, tmp_path) -> None:
    # A budget given is the limit: a space larger than it is sampled, however small.
    plan = search(_task(), vram="1GB", device="cpu", global_batch=4, probe_top=0, trials=2)
    cov = plan.provenance["search_coverage"]
    assert cov["estimated"] == plan.trials == 2 and not cov["enumerated"]
    assert cov["configurations"] > cov["estimated"] + cov["pruned"]
    note = next(n for n in plan.notes if n.startswith("estimated 2 of"))
    assert f"--trials {cov['trials_for_all']}" in note
    # The JSON keeps it; the table prints it.
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").provenance["search_coverage"] == cov
    assert "note: estimated 2 of" in plan.table()


def test_by_default_a_space_within_the_limit_is_enumerated_and_finds_the_best(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(_search, "DEFAULT_TRIALS", 2)  # the default budget below the space's size
    default = search(_task(), vram="1GB", device="cpu", global_batch=4, probe_top=0)
    cov = default.provenance["search_coverage"]
    assert cov["enumerated"] and cov["estimated"] + cov["pruned"] == cov["configurations"] > 2
    assert not any(n.startswith("estimated ") for n in default.notes)
    # The same as a trial budget of the space's size gives (asked whole by the plain rule).
    # Another study (its own storage), the same machine rates (the cache folder's).
    whole = search(_task(), vram="1GB", device="cpu", global_batch=4, probe_top=0, trials=cov["trials_for_all"],
                   storage=f"sqlite:///{tmp_path / 'other.db'}")
    assert whole.provenance["search_coverage"]["enumerated"]
    assert whole.best.config == default.best.config


def test_a_larger_budget_never_gets_a_slower_plan() -> None:
    # Precisions pinned: a budget that only bf16-true fits widens the space to it (it trades
    # precision for memory and is searched only then), so only one space compares.
    # The default budget: spaces this small are enumerated, so each plan is its space's best.
    kw = dict(device="cpu", global_batch=4, probe_top=0, precisions=["fp32"])
    small = search(_task(), vram="200MB", **kw)  # type: ignore[arg-type]
    large = search(_task(), vram="1GB", **kw)  # type: ignore[arg-type]
    assert small.best.predicted.peak_bytes <= 200e6 * 0.9
    assert (large.best.predicted.samples_per_s or 0) >= (small.best.predicted.samples_per_s or 0)


def test_the_note_counts_what_was_pruned_and_left() -> None:
    cov = Coverage(configurations=180, estimated=24, pruned=36, enumerated=False, trials_for_all=190)
    assert cov.unanswered == 120
    assert cov.note() == ("estimated 24 of 180 configurations (13%, 36 more known not to fit without one); 120 were "
                          "not estimated, so a faster one may exist: --trials 190 (trials=) estimates them all")
    assert Coverage(configurations=10, estimated=4, pruned=6, enumerated=True, trials_for_all=10).note() is None
