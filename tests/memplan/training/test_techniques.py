"""The trainer's techniques beyond the basic step: every schedule (and a model file's own
scheduler), early stopping's min_delta, clipping by value/norm/off, the GradScaler's
parameters, the DataLoader settings, memplan.nn's init and DropPath, and the default
optimizer's weight-decay groups. Each option is shown to reach the trainer and take effect,
and each bad value to be a one-line ConfigError naming the option. Tiny models, CPU only."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from estimators import ConfigError, ModelFileError, Task, TrainConfig, load_task
from estimators.runtime._precision import make_grad_scaler
from estimators.task._task import default_optimizer
from memplan.nn import DropPath, init_weights
from memplan.training import Trainer, TrainOptions, epoch_permutation, train
from memplan.training._checkpoint_io import load_checkpoint
from memplan.training._schedules import SCHEDULES, make_schedule

pytestmark = pytest.mark.usefixtures("one_thread")

_TASKS: list[Task] = []  # estimators caches datasets by id(task): keep every task alive


def opts(tmp_path: Path, name: str, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    return TrainOptions(out_dir=tmp_path / name, **kw)


def records(out_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients and each group's momentum it is stepped with."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__(params, lr=lr, momentum=momentum)
        self.grads: list[list[torch.Tensor]] = []
        self.momenta: list[float] = []

    def step(self, closure: Any = None) -> Any:
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        self.momenta.append(float(self.param_groups[0]["momentum"]))
        return super().step(closure)


def tiny_task(n: int = 32, *, scale: float = 1.0, val: str | None = "same", optimizer: Any = None,
              seen: list[int] | None = None, **kw: Any) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g) * scale
    y = (x[:, 0] > 0).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if seen is not None:
            seen.append(int(batch[0].shape[0]))
        return F.cross_entropy(model(batch[0]), batch[1])

    val_data = None
    if val == "same":
        val_data = (lambda: TensorDataset(x, y))
    elif val == "flipped":  # every step that fits the training data makes validation worse
        val_data = (lambda: TensorDataset(x, 1 - y))
    task = Task(name="tiny", build_model=build, train_data=lambda: TensorDataset(x, y), val_data=val_data,
                loss_fn=loss if seen is not None else Task.loss_fn, build_optimizer=optimizer,
                settings={"lr": 0.05}, **kw)
    _TASKS.append(task)
    return task


def lrs_of(out_dir: Path) -> list[float]:
    return [r["lr"] for r in records(out_dir, "step")]


# -- schedules -----------------------------------------------------------------------------------

def test_multistep_and_exponential_reach_the_trainer(tmp_path: Path) -> None:
    common = dict(max_steps=8, lr=0.1, warmup_steps=0, grad_clip=None)
    train(tiny_task(), TrainConfig(micro_batch_size=8),
          opts(tmp_path, "ms", schedule="multistep", milestones=(2, 5), gamma=0.5, **common))
    assert lrs_of(tmp_path / "ms") == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025])
    train(tiny_task(), TrainConfig(micro_batch_size=8), opts(tmp_path, "exp", schedule="exponential", gamma=0.9, **common))
    assert lrs_of(tmp_path / "exp") == pytest.approx([0.1 * 0.9**k for k in range(8)])
    # The warm-up comes first; the shape counts from its end (as SequentialLR would).
    train(tiny_task(), TrainConfig(micro_batch_size=8),
          opts(tmp_path, "msw", schedule="multistep", milestones=(2,), gamma=0.5, **{**common, "warmup_steps": 3}))
    assert lrs_of(tmp_path / "msw") == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.05, 0.05, 0.05])


def test_step_size_reaches_the_trainer(tmp_path: Path) -> None:
    train(tiny_task(), TrainConfig(micro_batch_size=8),
          opts(tmp_path, "st", max_steps=6, lr=0.1, schedule="step", step_size=2, gamma=0.5))
    assert lrs_of(tmp_path / "st") == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])


def test_cosine_restarts_equal_torchs_warm_restarts(tmp_path: Path) -> None:
    train(tiny_task(), TrainConfig(micro_batch_size=8),
          opts(tmp_path, "sgdr", max_steps=20, lr=0.1, schedule="cosine_restarts", t_0=3, t_mult=2, min_lr=0.01))
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    ref = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(ref_opt, T_0=3, T_mult=2, eta_min=0.01)
    expected = []
    for _ in range(20):
        expected.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    assert lrs_of(tmp_path / "sgdr") == pytest.approx(expected, abs=1e-12)


def test_cosine_min_lr_is_an_absolute_floor(tmp_path: Path) -> None:
    train(tiny_task(), TrainConfig(micro_batch_size=8), opts(tmp_path, "c", max_steps=11, lr=0.1, min_lr=0.02))
    lrs = lrs_of(tmp_path / "c")
    assert lrs[0] == pytest.approx(0.1) and min(lrs) >= 0.02 - 1e-12
    assert lrs[-1] == pytest.approx(0.02 + 0.08 * 0.5 * (1 + math.cos(math.pi * 10 / 11)))


def test_onecycle_pct_start_linear_anneal_and_momentum_cycling(tmp_path: Path) -> None:
    made: list[RecordingSGD] = []

    def sgd(params: Any) -> torch.optim.Optimizer:
        made.append(RecordingSGD(params, momentum=0.9))
        return made[-1]

    o = opts(tmp_path, "oc", max_steps=10, lr=0.1, schedule="onecycle", pct_start=0.4, anneal_strategy="linear",
             cycle_momentum=True, base_momentum=0.8, max_momentum=0.9, grad_clip=None)
    train(tiny_task(optimizer=sgd), TrainConfig(micro_batch_size=8), o)
    lrs = lrs_of(tmp_path / "oc")
    # 4 steps up (linear: equal increments) from 0.1/25 to the peak, then 6 down.
    assert lrs.index(max(lrs)) == 4 and lrs[4] == pytest.approx(0.1)
    rises = [b - a for a, b in zip(lrs, lrs[1:5])]
    assert rises == pytest.approx([rises[0]] * 4)
    m = made[0].momenta
    assert m[0] == pytest.approx(0.9) and m[4] == pytest.approx(0.8)  # against the lr
    assert m[9] == pytest.approx(0.8 + 0.1 * 5 / 6)  # on its way back up to 0.9


def test_onecycle_cycles_adams_first_beta() -> None:
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0, betas=(0.9, 0.98))
    s = make_schedule("onecycle", opt, total_steps=10, pct_start=0.5, cycle_momentum=True)
    betas = []
    for _ in range(10):
        betas.append(opt.param_groups[0]["betas"])
        s.step()
    assert betas[0] == pytest.approx((0.95, 0.98)) and betas[5] == pytest.approx((0.85, 0.98))
    with pytest.raises(ConfigError, match="cycle_momentum"):
        make_schedule("onecycle", torch.optim.Adagrad([nn.Parameter(torch.zeros(1))]), total_steps=5,
                      cycle_momentum=True)


def test_plateau_cooldown_and_min_lr_equal_torchs_reduce_on_plateau() -> None:
    metrics = [1.0, 1.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = make_schedule("plateau", opt, patience=1, factor=0.5, cooldown=2, min_lr=0.2)
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, patience=1, factor=0.5, cooldown=2, min_lr=0.2)
    got, expected = [], []
    for value in metrics:
        ours.observe(value)
        ref.step(value)
        got.append(ours.get_last_lr()[0])
        expected.append(ref_opt.param_groups[0]["lr"])
    assert got == pytest.approx(expected)
    assert len(set(got)) == 4 and got[-1] == pytest.approx(0.2)  # it did reduce, down to the floor


def test_plateau_cooldown_reaches_the_trainer(tmp_path: Path) -> None:
    # Validation worsens at every evaluation; patience 0: without a cooldown the lr halves each time.
    lrs = {}
    for cooldown in (0, 2):
        name = f"p{cooldown}"
        trainer = Trainer(tiny_task(val="flipped"), TrainConfig(micro_batch_size=8),
                          opts(tmp_path, name, max_steps=8, lr=0.1, schedule="plateau", cooldown=cooldown or None,
                               schedule_args={"patience": 0}, eval_every=1, grad_clip=None))
        trainer.run()
        lrs[cooldown] = lrs_of(tmp_path / name)
    assert lrs[0][-1] < lrs[2][-1] < 0.1
    assert len(set(lrs[2])) < len(set(lrs[0]))
    train(tiny_task(val="flipped"), TrainConfig(micro_batch_size=8),
          opts(tmp_path, "floor", max_steps=8, lr=0.1, schedule="plateau", min_lr=0.03,
               schedule_args={"patience": 0}, eval_every=1, grad_clip=None))
    floored = lrs_of(tmp_path / "floor")
    assert min(floored) == pytest.approx(0.03) and floored[-1] == pytest.approx(0.03)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_resumes_exactly_from_its_state_dict(name: str) -> None:
    args = {"multistep": {"milestones": (2, 4)}, "exponential": {"gamma": 0.8}, "cosine_restarts": {"t_0": 2, "t_mult": 2},
            "onecycle": {"cycle_momentum": True}, "plateau": {"patience": 0, "cooldown": 1, "min_lr": 0.05}}.get(name, {})

    def fresh() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
        return opt, make_schedule(name, opt, warmup_steps=0 if name == "onecycle" else 1, total_steps=9, **args)

    def advance(opt: torch.optim.Optimizer, s: Any, k: int, start: int) -> list[tuple[float, float]]:
        out = []
        for i in range(start, start + k):
            s.step()
            s.observe(1.0 + (i % 2))  # a stalling metric: plateau reduces
            out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        return out

    opt, s = fresh()
    whole = advance(opt, s, 9, 0)
    opt_a, a = fresh()
    first = advance(opt_a, a, 4, 0)
    state = a.state_dict()
    opt_b, b = fresh()
    b.load_state_dict(state)
    assert first + advance(opt_b, b, 5, 4) == whole


MODEL_FILE = '''
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"lr": 0.1}
_g = torch.Generator().manual_seed(0)
_x = torch.randn(24, 4, generator=_g)
_y = (_x[:, 0] > 0).long()

def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

def train_data():
    return TensorDataset(_x, _y)

def val_data():
    return TensorDataset(_x, 1 - _y)

def scheduler(optimizer, total_steps):
    SCHEDULER
'''


def scheduler_task(tmp_path: Path, body: str, name: str = "sched") -> Task:
    path = tmp_path / f"{name}_{len(_TASKS)}.py"
    path.write_text(textwrap.dedent(MODEL_FILE).replace("SCHEDULER", body))
    task = load_task(path)
    _TASKS.append(task)
    return task


def test_a_model_files_scheduler_is_stepped_per_optimizer_step_and_resumes(tmp_path: Path) -> None:
    body = "return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)"
    config = TrainConfig(micro_batch_size=8)  # 3 steps an epoch
    full = train(scheduler_task(tmp_path, body), config, opts(tmp_path, "full", max_steps=7, seed=2))
    assert lrs_of(tmp_path / "full") == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.0125])
    train(scheduler_task(tmp_path, body), config, opts(tmp_path, "part", max_steps=4, seed=2))
    resumed = train(scheduler_task(tmp_path, body), config, opts(tmp_path, "part", max_steps=7, seed=2, resume=True))
    assert resumed.steps == full.steps == 7
    assert lrs_of(tmp_path / "part")[-3:] == pytest.approx([0.025, 0.025, 0.0125])
    a, b = torch.load(tmp_path / "part" / "model.pt"), torch.load(tmp_path / "full" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A schedule named in the options replaces the model file's.
    train(scheduler_task(tmp_path, body), config, opts(tmp_path, "named", max_steps=3, schedule="constant"))
    assert lrs_of(tmp_path / "named") == pytest.approx([0.1] * 3)



def test_onecycle_pct_start_overrides_the_model_files_default_warmup(tmp_path: Path) -> None:
    task = tiny_task()
    task = Task(**{**{f: getattr(task, f) for f in ("name", "build_model", "train_data", "val_data")},
                   "settings": {"lr": 0.1, "warmup_steps": 7}})
    _TASKS.append(task)
    train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, "oc", max_steps=10, schedule="onecycle", pct_start=0.2))
    lrs = lrs_of(tmp_path / "oc")
    assert lrs.index(max(lrs)) == 2  # the rise is 20% of 10 steps, not settings' 7 warm-up steps


def test_a_model_files_reduce_on_plateau_is_stepped_with_the_metric(tmp_path: Path) -> None:
    body = "return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)"
    train(scheduler_task(tmp_path, body), TrainConfig(micro_batch_size=8), opts(tmp_path, "rop", max_steps=4, eval_every=1))
    lrs = lrs_of(tmp_path / "rop")
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] < lrs[0]  # flipped validation: it reduced


def test_from_module_takes_a_scheduler_factory(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    task = Task.from_module(model, (x, y), train_data=TensorDataset(x, y), settings={"lr": 0.2},
                            scheduler=lambda opt, total: torch.optim.lr_scheduler.LinearLR(
                                opt, start_factor=0.5, total_iters=total))
    _TASKS.append(task)
    train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, "fm", max_steps=4))
    assert lrs_of(tmp_path / "fm") == pytest.approx([0.1, 0.125, 0.15, 0.175])


def test_a_model_files_reduce_on_plateau_needs_validation_data(tmp_path: Path) -> None:
    task = scheduler_task(tmp_path, "return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)")
    task = Task(**{**{f: getattr(task, f) for f in ("name", "build_model", "train_data", "build_scheduler")},
                   "val_data": None})
    _TASKS.append(task)
    with pytest.raises(ConfigError, match="needs validation data") as info:
        train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, "nov", max_steps=1))
    assert "\n" not in str(info.value)


def test_a_model_files_scheduler_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="not a torch.optim.lr_scheduler.LRScheduler") as info:
        train(scheduler_task(tmp_path, "return 3"), TrainConfig(micro_batch_size=8), opts(tmp_path, "bad", max_steps=1))
    assert "\n" not in str(info.value)
    body = "return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)"
    for kw in ({"warmup_steps": 2}, {"min_lr": 0.01}, {"schedule_args": {"min_lr_ratio": 0.1}}):
        with pytest.raises(ConfigError, match="defines scheduler()") as info:
            train(scheduler_task(tmp_path, body), TrainConfig(micro_batch_size=8), opts(tmp_path, "both", max_steps=1, **kw))
        assert "TrainOptions." in str(info.value) and "\n" not in str(info.value)


# -- early stopping's min_delta --------------------------------------------------------------------

def test_min_delta_stops_on_gains_smaller_than_it(tmp_path: Path) -> None:
    common = dict(max_steps=12, lr=1e-3, schedule="constant", eval_every=1, early_stopping_patience=2, grad_clip=None)
    plain = train(tiny_task(), TrainConfig(micro_batch_size=8), opts(tmp_path, "plain", **common))
    gains = [r["val_loss"] for r in records(tmp_path / "plain", "eval")]
    assert not plain.summary["stopped_early"] and all(b < a for a, b in zip(gains, gains[1:]))  # tiny gains
    delta = train(tiny_task(), TrainConfig(micro_batch_size=8),
                  opts(tmp_path, "delta", early_stopping_min_delta=0.05, **common))
    assert delta.summary["stopped_early"] and delta.steps == 3
    assert delta.summary["best_step"] == 3  # the best weights still follow every gain


# -- clipping ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["norm", "value", "off"])
def test_clip_modes(tmp_path: Path, mode: str) -> None:
    made: list[RecordingSGD] = []
    task = tiny_task(scale=50.0, optimizer=lambda p: made.append(RecordingSGD(p)) or made[-1])
    train(task, TrainConfig(micro_batch_size=8), opts(tmp_path, mode, max_steps=2, grad_clip=0.01,
                                                      grad_clip_mode=mode, schedule="constant"))
    grads = made[0].grads[0]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    biggest = max(float(g.abs().max()) for g in grads)
    logged = records(tmp_path / mode, "step")[0]["grad_norm"]
    if mode == "norm":
        assert norm == pytest.approx(0.01, rel=1e-4)
    elif mode == "value":
        assert biggest == pytest.approx(0.01) and norm > 0.01
    else:
        assert norm > 0.1 and logged is None
    if mode != "off":
        assert logged > 0.1  # the norm before clipping


def test_fp16_unscales_before_clipping_by_value(tmp_path: Path) -> None:
    made: list[RecordingSGD] = []
    task = tiny_task(scale=50.0, optimizer=lambda p: made.append(RecordingSGD(p)) or made[-1])
    trainer = Trainer(task, TrainConfig(micro_batch_size=8, precision="fp16-mixed"),
                      opts(tmp_path, "fp16", max_steps=2, grad_clip=0.01, grad_clip_mode="value",
                           scaler_init_scale=1024.0, schedule="constant"))
    trainer.run()
    assert made[0].grads, "the GradScaler skipped every step"
    # Clipped after unscaling: the largest element is the threshold, not threshold / 1024.
    assert max(float(g.abs().max()) for g in made[0].grads[0]) == pytest.approx(0.01)


# -- GradScaler parameters -----------------------------------------------------------------------------

def test_grad_scaler_parameters_reach_the_scaler_and_the_recovery_switch(tmp_path: Path) -> None:
    o = opts(tmp_path, "gs", max_steps=4, scaler_init_scale=256.0, scaler_growth_factor=4.0,
             scaler_backoff_factor=0.25, scaler_growth_interval=2, schedule="constant")
    result = train(tiny_task(), TrainConfig(micro_batch_size=8, precision="fp16-mixed"), o)
    assert result.summary["scaler_skipped_steps"] == 0
    assert load_checkpoint(tmp_path / "gs" / "checkpoint.pt")["scaler"]["scale"] == 256.0 * 4.0 ** 2
    # OOM recovery onto an fp16 rung makes its scaler with the same parameters.
    trainer = Trainer(tiny_task(), TrainConfig(micro_batch_size=8, precision="fp32"), o)
    trainer._setup_data()
    trainer._setup()
    assert trainer.precision.scaler is None
    trainer._switch_config(TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="fp16-mixed"))
    s = trainer.precision.scaler
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (256.0, 4.0, 0.25, 2)


def test_grad_scaler_backs_off_by_its_factor(tmp_path: Path) -> None:
    # A scale of 2**40 overflows fp16 gradients: the step is skipped and the scale backs off.
    o = opts(tmp_path, "bo", max_steps=1, scaler_init_scale=2.0**40, scaler_backoff_factor=0.125, schedule="constant")
    result = train(tiny_task(), TrainConfig(micro_batch_size=8, precision="fp16-mixed"), o)
    assert result.summary["scaler_skipped_steps"] == 1
    assert load_checkpoint(tmp_path / "bo" / "checkpoint.pt")["scaler"]["scale"] == 2.0**40 * 0.125


def test_make_grad_scaler_takes_torchs_arguments() -> None:
    s = make_grad_scaler("fp16-mixed", "cpu", init_scale=8.0, growth_interval=7)
    assert s is not None and s.get_scale() == 8.0 and s.get_growth_interval() == 7 and s.get_growth_factor() == 2.0
    assert make_grad_scaler("bf16-mixed", "cpu", init_scale=8.0) is None


# -- DataLoader settings ----------------------------------------------------------------------------

def test_loader_settings_reach_the_dataloader(tmp_path: Path) -> None:
    import multiprocessing

    o = opts(tmp_path, "dl", max_steps=2, num_workers=1, persistent_workers=True, prefetch_factor=3, pin_memory=False)
    trainer = Trainer(tiny_task(), TrainConfig(micro_batch_size=8), o)
    before = set(multiprocessing.active_children())
    trainer.run()
    loader = trainer.data.train_loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.pin_memory) == (1, True, 3, False)
    assert trainer.step == 2
    # The run stops the persistent workers it started (and those of its half-read epoch) as it
    # ends: left to a later garbage collection, torch's shutdown of each waits out its 5 s join
    # timeout in whatever runs then.
    assert set(multiprocessing.active_children()) <= before and loader._iterator is None
    auto = Trainer(tiny_task(), TrainConfig(micro_batch_size=8), opts(tmp_path, "auto", pin_memory=True))
    auto._setup_data()
    assert auto.data.train_loader.pin_memory and not auto.data.train_loader.persistent_workers  # 0 workers for tensors
    with pytest.raises(ConfigError, match="TrainOptions.persistent_workers") as info:
        Trainer(tiny_task(), TrainConfig(micro_batch_size=8), opts(tmp_path, "pw", persistent_workers=True,
                                                                    num_workers=None)).run()
    assert "\n" not in str(info.value)


def test_drop_last_skips_the_short_last_window_of_each_epoch(tmp_path: Path) -> None:
    seen: list[int] = []
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)  # 21 items: windows of 8, 8, (5)
    c = dict(seed=4, schedule="constant")  # a resumed run with another horizon follows it: not the same lrs
    result = train(tiny_task(21, seen=seen, val=None), config, opts(tmp_path, "dl", epochs=2, drop_last=True, **c))
    assert result.steps == 4 and result.epochs_completed == 2 and result.summary["samples_seen"] == 32
    assert seen == [4] * 8
    kept = train(tiny_task(21, val=None), config, opts(tmp_path, "keep", epochs=2, **c))
    assert kept.steps == 6 and kept.summary["samples_seen"] == 42
    # Exact resume mid-run, and no resume with the other setting (the epochs would not line up).
    train(tiny_task(21, val=None), config, opts(tmp_path, "part", max_steps=3, drop_last=True, **c))
    part = train(tiny_task(21, val=None), config, opts(tmp_path, "part", epochs=2, drop_last=True, resume=True, **c))
    a, b = torch.load(tmp_path / "part" / "model.pt"), torch.load(tmp_path / "dl" / "model.pt")
    assert part.steps == 4 and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="drop_last"):
        train(tiny_task(21, val=None), config, opts(tmp_path, "part", epochs=3, resume=True, **c))
    with pytest.raises(ConfigError, match=r"global batch of 8 .* is larger than .*'s 5 training items"):
        train(tiny_task(5, val=None), config, opts(tmp_path, "few", epochs=1, drop_last=True))


def test_drop_last_trains_the_permutations_first_whole_windows(tmp_path: Path) -> None:
    made: list[RecordingSGD] = []
    task = tiny_task(10, val=None, optimizer=lambda p: made.append(RecordingSGD(p)) or made[-1])
    train(task, TrainConfig(micro_batch_size=4), opts(tmp_path, "w", epochs=1, drop_last=True, seed=1,
                                                      grad_clip=None, schedule="constant"))
    x, y = task.dataset().tensors
    perm = epoch_permutation(10, 1, 0)
    ref = task.build_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    assert len(made[0].grads) == 2
    for k in range(2):
        items = perm[4 * k:4 * k + 4]
        ref_opt.zero_grad()
        F.cross_entropy(ref(x[items]), y[items]).backward()
        for got, p in zip(made[0].grads[k], ref.parameters()):
            torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=0.0)
        ref_opt.step()


# -- bad values: one line naming the option ------------------------------------------------------------

BAD = [
    ("schedule", {"schedule": "warmup_cosine"}),
    ("gamma", {"schedule": "step", "gamma": -1.0}),
    ("gamma", {"schedule": "exponential", "gamma": 1.5}),
    ("gamma", {"schedule": "exponential"}),
    ("gamma", {"gamma": 0.5}),  # cosine takes no gamma
    ("step_size", {"schedule": "step", "step_size": 0}),
    ("milestones", {"schedule": "multistep", "milestones": (5, 3)}),
    ("milestones", {"schedule": "multistep"}),
    ("milestones", {"schedule": "multistep", "milestones": "3,5"}),
    ("t_0", {"schedule": "cosine_restarts"}),
    ("t_0", {"schedule": "cosine_restarts", "t_0": 0}),
    ("t_mult", {"schedule": "cosine_restarts", "t_0": 2, "t_mult": 1.5}),
    ("min_lr", {"min_lr": -0.1}),
    ("pct_start", {"schedule": "onecycle", "pct_start": 1.0}),
    ("pct_start", {"schedule": "onecycle", "pct_start": 0.3, "warmup_steps": 5}),
    ("anneal_strategy", {"schedule": "onecycle", "anneal_strategy": "cosine"}),
    ("cycle_momentum", {"schedule": "onecycle", "cycle_momentum": "yes"}),
    ("base_momentum", {"schedule": "onecycle", "cycle_momentum": True, "base_momentum": 1.2}),
    ("base_momentum", {"schedule": "onecycle", "base_momentum": 0.8}),
    ("max_momentum", {"schedule": "onecycle", "cycle_momentum": True, "max_momentum": -0.1}),
    ("cooldown", {"schedule": "plateau", "cooldown": -1}),
    ("cooldown", {"schedule": "step", "cooldown": 1}),
    ("schedule_args", {"schedule": "step", "schedule_args": {"patience": 3}}),
    ("gamma", {"schedule": "step", "gamma": 0.5, "schedule_args": {"gamma": 0.2}}),
    ("early_stopping_min_delta", {"early_stopping_patience": 2, "early_stopping_min_delta": -0.1}),
    ("early_stopping_min_delta", {"early_stopping_min_delta": 0.1}),
    ("grad_clip", {"grad_clip": 0.0}),
    ("grad_clip_mode", {"grad_clip_mode": "global"}),
    ("scaler_init_scale", {"scaler_init_scale": 0.0}),
    ("scaler_growth_factor", {"scaler_growth_factor": 1.0}),
    ("scaler_backoff_factor", {"scaler_backoff_factor": 1.5}),
    ("scaler_growth_interval", {"scaler_growth_interval": 0}),
    ("num_workers", {"num_workers": -1}),
    ("prefetch_factor", {"prefetch_factor": 0}),
    ("pin_memory", {"pin_memory": "yes"}),
    ("persistent_workers", {"persistent_workers": True, "num_workers": 0}),
    ("drop_last", {"drop_last": 1}),
]


@pytest.mark.parametrize(("name", "kw"), BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_a_bad_value_is_a_one_line_error_naming_the_option(name: str, kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        TrainOptions(**kw)
    message = str(info.value)
    assert f"TrainOptions.{name}" in message and "\n" not in message


def test_defaults_keep_todays_behaviour() -> None:
    o = TrainOptions()
    assert o.schedule is None and o.clip_mode == "norm" and o.grad_clip == 1.0
    assert o.schedule_kwargs() == {} and not o.drop_last and o.early_stopping_min_delta == 0.0
    assert o.scaler_kwargs() == {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                 "growth_interval": 2000}
    assert TrainOptions(grad_clip=None).clip_mode == "off"
    assert TrainOptions(schedule="multistep", milestones=[3, 5]).milestones == (3, 5)  # from a TOML list


# -- memplan.nn -------------------------------------------------------------------------------------

@torch.no_grad()
def test_xavier_and_kaiming_have_their_variance() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(400, 600), nn.ReLU(), nn.Conv2d(16, 32, 5), nn.LayerNorm(600))
    nn.init.normal_(net[3].weight)
    init_weights(net, "xavier")
    w = net[0].weight
    assert float(w.std()) == pytest.approx(math.sqrt(2 / (400 + 600)), rel=0.02)
    assert float(w.abs().max()) <= math.sqrt(6 / 1000) and float(net[0].bias.abs().max()) == 0.0
    assert torch.equal(net[3].weight, torch.ones(600)) and float(net[3].bias.abs().max()) == 0.0
    init_weights(net, "kaiming")
    assert float(net[0].weight.std()) == pytest.approx(math.sqrt(2 / 400), rel=0.02)
    assert float(net[2].weight.std()) == pytest.approx(math.sqrt(2 / (16 * 25)), rel=0.03)
    init_weights(net, "xavier", nonlinearity="tanh")
    assert float(net[0].weight.std()) == pytest.approx(5 / 3 * math.sqrt(2 / 1000), rel=0.02)


@torch.no_grad()
def test_trunc_normal_is_truncated_at_two_std() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 300, padding_idx=0)
    init_weights(emb, "trunc_normal", std=0.05)
    w = emb.weight[1:]
    assert float(w.abs().max()) <= 0.1
    assert float(w.std()) == pytest.approx(0.05 * 0.8796, rel=0.02)  # a normal's std cut at +-2 sigma
    assert float(emb.weight[0].abs().max()) == 0.0
    with pytest.raises(ConfigError, match="scheme"):
        init_weights(emb, "orthogonal")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="std"):
        init_weights(emb, "trunc_normal", std=0.0)


def test_drop_path_keeps_the_expectation_per_sample_and_is_identity_in_eval() -> None:
    torch.manual_seed(0)
    layer = DropPath(0.25)
    x = torch.ones(20000, 3, 2)
    out = layer(x)
    per_sample = out.flatten(1)
    assert torch.equal(per_sample.min(1).values, per_sample.max(1).values)  # whole samples dropped or kept
    assert per_sample[:, 0].unique().tolist() == pytest.approx([0.0, 1 / 0.75])
    assert float((per_sample[:, 0] == 0).float().mean()) == pytest.approx(0.25, abs=0.015)
    assert float(out.mean()) == pytest.approx(1.0, abs=0.02)
    layer.eval()
    assert layer(x) is x
    assert DropPath(0.0)(x) is x
    for bad in (1.0, -0.1, True):
        with pytest.raises(ConfigError, match="DropPath: p"):
            DropPath(bad)


def test_drop_path_is_traced_by_the_estimator() -> None:
    import estimators

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(16, 16), DropPath(0.2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.fc(x))

    model = nn.Sequential(Block(), nn.Linear(16, 4))
    sample = (torch.randn(4, 16), torch.randint(0, 4, (4,)))
    est = estimators.estimate(Task.from_module(model, sample), batch_size=32)
    assert est.peak_bytes > 0


# -- weight-decay groups -----------------------------------------------------------------------------

class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10)
        self.head.weight = self.emb.weight  # tied
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def test_default_optimizer_decays_matrices_only_tied_once_frozen_never() -> None:
    model = Tied()
    task = Task(name="tied", build_model=Tied, settings={"weight_decay": 0.1})
    opt = task.make_optimizer(model)
    decay, no_decay = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert decay == {id(model.emb.weight), id(model.conv.weight)}  # the tied head weight is emb's
    assert no_decay == {id(p) for p in (model.conv.bias, model.norm.weight, model.norm.bias, model.bn.weight,
                                         model.bn.bias, model.head.bias)}
    assert not ({id(p) for p in model.frozen.parameters()} & (decay | no_decay))
    counted = sum(len(g["params"]) for g in opt.param_groups)
    assert counted == len({id(p) for p in model.parameters() if p.requires_grad})
    only_matrices = default_optimizer([nn.Parameter(torch.zeros(2, 2))], lr=0.1, weight_decay=0.3)
    assert len(only_matrices.param_groups) == 1 and only_matrices.param_groups[0]["weight_decay"] == 0.3
