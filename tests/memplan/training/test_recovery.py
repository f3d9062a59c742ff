"""OOM recovery: the trainer steps down the plan's ladder and replays the interrupted optimizer
step; ``keep_global_batch`` does the same for users' own loops. Tiny models, CPU, real
``torch.OutOfMemoryError``s from the memory guard (by budget or injected at a seeded op)."""

from __future__ import annotations

import gc
import json
import math
import random
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers.oom import InjectingGuard
from torch.utils.data import TensorDataset

from estimators import Task, TrainConfig, TrainingError
from estimators.runtime._guard import MemoryGuard
from memplan.training import Trainer, TrainOptions, train
from memplan.training._checkpoint_io import load_checkpoint
from memplan.training._recovery import keep_global_batch, next_micro_batch

_TASKS: list[Task] = []  # estimators caches datasets by id(task): keep every task alive


pytestmark = pytest.mark.usefixtures("one_thread")


def mlp_task(n_train: int = 40, width: int = 16) -> Task:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train, 6, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long()
    xv = torch.randn(12, 6, generator=g)
    yv = (xv[:, 0] - xv[:, 2] > 0).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))

    task = Task(name="mlp", build_model=build, train_data=lambda: TensorDataset(x, y),
                val_data=lambda: TensorDataset(xv, yv), settings={"lr": 0.01})
    _TASKS.append(task)
    return task


BIG = TrainConfig(micro_batch_size=8, grad_accum_steps=1)
LADDER = [TrainConfig(micro_batch_size=4, grad_accum_steps=2), TrainConfig(micro_batch_size=2, grad_accum_steps=4),
          TrainConfig(micro_batch_size=1, grad_accum_steps=8)]


