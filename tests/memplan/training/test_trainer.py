"""The built-in trainer: accumulation, exact resume, signals, NaN handling, schedules, EMA,
early stopping and bf16 — on tiny models, CPU only, num_workers=0."""

from __future__ import annotations

import json
import math
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from estimators import ConfigError, Task, TrainConfig, TrainingError, load_task
from memplan.training._schedules import SCHEDULES, make_schedule
from memplan.training import Trainer, TrainOptions, epoch_permutation, train
from memplan.training._checkpoint_io import load_checkpoint, save_checkpoint

# estimators caches datasets by id(task); keep every task alive so that no id is reused.
_TASKS: list[Task] = []

MODEL_FILE = '''
import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

settings = {"lr": 0.02}

def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)

def model():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(DROPOUT), nn.Linear(16, 2))

def train_data():
    return _data(N_TRAIN, 1)

def val_data():
    return _data(16, 2)
'''

# A loss that misbehaves on cue (environment variables, read at call time): sends SIGTERM to
# this process at call KILL_AT_CALL, returns NaN at call NAN_AT_CALL or from NAN_FROM_CALL on.
CUSTOM_LOSS = '''
_calls = [0]

def loss(model, batch):
    _calls[0] += 1
    n = _calls[0]
    x, y = batch
    out = F.cross_entropy(model(x), y)
    if n == int(os.environ.get("KILL_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
    if n == int(os.environ.get("NAN_AT_CALL", "0")) or 0 < int(os.environ.get("NAN_FROM_CALL", "0")) <= n:
        out = out * float("nan")
    return out
'''


pytestmark = pytest.mark.usefixtures("one_thread")


def model_file_task(tmp_path: Path, *, n_train: int = 40, dropout: float = 0.0, custom_loss: bool = False) -> Task:
    text = MODEL_FILE.replace("N_TRAIN", str(n_train)).replace("DROPOUT", str(dropout))
    if custom_loss:
        text += CUSTOM_LOSS
    path = tmp_path / f"tiny_{len(_TASKS)}.py"
    path.write_text(textwrap.dedent(text))
    task = load_task(path)
    _TASKS.append(task)
    return task


def opts(tmp_path: Path, name: str, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    return TrainOptions(out_dir=tmp_path / name, **kw)


def steps_of(out_dir: Path) -> list[dict[str, Any]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "step"]


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0.0, msg=k)


# -- 1. gradient accumulation --------------------------------------------------------------------

class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it is stepped with."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def linear_task(x: torch.Tensor, y: torch.Tensor, recorder: list[RecordingSGD]) -> Task:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(x.shape[1], 8), nn.Tanh(), nn.Linear(8, 3))

    def make_opt(params: Any) -> torch.optim.Optimizer:
        recorder.append(RecordingSGD(params, lr=0.1))
        return recorder[-1]

    task = Task(name="linear", build_model=build, build_optimizer=make_opt,
                train_data=lambda: TensorDataset(x, y))
    _TASKS.append(task)
    return task


def test_accumulated_gradients_equal_the_full_batch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    rec: list[RecordingSGD] = []
    task = linear_task(x, y, rec)
    train(task, TrainConfig(micro_batch_size=2, grad_accum_steps=4),
          opts(tmp_path, "acc", max_steps=1, grad_clip=None, schedule="constant"))

    ref = task.build_model()
    F.cross_entropy(ref(x), y).backward()
    (got,) = rec[0].seen
    for a, p in zip(got, ref.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=0.0)


def test_short_last_window_equals_the_full_batch_on_its_items(tmp_path: Path) -> None:
    # 7 items, micro 2, accum 2: windows of 4 and 3 items (micro-batches 2+2 and 2+1).
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 5, generator=g), torch.randint(0, 3, (7,), generator=g)
    rec: list[RecordingSGD] = []
    task = linear_task(x, y, rec)
    o = opts(tmp_path, "short", epochs=1, grad_clip=None, schedule="constant", seed=3)
    result = train(task, TrainConfig(micro_batch_size=2, grad_accum_steps=2), o)
    assert result.steps == 2 and result.epochs_completed == 1

    perm = epoch_permutation(7, 3, 0)
    ref = task.build_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k, items in enumerate((perm[:4], perm[4:])):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x[items]), y[items]).backward()
        for a, p in zip(rec[0].seen[k], ref.parameters()):
            torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=0.0)
        ref_opt.step()
    final = torch.load(tmp_path / "short" / "model.pt")
    assert_same_state(final, ref.state_dict(), atol=1e-6)


