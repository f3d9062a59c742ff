"""Items of varying shape: the estimate is made for the batch that will come.

The truth is the estimator benchmark's: the CPU allocator's peak over real steps
(``measure_cpu_peak``) on the batch the estimate names, and over a whole real epoch
(``measure_epoch_peak``), which the estimate must never fall below.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from estimators import ConfigError, Estimator, Task, TrainConfig, estimate, load_task
from estimators.probing._measure import measure_cpu_peak, measure_epoch_peak
from estimators.task import _shapes

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "benchmarks" / "models"


def rel(pred: int, ref: int) -> float:
    return abs(pred - ref) / ref


SCALAR_SLACK = 64
"""Bytes the trace cannot see, fixed-shape data alike: CPU kernels wrap a Python scalar
(``scores / sqrt(d)``) in an 8-byte tensor below the dispatcher (the same model on a
TensorDataset of 384-token rows is 16 B under its real peak too)."""


def not_below(pred: int, real: int) -> bool:
    return pred >= real - SCALAR_SLACK


@pytest.fixture(scope="module")
def text_task() -> Task:
    return load_task(MODELS / "varlen_text.py")


@pytest.fixture(scope="module")
def image_task() -> Task:
    return load_task(MODELS / "multisize_images.py")


def test_padded_text_is_planned_for_its_longest_items(text_task):
    profile = text_task.shapes()
    assert profile.varying and profile.source == "scan" and profile.coverage == "all 512 items scanned"
    config = TrainConfig(micro_batch_size=16)
    est = Estimator(text_task, device="cpu").estimate(config)
    shapes = est.batch_shapes
    assert shapes["policy"] == "max" and shapes["padded"] == [384, 384]
    assert any("worst batch the loader can form" in n for n in est.notes)
    worst = measure_cpu_peak(text_task, config).peak_bytes
    assert rel(est.peak_allocated_bytes, worst) < 0.01
    # What a plan from the first items would have met: a small fraction of the worst.
    first = text_task.collate([text_task.dataset()[i] for i in range(16)])
    assert first[0].shape[1] <= 32
    epoch, steps = measure_epoch_peak(text_task, config)
    assert steps == 32 and not_below(est.peak_allocated_bytes, epoch.peak_bytes)


def test_multi_size_images_pad_a_tall_and_a_wide_image_together(image_task):
    profile = image_task.shapes()
    # No single image is 64 x 64, yet two of them padded together are.
    assert not ((profile.sizes[:, 1] == 64) & (profile.sizes[:, 2] == 64)).any()
    est = Estimator(image_task, device="cpu")
    config = TrainConfig(micro_batch_size=16)
    e16 = est.estimate(config)
    assert e16.batch_shapes["padded"] == [64, 64] and len(e16.batch_shapes["items"]) == 2
    assert rel(e16.peak_allocated_bytes, measure_cpu_peak(image_task, config).peak_bytes) < 0.01
    # One image alone: the largest single one (64 x 40 or 40 x 64).
    e1 = est.estimate(TrainConfig(micro_batch_size=1))
    assert sorted(e1.batch_shapes["padded"]) == [40, 64]
    assert rel(e1.peak_allocated_bytes, measure_cpu_peak(image_task, TrainConfig(micro_batch_size=1)).peak_bytes) < 0.01
    epoch, _ = measure_epoch_peak(image_task, config)
    assert not_below(e16.peak_allocated_bytes, epoch.peak_bytes)


def test_routing_model_states_the_batches_it_took_the_worst_of():
    task = load_task(MODELS / "moe_dynamic.py")
    full = task.train_data
    task = dataclasses.replace(task, train_data=lambda: Subset(full(), range(256)))
    config = TrainConfig(micro_batch_size=8)
    est = Estimator(task, device="cpu").estimate(config)
    assert est.method == "measured-cpu"
    shapes = est.batch_shapes
    assert shapes["draws"] == 8  # 4 runs of 2 steps
    assert any("over 8 real batches, every allocation at the largest" in n for n in est.notes)
    # The fullest real batch, predicted, against a real run on that very batch.
    torch.manual_seed(0)  # the runs' initial weights
    named = measure_cpu_peak(task, config, batch_offset=shapes["batch_offset"]).peak_bytes
    assert rel(shapes["fullest_batch_peak_bytes"], named) < 0.01
    # The estimate bounds every allocation of the runs: above a whole epoch, whose training
    # moves the router, yet within a few percent of the fullest batch.
    epoch, steps = measure_epoch_peak(task, config)
    assert steps == 32 and not_below(est.peak_allocated_bytes, epoch.peak_bytes)
    assert est.peak_allocated_bytes <= 1.05 * named


def test_distribution_and_p99_policy(text_task):
    config = TrainConfig(micro_batch_size=4)
    est = Estimator(text_task, device="cpu").shape_distribution(config)
    peaks = {k: est.batch_shapes[k]["peak_bytes"] for k in ("median", "p99", "max")}
    assert peaks["median"] < peaks["p99"] <= peaks["max"] == est.peak_allocated_bytes
    assert est.batch_shapes["median"]["padded"][0] < est.batch_shapes["p99"]["padded"][0] <= 384
    p99 = Estimator(text_task, device="cpu", shape_policy="p99").estimate(config)
    assert p99.peak_allocated_bytes == peaks["p99"] and p99.batch_shapes["policy"] == "p99"
    # The p99 batch is one an epoch of random batches really forms.
    torch.manual_seed(0)
    real = measure_cpu_peak(text_task.with_shape_policy("p99"), config).peak_bytes
    assert rel(p99.peak_allocated_bytes, real) < 0.01
    with pytest.raises(ConfigError, match="shape policy"):
        text_task.with_shape_policy("p50")


def test_fixed_shape_data_is_not_scanned_and_estimates_as_before():
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    task = Task(name="fixed", build_model=lambda: torch.nn.Linear(8, 3), train_data=lambda: TensorDataset(x, y))
    est = Estimator(task, device="cpu").shape_distribution(TrainConfig(micro_batch_size=8))
    assert task.shapes().source == "TensorDataset" and not task.shapes().varying
    assert est.batch_shapes is None and not any("batch shapes" in n for n in est.notes)


class _Counting(Dataset):
    """Items of varying length that count their reads (and a length column, when asked)."""

    def __init__(self, n: int, *, column: bool = False) -> None:
        self.lengths = [4 + (i * 7) % 29 for i in range(n)]
        self.reads = 0
        if column:
            self.column_names = ["input_ids", "length"]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, str):
            return list(self.lengths)
        self.reads += 1
        return torch.ones(self.lengths[i], dtype=torch.long), torch.tensor(0)


def _pad(items):
    T = max(len(x) for x, _ in items)
    out = torch.zeros(len(items), T, dtype=torch.long)
    for i, (x, _) in enumerate(items):
        out[i, : len(x)] = x
    return out, torch.stack([y for _, y in items])


def test_hook_and_length_column_read_only_the_extreme_items():
    for column in (False, True):
        data = _Counting(1000, column=column)
        hook = None if column else (lambda d: d.lengths)
        task = Task(name="t", build_model=lambda: torch.nn.Linear(1, 1), train_data=lambda: data,
                    collate=_pad, item_sizes=hook)
        profile = task.shapes()
        assert profile.source == ("the 'length' column" if column else "item_sizes()")
        assert profile.varying and data.reads <= 4  # the collate check on the extreme items
        assert task.planned(8).padded == (32,)


def test_a_large_dataset_is_scanned_on_a_stated_sample(monkeypatch):
    monkeypatch.setattr(_shapes, "SCAN_LIMIT", 100)
    data = _Counting(1000)
    task = Task(name="t", build_model=lambda: torch.nn.Linear(1, 1), train_data=lambda: data, collate=_pad)
    profile = task.shapes()
    assert len(profile.indices) == 100 and "random sample of 100 of 1,000 items (seed 0)" in profile.coverage
    assert data.reads <= 100 + _shapes.PROBE_ITEMS + 1 + 4


def test_collate_checked_on_the_extreme_items():
    data = _Counting(200)

    def fixed_pad(items):  # pads every batch to 40: one shape for all batches
        out = torch.zeros(len(items), 40, dtype=torch.long)
        for i, (x, _) in enumerate(items):
            out[i, : len(x)] = x
        return out, torch.stack([y for _, y in items])

    def packed(items):  # concatenates: the batch grows with the items' total length
        return torch.cat([x for x, _ in items]).unsqueeze(0), torch.stack([y for _, y in items])

    t_fixed = Task(name="t", build_model=lambda: torch.nn.Linear(1, 1), train_data=lambda: data, collate=fixed_pad)
    assert not t_fixed.shapes().varying and t_fixed.planned(8) is None
    t_packed = Task(name="t", build_model=lambda: torch.nn.Linear(1, 1), train_data=lambda: data, collate=packed)
    assert t_packed.shapes().varying and not t_packed.shapes().collate_pads
    fake = t_packed.fake_batch(4)
    # The four longest items packed: the planned items, collated.
    assert tuple(fake[0].shape) == (1, sum(sorted(data.lengths)[-4:]))


def test_estimate_function_and_cli_show_the_distribution(capsys):
    from memplan.cli import main
    path = str(MODELS / "varlen_text.py")
    est = estimate(path, batch_size=2, shape_policy="p99")
    assert {"median", "p99", "max"} <= set(est.batch_shapes) and est.batch_shapes["policy"] == "p99"
    assert main(["estimate", path, "-b", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_shapes"]["max"]["padded"] == [384, 384]
    assert main(["estimate", path, "-b", "2"]) == 0
    table = capsys.readouterr().out
    assert "peak at the median batch" in table and "peak at the max batch (sizes 384, 384)" in table


def test_trainer_records_the_largest_batch_and_its_peak(tmp_path, text_task):
    from estimators.runtime._guard import MemoryGuard
    from memplan import TrainOptions, train
    config = TrainConfig(micro_batch_size=8, grad_accum_steps=2)
    small = dataclasses.replace(text_task, train_data=lambda: Subset(text_task.dataset(), range(128)), _cache={})
    # No DataLoader worker processes (the batches are recorded in the training process).
    result = train(small, config, TrainOptions(max_steps=8, out_dir=tmp_path, progress=False, num_workers=0),
                   memory_guard=MemoryGuard(budget_bytes=2**34))
    largest = result.summary["largest_batch"]
    assert largest["shapes"][0][0] == 8 and largest["peak_memory_bytes"] > 0
    lengths = [len(small.dataset()[i][0]) for i in range(128)]
    assert largest["shapes"][0][1] <= max(lengths)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "largest_batch" for r in records)


def test_search_chooses_length_grouped_batching_for_padded_text(text_task):
    from memplan import search
    plan = search(text_task, vram="4GB", device="cpu", probe_top=0, trials=200, storage="sqlite:///:memory:")
    assert plan.config.length_grouped
    twin = next(e for e in plan.entries if e.config == plan.config.replace(length_grouped=False))
    # The same memory (the worst batch is the same), more samples per second.
    assert twin.peak_bytes == plan.best.peak_bytes and plan.best.samples_per_s > twin.samples_per_s
    assert "length-grouped" in plan.config.describe()


def test_length_grouped_order_pads_less_and_resumes_exactly(tmp_path, text_task):
    from memplan import TrainOptions, train
    from memplan.training._data import _EpochBatches
    small = dataclasses.replace(text_task, train_data=lambda: Subset(text_task.dataset(), range(128)), _cache={})
    lengths = torch.tensor([len(small.dataset()[i][0]) for i in range(128)])
    padded = {}
    for grouped in (False, True):
        sampler = _EpochBatches(128, 8, 0, global_batch=16)
        sampler.sizes = small.shapes().sizes if grouped else None
        windows = sampler.windows(0, 0)
        micro = [m for w in windows for m in w.micro_indices]
        assert sorted(i for m in micro for i in m) == list(range(128))  # every item once
        padded[grouped] = sum(int(lengths[m].max()) * len(m) for m in micro)
        if grouped:
            assert int(lengths[windows[0].micro_indices[0]].max()) == int(lengths.max())  # worst batch first
    assert padded[True] < 0.8 * padded[False]

    config = TrainConfig(micro_batch_size=8, grad_accum_steps=2, length_grouped=True)
    # No DataLoader worker processes: the order is the batch sampler's, which runs in the
    # training process either way (and a worker forked from this test process, after the
    # module's larger tests, costs seconds to start and stop).
    common = dict(schedule="constant", warmup_steps=0, seed=3, progress=False, num_workers=0)
    train(small, config, TrainOptions(max_steps=6, out_dir=tmp_path / "full", **common))
    train(small, config, TrainOptions(max_steps=3, out_dir=tmp_path / "part", **common))
    resumed = train(small, config, TrainOptions(max_steps=6, out_dir=tmp_path / "part", resume=True, **common))
    assert resumed.summary["resumed_from_step"] == 3
    a, b = torch.load(tmp_path / "part" / "model.pt"), torch.load(tmp_path / "full" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="length_grouped"):
        train(small, config.replace(length_grouped=False),
              TrainOptions(max_steps=8, out_dir=tmp_path / "part", resume=True, **common))