def opts(tmp_path: Path, name: str, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    kw.setdefault("epochs", 2)
    kw.setdefault("eval_every", 3)
    return TrainOptions(out_dir=tmp_path / name, **kw)


def records(out_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def state_of(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out_dir / "checkpoint.pt")["model"]


def test_injected_ooms_at_random_steps_and_phases_always_recover(tmp_path: Path) -> None:
    reference = train(mlp_task(), BIG, opts(tmp_path, "ref"), memory_guard=MemoryGuard(10**12))
    ref_losses = [r["loss"] for r in records(tmp_path / "ref", "step")]
    ref_state = state_of(tmp_path / "ref")
    assert reference.steps == 10

    phases = ["forward", "backward", "optimizer", "evaluation"]
    tried = recovered = 0
    for seed in range(10):
        rng = random.Random(seed)
        phase = phases[seed % 4]
        times = 1 + seed % 2  # some runs go down two rungs
        guard = InjectingGuard(10**12)
        guard.inject(after_ops=rng.randint(1, 40), phase=phase, times=times)
        name = f"seed{seed}"
        result = train(mlp_task(), BIG, opts(tmp_path, name), memory_guard=guard, ladder=LADDER)
        assert guard.injected == times, (seed, phase)
        events = records(tmp_path / name, "oom_recovery")
        tried += times
        recovered += len(events)
        assert len(events) == times and [e["phase"] for e in events] == [phase] * times
        assert events[0]["from"] == BIG.to_dict() and events[-1]["to"] == LADDER[times - 1].to_dict()
        assert all(e["event"] == "oom_recovery" and e["seconds"] >= 0 and e["peak_at_failure"] for e in events)
        assert result.summary["recoveries"] == [{k: v for k, v in e.items() if k != "type"} for e in events]
        # Same optimizer steps, same data, same losses and weights (fp32: only accumulation changed).
        assert result.steps == reference.steps
        steps = records(tmp_path / name, "step")
        assert [r["step"] for r in steps] == list(range(1, 11))
        torch.testing.assert_close(torch.tensor([r["loss"] for r in steps]), torch.tensor(ref_losses),
                                   atol=1e-5, rtol=0.0)
        for k, v in state_of(tmp_path / name).items():
            torch.testing.assert_close(v, ref_state[k], atol=1e-5, rtol=0.0, msg=f"seed {seed} {k}")
        # The checkpoint holds the configuration that worked.
        ckpt = load_checkpoint(tmp_path / name / "checkpoint.pt")
        assert ckpt["config"] == LADDER[times - 1].to_dict()
        assert len(ckpt["recovery"]["recoveries"]) == times
    assert recovered == tried == 15


def test_without_a_ladder_an_oom_propagates(tmp_path: Path) -> None:
    guard = InjectingGuard(10**12)
    guard.inject(after_ops=3, phase="backward")
    with pytest.raises(torch.OutOfMemoryError):
        train(mlp_task(), BIG, opts(tmp_path, "plain"), memory_guard=guard)


class _Hooked(Trainer):
    """Calls ``hook(trainer)`` after every optimizer step (and records the guard's live bytes
    after a garbage collection)."""

    hook: Any = None

    def _switch_config(self, new: TrainConfig) -> None:  # what a recovery's step down applies
        super()._switch_config(new)
        self.at_recovery.append(self.memory_guard.live_bytes)  # type: ignore[union-attr]

    def _after_window(self, window: Any, outcome: Any) -> None:
        super()._after_window(window, outcome)
        gc.collect()
        self.live.append(self.memory_guard.live_bytes)  # type: ignore[union-attr]
        if self.hook is not None:
            self.hook(self)


def run_hooked(task: Task, config: TrainConfig, options: TrainOptions, guard: MemoryGuard,
               hook: Any = None, ladder: Any = None) -> _Hooked:
    trainer = _Hooked(task, config, options, memory_guard=guard, ladder=ladder)
    trainer.live, trainer.at_recovery, trainer.hook = [], [], hook  # type: ignore[attr-defined]
    trainer.run()
    return trainer


def test_exhausted_ladder_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    class Squeezed(Trainer):
        def _setup(self) -> None:
            super()._setup()
            save = self.checkpoints.save

            def squeezing_save(state: Any, **kw: Any) -> None:
                save(state, **kw)
                if state.step == 2:  # from now on nothing fits: every configuration runs out of memory
                    self.memory_guard.budget_bytes = self.memory_guard.live_bytes + 64  # type: ignore[union-attr]

            self.checkpoints.save = squeezing_save  # type: ignore[method-assign]

    out = tmp_path / "exhausted"
    with pytest.raises(TrainingError) as info:
        Squeezed(mlp_task(), BIG, opts(tmp_path, "exhausted", checkpoint_every=1),
                 memory_guard=MemoryGuard(10**12), ladder=LADDER[:2]).run()
    message = str(info.value)
    assert "ran out of memory at step 3 in " in message and " with micro-batch 2, 4 accumulation steps" in message
    assert "no smaller configuration with the same global batch of 8 is left" in message
    assert "tried: micro-batch 8, fp32; micro-batch 4, x2 accumulation, fp32; micro-batch 2, x4 accumulation" in message
    assert f"the last good checkpoint is {out / 'checkpoint.pt'} (step 2)" in message
    assert "measured peak at failure" in message and "of budget" in message and "raise --vram" in message
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["step"] == 2 and ckpt["config"] == BIG.to_dict()  # not overwritten
    # It resumes, with a budget that fits again.
    resumed = train(mlp_task(), BIG, opts(tmp_path, "exhausted", checkpoint_every=1, resume=True),
                    memory_guard=MemoryGuard(10**12), ladder=LADDER)
    assert resumed.steps == 10 and resumed.summary["resumed_from_step"] == 2


def test_exhausted_on_the_first_step_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    guard = InjectingGuard(10**12)
    guard.inject(after_ops=1, phase="optimizer", times=100)
    with pytest.raises(TrainingError, match="ran out of memory at step 1 in optimizer with micro-batch 4"):
        train(mlp_task(), BIG, opts(tmp_path, "first"), memory_guard=guard, ladder=LADDER[:1])
    ckpt = load_checkpoint(tmp_path / "first" / "checkpoint.pt")
    assert ckpt["step"] == 0 and not ckpt["optimizer"]["state"]  # the half step was undone
    fresh = mlp_task().build_model().state_dict()
    for k, v in ckpt["model"].items():
        assert torch.equal(v, fresh[k]), k


def test_nothing_leaks_after_recovery(tmp_path: Path) -> None:
    def fail_at_step_3(trainer: Trainer) -> None:
        if trainer.step == 2:
            trainer.memory_guard.inject(after_ops=5, phase="backward")  # type: ignore[union-attr]

    task = mlp_task(width=64)
    recovered = run_hooked(task, BIG, opts(tmp_path, "rec", epochs=1), InjectingGuard(10**12), fail_at_step_3, LADDER)
    assert len(recovered.recoveries) == 1 and recovered.config == LADDER[0]
    fresh = run_hooked(mlp_task(width=64), LADDER[0], opts(tmp_path, "fresh", epochs=1), MemoryGuard(10**12), None,
                       LADDER[1:])
    assert len(recovered.live) == len(fresh.live) == 5
    for step in range(2, 5):  # from the recovered step on
        assert abs(recovered.live[step] - fresh.live[step]) <= 1024, (step, recovered.live, fresh.live)
    # Right after the recovery (before the replay) the failed step's activations, gradients and
    # batch are gone: live bytes are back at the level the step started from.
    assert recovered.at_recovery and abs(recovered.at_recovery[0] - recovered.live[1]) <= 1024, \
        (recovered.at_recovery, recovered.live)


def test_resume_continues_on_the_recovered_configuration(tmp_path: Path) -> None:
    guard = InjectingGuard(10**12)
    guard.inject(after_ops=2, phase="forward")
    first = train(mlp_task(), BIG, opts(tmp_path, "run", max_steps=4, epochs=None), memory_guard=guard, ladder=LADDER)
    assert first.summary["config"] == LADDER[0].to_dict()
    second = train(mlp_task(), BIG, opts(tmp_path, "run", max_steps=10, epochs=None, resume=True),
                   memory_guard=MemoryGuard(10**12), ladder=LADDER)
    assert second.summary["config"] == LADDER[0].to_dict()
    assert len(second.summary["recoveries"]) == 1 and second.steps == 10


MODEL_FILE = '''
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"lr": 0.001}

def model():  # small weights, large activations: (B, 64 tokens, 128) per layer
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))

def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, 32, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (128, 64), generator=g))
'''


def _wide_plan(tmp_path: Path) -> tuple[Path, Any]:
    """The wide model file and its plan for 4 GB (a ladder of smaller micro-batches)."""
    import memplan

    path = tmp_path / "wide.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    plan = memplan.search(str(path), vram="4GB", global_batch=64, device="cpu", probe_top=0, trials=16,
                          precisions=["fp32"], seed=0)
    plan.save(tmp_path / "plan.json")
    return path, plan


def _train_under(tmp_path: Path, path: Path, vram: int, steps: int, capsys: Any) -> dict[str, Any]:
    import memplan.cli

    out = tmp_path / "run"
    code = memplan.cli.main(["train", str(path), "--plan", str(tmp_path / "plan.json"), "--vram", str(vram),
                             "--max-steps", str(steps), "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    return json.loads((out / "summary.json").read_text())


def test_cli_train_recovers_when_the_saved_plan_no_longer_fits(tmp_path: Path, capsys: Any) -> None:
    path, plan = _wide_plan(tmp_path)
    ladder = plan.ladder()
    assert ladder, plan.table()
    vram = (plan.best.peak_bytes + ladder[-1].peak_bytes) // 2
    summary = _train_under(tmp_path, path, vram, 3, capsys)
    assert summary["steps"] == 3 and summary["recoveries"], plan.table()
    assert summary["config"] != plan.config.to_dict()
    assert TrainConfig.from_dict(summary["config"]).global_batch == plan.config.global_batch


def test_recovery_skips_to_the_first_rung_predicted_to_fit_the_budget(tmp_path: Path, capsys: Any) -> None:
    # A plan made for 4 GB trained under a budget that only the ladder's lower rungs are
    # predicted to fit: one OOM, then straight to the first of those, not through each above it.
    path, plan = _wide_plan(tmp_path)
    ladder = plan.ladder()
    vram = int(ladder[-1].peak_bytes * 1.05)
    expected = next(i for i, e in enumerate(ladder) if e.peak_bytes <= vram)
    assert expected >= 1, plan.table()  # some rung above it is predicted not to fit
    recoveries = _train_under(tmp_path, path, vram, 2, capsys)["recoveries"]
    assert len(recoveries) == 1, recoveries
    assert recoveries[0]["to"] == ladder[expected].config.to_dict()
    assert recoveries[0]["skipped"] == [e.config.to_dict() for e in ladder[:expected]]


def test_keep_global_batch_halves_the_micro_batch_and_doubles_accumulation() -> None:
    seen: list[tuple[int, int]] = []

    @keep_global_batch(global_batch=64, starting_micro_batch=64)
    def step(micro_batch_size: int, grad_accum_steps: int) -> str:
        seen.append((micro_batch_size, grad_accum_steps))
        if len(seen) <= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "ok"

    assert step() == "ok"
    assert seen == [(64, 1), (32, 2), (16, 4)]
    assert (step.micro_batch_size, step.grad_accum_steps) == (16, 4)
    assert len(step.recovery_seconds) == 2

    @keep_global_batch(global_batch=4)
    def never_fits(micro: int, accum: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(TrainingError, match="micro-batch 1"):
        never_fits()
    assert never_fits.history == [(4, 1), (2, 2), (1, 4)]

    @keep_global_batch(global_batch=8)
    def other_error(micro: int, accum: int) -> None:
        raise ValueError("shapes")

    with pytest.raises(ValueError):
        other_error()
    assert next_micro_batch(48, 48) == 24 and next_micro_batch(60, 20) == 10 and next_micro_batch(12, 12) == 6


def test_steps_down_to_more_checkpointing_and_lower_precision(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 6, generator=g)
    y = (x[:, 0] > 0).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        return nn.Sequential(nn.Linear(6, 16), *blocks, nn.Linear(16, 2))

    task = Task(name="blocks", build_model=build, train_data=lambda: TensorDataset(x, y), settings={"lr": 0.01})
    _TASKS.append(task)
    ladder = [TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=2),
              TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="bf16-mixed", checkpoint_segments=4),
              TrainConfig(micro_batch_size=2, grad_accum_steps=4, precision="fp16-mixed", checkpoint_segments=4)]
    guard = InjectingGuard(10**12)
    guard.inject(after_ops=3, phase="backward", times=3)
    trainer = Trainer(task, BIG, opts(tmp_path, "down", eval_every=None), memory_guard=guard, ladder=ladder)
    result = trainer.run()
    assert [e["to"] for e in result.summary["recoveries"]] == [c.to_dict() for c in ladder]
    assert result.steps == 8 and trainer.config == ladder[-1] and trainer.precision.scaler is not None
    blocks = list(trainer.model.children())[1:5]
    assert all("forward" in b.__dict__ for b in blocks)  # all four blocks checkpointed now
    assert all(math.isfinite(r["loss"]) for r in records(tmp_path / "down", "step"))
    ckpt = load_checkpoint(tmp_path / "down" / "checkpoint.pt")
    assert ckpt["config"] == ladder[-1].to_dict() and ckpt["scaler"] is not None