# -- 2./3. exact resume, signals ----------------------------------------------------------------

def test_resume_after_max_steps_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)  # 40 items: 5 windows per epoch
    common = dict(schedule="constant", warmup_steps=3, ema_decay=0.9, seed=5)
    task = model_file_task(tmp_path, dropout=0.2)
    full = train(task, config, opts(tmp_path, "full", max_steps=12, **common))

    part = train(model_file_task(tmp_path, dropout=0.2), config, opts(tmp_path, "part", max_steps=7, **common))
    assert part.steps == 7 and not part.interrupted
    assert load_checkpoint(tmp_path / "part" / "checkpoint.pt")["epoch_sample_offset"] == 16  # mid-epoch
    resumed = train(model_file_task(tmp_path, dropout=0.2), config,
                    opts(tmp_path, "part", max_steps=12, resume=True, **common))
    assert resumed.steps == full.steps == 12
    assert resumed.summary["resumed_from_step"] == 7
    assert_same_state(torch.load(tmp_path / "part" / "model.pt"), torch.load(tmp_path / "full" / "model.pt"))
    ckpt_a = load_checkpoint(tmp_path / "part" / "checkpoint.pt")
    ckpt_b = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert_same_state(ckpt_a["model"], ckpt_b["model"])


def test_sigterm_checkpoints_and_resume_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    common = dict(epochs=3, warmup_steps=2, ema_decay=0.9, seed=1)  # cosine over 15 steps
    full = train(model_file_task(tmp_path, dropout=0.2, custom_loss=True), config, opts(tmp_path, "full", **common))
    assert full.steps == 15 and not full.interrupted

    before = signal.getsignal(signal.SIGTERM)
    # Calls 1-10 are steps 1-5, 11-14 the evaluation after epoch 1, 15-16 step 6, 17 step 7.
    monkeypatch.setenv("KILL_AT_CALL", "17")
    stopped = train(model_file_task(tmp_path, dropout=0.2, custom_loss=True), config, opts(tmp_path, "cut", **common))
    assert stopped.interrupted and stopped.steps == 7
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored

    # 3. a loadable checkpoint, with the plain torch.load (weights_only by default)
    ckpt = torch.load(tmp_path / "cut" / "checkpoint.pt")
    assert ckpt["step"] == 7 and ckpt["epoch"] == 1 and ckpt["epoch_sample_offset"] == 16
    assert "model" in ckpt and "optimizer" in ckpt and ckpt["ema"] is not None

    monkeypatch.delenv("KILL_AT_CALL")
    resumed = train(model_file_task(tmp_path, dropout=0.2, custom_loss=True), config,
                    opts(tmp_path, "cut", resume=True, **common))
    assert resumed.steps == 15 and not resumed.interrupted
    assert_same_state(torch.load(tmp_path / "cut" / "model.pt"), torch.load(tmp_path / "full" / "model.pt"))
    assert resumed.best_metric == full.best_metric


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_checkpoint_costs_one_interval_not_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from memplan.training._checkpoint_io import previous_path
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    common = dict(schedule="constant", seed=5, checkpoint_every=2)
    full = train(model_file_task(tmp_path), config, opts(tmp_path, "full", max_steps=12, **common))
    train(model_file_task(tmp_path), config, opts(tmp_path, "part", max_steps=7, **common))
    latest = tmp_path / "part" / "checkpoint.pt"
    assert load_checkpoint(latest)["step"] == 7 and load_checkpoint(previous_path(latest))["step"] == 6
    _cut_in_half(latest)
    with caplog.at_level("WARNING", logger="memplan.trainer"):
        resumed = train(model_file_task(tmp_path), config, opts(tmp_path, "part", max_steps=12, resume=True, **common))
    assert resumed.summary["resumed_from_step"] == 6
    assert any("checkpoint.pt is damaged" in r.getMessage() and "checkpoint.previous.pt" in r.getMessage()
               for r in caplog.records)
    assert resumed.steps == full.steps == 12
    assert_same_state(torch.load(tmp_path / "part" / "model.pt"), torch.load(tmp_path / "full" / "model.pt"))


