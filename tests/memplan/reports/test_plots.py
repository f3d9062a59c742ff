"""Pictures and the predicted snapshot: the timeline and snapshot carry the estimate's peak,
PyTorch's own memory tools read the snapshot, the plan plot marks what the search did."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch.cuda._memory_viz as memory_viz

from estimators import ConfigError, Estimator, TrainConfig, load_task
from estimators.estimator._snapshot import snapshot_peak, to_snapshot, write_snapshot
from estimators.estimator._timeline import predicted_timeline
from estimators.tracing._recorder import Category
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g))
"""

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def closing():
    """Estimators made by a test, closed after it: a slow trace (a loaded machine) starts a
    forked trace worker, which must not outlive the test."""
    made: list[Estimator] = []

    def make(*args, **kwargs) -> Estimator:
        made.append(Estimator(*args, **kwargs))
        return made[-1]
    yield make
    for estimator in made:
        estimator.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "mlp.py"
    path.write_text(MODEL)
    return load_task(str(path))


@pytest.mark.parametrize("device,gpu", [("cuda", "A100-80GB"), ("cpu", None)])
def test_timeline_and_snapshot_carry_the_estimates_peak(task, tmp_path, device, gpu, closing):
    estimator = closing(task, device=device, gpu=gpu)
    config = TrainConfig(micro_batch_size=64, grad_accum_steps=2)
    est = estimator.estimate(config, exact=True)
    timeline = predicted_timeline(estimator, config)
    assert timeline.peak_bytes == est.peak_allocated_bytes
    # The categories add up to the total at every event, and at the peak to the breakdown.
    stacked = timeline.by_category()
    assert np.array_equal(stacked.sum(axis=1), timeline.running)
    at_peak = {Category(i).label: int(v) for i, v in enumerate(stacked[timeline.peak_index])}
    assert at_peak == dict(est.breakdown)
    assert [label for label, _s, _e in timeline.phase_spans()][:3] == ["setup", "step 1 micro 1 forward",
                                                                       "step 1 micro 1 backward"]

    path = write_snapshot(timeline, tmp_path / "snap.pickle")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    # PyTorch's own readers parse it: segsum checks that every segment's blocks add up.
    assert "segments: " in memory_viz.segsum(snap)
    assert memory_viz.trace(snap).startswith("Device 0")
    assert "active_allocated" in memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "stream_0" in memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert "base64" in memory_viz.trace_plot(snap)
    assert snapshot_peak(snap) == est.peak_allocated_bytes
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert {e["category"] for e in allocs} >= {"params", "activations", "gradients", "optimizer"}
    assert all(e["addr"] % 512 == 0 for e in allocs)
    if device == "cuda":
        # Nothing frees a segment without a budget: the final state is the peak reserved.
        assert sum(s["total_size"] for s in snap["segments"]) == est.peak_reserved_bytes
        assert all(e["size"] % 512 == 0 for e in allocs)


def test_snapshot_peak_counts_blocks_alive_before_the_trace_as_the_viewer_does():
    snap = {
        "segments": [{"device": 0, "address": 0, "total_size": 3000, "stream": 0, "blocks": [
            {"size": 1000, "requested_size": 1000, "state": "active_allocated"},  # never traced: alive from the start
            {"size": 2000, "requested_size": 0, "state": "inactive"},
        ]}],
        "device_traces": [[
            {"action": "alloc", "addr": 1000, "size": 500},
            {"action": "alloc", "addr": 1500, "size": 700},
            {"action": "free_requested", "addr": 1000, "size": 500},
            {"action": "free_completed", "addr": 1000, "size": 500},
            {"action": "free_completed", "addr": 1500, "size": 700},
        ]],
    }
    assert snapshot_peak(snap) == 1000 + 500 + 700