def test_damaged_checkpoints_are_one_line_errors_naming_the_file(tmp_path: Path) -> None:
    from memplan.training._checkpoint_io import DamagedCheckpointError, previous_path
    task = model_file_task(tmp_path)
    config = TrainConfig(micro_batch_size=4)
    train(task, config, opts(tmp_path, "d", max_steps=3, checkpoint_every=1))
    latest = tmp_path / "d" / "checkpoint.pt"
    _cut_in_half(latest)
    _cut_in_half(previous_path(latest))
    with pytest.raises(DamagedCheckpointError) as info:
        train(task, config, opts(tmp_path, "d", max_steps=4, resume=True))
    message = str(info.value)
    assert "\n" not in message and str(latest) in message and "damaged" in message and "delete both" in message
    # A readable file that is not a memplan checkpoint: named, in one line, not a KeyError.
    previous_path(latest).unlink()
    save_checkpoint({"step": 3}, latest)
    with pytest.raises(DamagedCheckpointError) as info:
        train(task, config, opts(tmp_path, "d", max_steps=4, resume=True))
    assert str(latest) in str(info.value) and "lacks 'config'" in str(info.value)


def test_resume_refuses_another_global_batch(tmp_path: Path) -> None:
    task = model_file_task(tmp_path)
    train(task, TrainConfig(micro_batch_size=4), opts(tmp_path, "r", max_steps=2))
    with pytest.raises(ConfigError, match="global batch"):
        train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, "r", max_steps=4, resume=True))
    # Same global batch, other micro-batch size: allowed (what OOM recovery needs).
    result = train(task, TrainConfig(micro_batch_size=2, grad_accum_steps=2), opts(tmp_path, "r", max_steps=4, resume=True))
    assert result.steps == 4


def test_a_window_can_be_replayed_with_another_micro_batch_size(tmp_path: Path) -> None:
    # What OOM recovery will do: run the same window again, re-cut, with the same global batch.
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    o = opts(tmp_path, "plain", max_steps=1, grad_clip=None, schedule="constant")
    train(linear_task(x, y, []), config, o)

    trainer = Trainer(linear_task(x, y, []), config, o)
    trainer._setup_data()
    trainer._setup()
    window, _ = next(trainer.data.windows(0, 0))
    smaller = config.replace(micro_batch_size=1, grad_accum_steps=8)
    window = window.recut(smaller.micro_batch_size)
    assert [len(m) for m in window.micro_indices] == [1] * 8
    outcome = trainer.window_step.run(window, trainer.data.collate_window(window), smaller, step=1)
    assert outcome.applied
    assert_same_state(trainer.model.state_dict(), torch.load(tmp_path / "plain" / "model.pt"), atol=1e-6)


# -- 4. NaN / inf losses -------------------------------------------------------------------------

def test_a_single_nan_loss_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAN_AT_CALL", "3")
    task = model_file_task(tmp_path, custom_loss=True)
    result = train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, "nan1", max_steps=5))
    assert result.steps == 5 and result.skipped_steps == 1
    records = steps_of(tmp_path / "nan1")
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert records[2]["loss"] == "nan"
    final = torch.load(tmp_path / "nan1" / "model.pt")
    assert all(torch.isfinite(v).all() for v in final.values())


def test_repeated_nan_losses_stop_with_the_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAN_FROM_CALL", "7")  # one micro-batch per step: steps 7, 8, 9 are NaN
    task = model_file_task(tmp_path, custom_loss=True)
    out = tmp_path / "nan3"
    with pytest.raises(TrainingError) as info:
        train(task, TrainConfig(micro_batch_size=4), opts(tmp_path, "nan3", max_steps=20, checkpoint_every=2))
    message = str(info.value)
    assert "loss was NaN/inf for 3 consecutive steps at step 9" in message
    # An fp32 run is not told to leave fp16; it is pointed at its model and data.
    assert "fp16" not in message and "check the model's outputs and the data" in message
    assert str(out / "checkpoint.pt") in message
    ckpt = torch.load(out / "checkpoint.pt")
    assert ckpt["step"] == 6  # the checkpoint due at step 8 (inside the NaN streak) was not written
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_run_whose_every_step_was_nan_fails_with_the_nan_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fewer steps than the NaN limit, every one of them NaN: not a "done" run.
    monkeypatch.setenv("NAN_FROM_CALL", "1")
    task = model_file_task(tmp_path, custom_loss=True)
    with pytest.raises(TrainingError) as info:
        train(task, TrainConfig(micro_batch_size=4), opts(tmp_path, "allnan", max_steps=2, max_nonfinite=5))
    message = str(info.value)
    assert "loss was NaN/inf for 2 consecutive steps at step 2" in message and "fp16" not in message
    assert not (tmp_path / "allnan" / "model.pt").exists()