def test_snapshot_addresses_never_overlap_while_alive(task, closing):
    estimator = closing(task, device="cuda", gpu="A100-80GB")
    snap = to_snapshot(predicted_timeline(estimator, TrainConfig(micro_batch_size=16)))
    live: dict[int, int] = {}
    allocs = most_live = 0
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            for addr, size in live.items():
                assert e["addr"] + e["size"] <= addr or addr + size <= e["addr"]
            live[e["addr"]] = e["size"]
            allocs += 1
            most_live = max(most_live, len(live))
        elif e["action"] == "free_completed":
            del live[e["addr"]]
    # A training step's trace: many blocks, many alive at once (else nothing was compared).
    assert allocs > 50 and most_live > 10, (allocs, most_live)


def _not_blank(path) -> None:
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.05  # drawn on, not a blank canvas


def test_estimate_cli_writes_the_plot_and_the_snapshot(task, tmp_path, capsys):
    plot, snap = tmp_path / "timeline.png", tmp_path / "out.pickle"
    code = main(["estimate", task.source_path, "-b", "32", "--gpu", "A100-80GB", "--vram", "2GB",
                 "--plot", str(plot), "--snapshot", str(snap), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "timeline written" in err and "snapshot written" in err
    import json
    peak = json.loads(out)["peak_allocated_bytes"]
    with open(snap, "rb") as f:
        assert snapshot_peak(pickle.load(f)) == peak
    _not_blank(plot)


def test_missing_matplotlib_is_one_line_naming_the_extra(task, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    from memplan.reports._plots import require_matplotlib
    with pytest.raises(ConfigError, match=r"pip install 'memplan\[plots\]'"):
        require_matplotlib()
    code = main(["estimate", task.source_path, "-b", "4", "--plot", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert code == 2 and "memplan[plots]" in err and len(err.strip().splitlines()) == 1


def test_plan_plot_marks_infeasible_chosen_and_the_front(task, tmp_path, closing):
    from memplan.planning import search
    from memplan.planning._plot import PlanPoint, pareto_front

    estimator = closing(task, device="cpu")
    small = estimator.estimate(TrainConfig(micro_batch_size=8, grad_accum_steps=32), exact=True).peak_allocated_bytes
    big = estimator.estimate(TrainConfig(micro_batch_size=256), exact=True).peak_allocated_bytes
    # A budget between the smallest and the largest configuration: some are infeasible.
    plot = tmp_path / "plan.png"
    plan = search(task, vram=int((small + big) / 2 / 0.9), global_batch=256, probe_top=0,
                  storage=f"sqlite:///{tmp_path}/s.db", plot=plot, trials=40)
    _not_blank(plot)
    import optuna
    study = optuna.load_study(study_name=optuna.get_all_study_names(f"sqlite:///{tmp_path}/s.db")[0],
                              storage=f"sqlite:///{tmp_path}/s.db")
    points = study.user_attrs["plan_points"]
    assert study.user_attrs["plan_plot_png"].startswith("iVBOR")  # base64 of a PNG
    statuses = {p["status"] for p in points}
    assert {"feasible", "infeasible"} <= statuses
    chosen = [p for p in points if p["chosen"]]
    # On the front, or tied in speed with a point of it: at equal predicted speed the search
    # ranks the simpler configuration first (fewer checkpoints), which may hold more memory.
    assert len(chosen) == 1
    assert chosen[0]["pareto"] or any(p["pareto"] and p["samples_per_s"] == pytest.approx(chosen[0]["samples_per_s"])
                                      for p in points)
    assert not any(p["status"] == "feasible" and p["samples_per_s"] > chosen[0]["samples_per_s"] * (1 + 1e-9)
                   for p in points)
    assert chosen[0]["samples_per_s"] == pytest.approx(plan.best.samples_per_s)
    limit = plan.budget_bytes * (1 - plan.margin)
    assert all(p["peak_bytes"] > limit for p in points if p["status"] == "infeasible")
    # The front: feasible, and no feasible point is both smaller and faster than one of it.
    front = pareto_front([PlanPoint("a", 10, 1.0, "feasible"), PlanPoint("b", 20, 3.0, "feasible"),
                          PlanPoint("c", 15, 0.5, "feasible"), PlanPoint("d", 5, 9.0, "infeasible"),
                          PlanPoint("e", 30, 2.0, "feasible")])
    assert [p.label for p in front] == ["a", "b"]