def test_the_nan_message_suggests_what_fits_the_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAN_FROM_CALL", "1")
    task = model_file_task(tmp_path, custom_loss=True)
    with pytest.raises(TrainingError) as info:
        train(task, TrainConfig(micro_batch_size=4, precision="bf16-mixed"), opts(tmp_path, "bf16nan", max_steps=3))
    assert "or try fp32" in str(info.value) and "fp16" not in str(info.value)


# -- 5. schedules ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_step_once_per_optimizer_step(tmp_path: Path, name: str) -> None:
    task = model_file_task(tmp_path, n_train=80)
    required = {"multistep": {"milestones": (3,)}, "exponential": {"gamma": 0.9},
                "cosine_restarts": {"t_0": 4}}.get(name, {})
    trainer = Trainer(task, TrainConfig(micro_batch_size=2, grad_accum_steps=4),
                      opts(tmp_path, name, max_steps=10, lr=0.1, warmup_steps=3, schedule=name, eval_every=2,
                           **required))
    trainer.run()
    assert trainer.schedule.last_epoch == 10
    lrs = [r["lr"] for r in steps_of(tmp_path / name)]
    assert len(lrs) == 10
    assert lrs[0] < 0.1
    assert lrs[3] == pytest.approx(0.1)  # the 4th step is the first after 3 warm-up steps
    if name in ("cosine", "onecycle"):
        assert lrs[-1] < lrs[3]


def test_plateau_reduces_the_lr_when_the_metric_stalls() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    s = make_schedule("plateau", opt, patience=1, factor=0.5)
    for metric in (1.0, 0.9, 0.95, 0.95):
        s.observe(metric)
    assert s.get_last_lr() == [0.5]
    with pytest.raises(ConfigError, match="takes no argument"):
        make_schedule("cosine", opt, total_steps=3, gamma=0.1)


# -- 6. EMA, early stopping --------------------------------------------------------------------

def test_ema_weights_are_written(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    task = linear_task(x, y, [])
    train(task, TrainConfig(micro_batch_size=8),
          opts(tmp_path, "ema", max_steps=1, ema_decay=0.5, grad_clip=None, schedule="constant"))
    w0 = task.build_model().state_dict()
    w1 = torch.load(tmp_path / "ema" / "checkpoint.pt")["model"]
    written = torch.load(tmp_path / "ema" / "model.pt")
    for k in w0:
        assert not torch.equal(w0[k], w1[k])
        torch.testing.assert_close(written[k], 0.5 * (w0[k] + w1[k]), atol=1e-7, rtol=0.0)


def flipped_val_task() -> Task:
    """Validation labels are the opposite of the training labels: every step that fits the
    training data makes the validation loss worse, so the first evaluation is the best."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 2)

    task = Task(name="flipped", build_model=build, train_data=lambda: TensorDataset(x, y),
                val_data=lambda: TensorDataset(x, 1 - y), settings={"lr": 0.05})
    _TASKS.append(task)
    return task


def test_early_stopping_restores_the_best_weights(tmp_path: Path) -> None:
    config = TrainConfig(micro_batch_size=8)
    common = dict(schedule="constant", grad_clip=None, eval_every=1)
    result = train(flipped_val_task(), config,
                   opts(tmp_path, "es", max_steps=50, early_stopping_patience=2, **common))
    assert result.steps == 3 and result.summary["stopped_early"]
    assert result.summary["best_step"] == 1
    evals = [json.loads(l) for l in (tmp_path / "es" / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val_loss"] for r in evals if r["type"] == "eval"]
    assert result.best_metric == min(val_losses) == val_losses[0]
    assert result.final_metrics["val_loss"] == val_losses[0]

    one = train(flipped_val_task(), config, opts(tmp_path, "one", max_steps=1, **common))
    assert one.steps == 1
    assert_same_state(torch.load(tmp_path / "es" / "model.pt"), torch.load(tmp_path / "one" / "model.pt"))


# -- 7. bf16 -------------------------------------------------------------------------------

def test_bf16_mixed_trains_on_cpu(tmp_path: Path) -> None:
    task = model_file_task(tmp_path, n_train=256)
    result = train(task, TrainConfig(micro_batch_size=16, grad_accum_steps=2, precision="bf16-mixed"),
                   opts(tmp_path, "bf16", epochs=6, lr=0.02, warmup_steps=2))
    losses = [r["loss"] for r in steps_of(tmp_path / "bf16")]
    assert len(losses) == 48
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8
    assert result.final_metrics["val_accuracy"] >= 0.8
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert summary["steps"] == 48 and summary["peak_memory_bytes"] is None  # CPU, no guard
    assert {p.name for p in (tmp_path / "bf16").iterdir()} >= {"model.pt", "checkpoint.pt", "metrics.jsonl", "summary.json"}


# -- smaller pieces --------------------------------------------------------------------------

def test_memory_guard_is_entered_and_its_peak_reported(tmp_path: Path) -> None:
    class Guard:
        entered = exited = False
        peak_bytes = 12345

        def __enter__(self) -> "Guard":
            self.entered = True
            return self

        def __exit__(self, *exc: Any) -> None:
            self.exited = True

    guard = Guard()
    result = train(model_file_task(tmp_path), TrainConfig(micro_batch_size=8),
                   opts(tmp_path, "g", max_steps=2, predicted_peak_bytes=10000), memory_guard=guard)
    assert guard.entered and guard.exited
    assert result.summary["peak_memory_bytes"] == 12345
    assert result.summary["peak_over_predicted"] == pytest.approx(1.2345)


def test_label_smoothing_needs_the_default_loss(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="label_smoothing"):
        Trainer(model_file_task(tmp_path, custom_loss=True), TrainConfig(micro_batch_size=4),
                opts(tmp_path, "ls", label_smoothing=0.1))
    result = train(model_file_task(tmp_path), TrainConfig(micro_batch_size=8),
                   opts(tmp_path, "ls", max_steps=2, label_smoothing=0.1))
    assert math.isfinite(result.final_metrics["train_loss"])


def test_failed_checkpoint_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception):
        save_checkpoint({"step": 2, "bad": lambda: None}, path)  # cannot be pickled
    assert load_checkpoint(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


# -- 9. the metrics log ----------------------------------------------------------------------------
# Step lines are written in batches (not one write and flush per step); however a run ends, and at
# every checkpoint, every line logged so far must be on disk.

def test_metrics_lines_are_on_disk_at_every_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import memplan.training._checkpoints as trainer_module

    on_disk: dict[int, list[int]] = {}
    real_save = trainer_module.save_checkpoint

    def spy(state: Any, path: Any, **kw: Any) -> None:
        if Path(path).name == "checkpoint.pt":
            on_disk[state["step"]] = [r["step"] for r in steps_of(tmp_path / "ck")]
        real_save(state, path, **kw)

    monkeypatch.setattr(trainer_module, "save_checkpoint", spy)
    train(model_file_task(tmp_path), TrainConfig(micro_batch_size=8), opts(tmp_path, "ck", max_steps=6, checkpoint_every=2))
    assert on_disk == {2: [1, 2], 4: [1, 2, 3, 4], 6: [1, 2, 3, 4, 5, 6]}


def test_metrics_log_is_complete_after_a_signal_and_after_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TrainConfig(micro_batch_size=8)  # 40 items: 5 steps an epoch, one loss call a step
    never = dict(max_steps=20, checkpoint_every=100, eval_every=100)  # no checkpoint, no eval in between

    monkeypatch.setenv("KILL_AT_CALL", "4")  # SIGTERM in step 4: the run stops after it
    stopped = train(model_file_task(tmp_path, custom_loss=True), config, opts(tmp_path, "sig", **never))
    assert stopped.interrupted and [r["step"] for r in steps_of(tmp_path / "sig")] == [1, 2, 3, 4]
    monkeypatch.delenv("KILL_AT_CALL")

    monkeypatch.setenv("NAN_FROM_CALL", "3")  # steps 3, 4, 5 NaN: TrainingError after step 5
    with pytest.raises(TrainingError):
        train(model_file_task(tmp_path, custom_loss=True), config, opts(tmp_path, "err", **never))
    records = steps_of(tmp_path / "err")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["loss"] == "nan"

