"""Running statistics (BatchNorm's, and any buffer a forward updates) do not depend on the memory
configuration: a checkpointed block's recomputation in backward leaves them as the plain step
does, and a window replayed after an out-of-memory error starts from the buffers it started from."""

from __future__ import annotations

import copy
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.oom import InjectingGuard, OOMInjector, _Injection
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from estimators import Task, TrainConfig
from estimators.runtime._checkpoint import apply_checkpointing
from memplan.training import Trainer, TrainOptions

pytestmark = pytest.mark.usefixtures("one_thread")

_TASKS: list[Task] = []  # estimators caches datasets by id(task): keep every task alive


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, c: int = 6, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(c) for _ in range(layers)))
        self.head = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d, momentum=None)  # a cumulative average: counts every update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class MLPNet(nn.Module):
    def __init__(self, d: int = 12, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * 5 * 5, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


MODELS = {"conv-bn2d": ConvNet, "mlp-bn1d": MLPNet}


def bn_task(kind: str, n_train: int = 48) -> Task:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_train, 2, 5, 5, generator=g)
    y = (x[:, 0, 2, 2] > 0).long() + (x[:, 1, 1, 1] > 0.5).long()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return MODELS[kind]()

    task = Task(name=kind, build_model=build, train_data=lambda: TensorDataset(x, y), settings={"lr": 0.05})
    _TASKS.append(task)
    return task


def opts(tmp_path: Path, name: str, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    return TrainOptions(out_dir=tmp_path / name, **kw)


def assert_same_model(model: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        if want[key].is_floating_point():
            torch.testing.assert_close(got[key], want[key], atol=atol, rtol=1e-5, msg=key)
        else:
            assert torch.equal(got[key], want[key]), (key, got[key], want[key])


def batch_counts(model: nn.Module) -> list[int]:
    return [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


PLAIN = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
STEPS = 5


# -- checkpointing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_training_learns_the_running_statistics_of_the_plain_run(tmp_path: Path, kind: str,
                                                                             policy: str) -> None:
    plain = Trainer(bn_task(kind), PLAIN, opts(tmp_path, "plain", max_steps=STEPS))
    plain.run()
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=3, checkpoint_policy=policy)
    checkpointed = Trainer(bn_task(kind), config, opts(tmp_path, "ckpt", max_steps=STEPS))
    checkpointed.run()
    assert checkpointed.step == plain.step == STEPS
    # One update per micro-batch forward, as without checkpointing.
    assert batch_counts(checkpointed.model) == batch_counts(plain.model) == [STEPS * PLAIN.grad_accum_steps] * 3
    assert_same_model(checkpointed.model, plain.model)


class Counting(nn.Module):
    """A module that updates buffers in place in its forward (not a BatchNorm)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.mean.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("block", ["bn", "counting"])
def test_recomputation_leaves_buffers_as_the_forward_left_them(policy: str, block: str) -> None:
    torch.manual_seed(0)
    make = (lambda: MLPBlock(8)) if block == "bn" else (lambda: Counting(8))
    model = nn.Sequential(make(), make(), make())
    checkpointed = copy.deepcopy(model)
    assert apply_checkpointing(checkpointed, 3, policy=policy) == 3
    for micro in range(3):  # accumulation: each backward recomputes once, after its forward
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(micro))
        model(x).square().mean().backward()
        checkpointed(x).square().mean().backward()
    assert_same_model(checkpointed, model, atol=0.0)
    for p, q in zip(checkpointed.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0.0, rtol=0.0)


def test_a_recomputation_that_fails_leaves_the_buffers_as_the_forward_left_them() -> None:
    """An OOM at any op of the backward: before, inside or after a block's recomputation."""
    fired = 0
    for after_ops in range(1, 40):
        torch.manual_seed(0)
        model = nn.Sequential(MLPBlock(8), MLPBlock(8))
        apply_checkpointing(model, 2)
        loss = model(torch.randn(5, 8)).square().mean()
        after_forward = copy.deepcopy(model.state_dict())
        buffers = [id(b) for b in model.buffers()]
        with OOMInjector(after_ops=after_ops, phase="backward") as injector:
            try:
                loss.backward()
            except torch.OutOfMemoryError:
                pass
        fired += injector.fired
        del loss
        assert [id(b) for b in model.buffers()] == buffers  # the same tensors
        for key, value in model.state_dict().items():
            assert torch.equal(value, after_forward[key]), (after_ops, key)
    assert fired > 20


# -- OOM recovery ------------------------------------------------------------------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def forward_ops(task: Task) -> int:
    """Ops of one micro-batch's forward and loss (what the guard counts as the forward)."""
    model = task.build_model().train()
    x, y = (torch.stack(t) for t in zip(*(task.train_data()[i] for i in range(PLAIN.micro_batch_size))))
    with _CountOps() as counter:
        F.cross_entropy(model(x), y)
    return counter.ops


class _FailsAtStep3(Trainer):
    inject: dict[str, Any] = {}

    def _after_window(self, window: Any, outcome: Any) -> None:
        super()._after_window(window, outcome)
        if self.step == 2:
            self.memory_guard.inject(**self.inject)  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("where", ["second-forward", "first-backward", "twice"])
def test_a_window_replayed_after_an_oom_starts_from_its_buffers(tmp_path: Path, kind: str, where: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The OOM comes after the window's first forward has updated the statistics; the replay
    (checkpointed, the ladder's next rung) must not add its updates to the failed try's."""
    in_recomputation: list[bool] = []
    check = _Injection.check

    def noting_check(self: _Injection, func: Any) -> None:
        try:
            check(self, func)
        except torch.OutOfMemoryError:
            in_recomputation.append(any(f.name == "recompute_fn" for f in traceback.extract_stack()))
            raise

    monkeypatch.setattr(_Injection, "check", noting_check)
    reference = Trainer(bn_task(kind), PLAIN, opts(tmp_path, "ref", max_steps=STEPS))
    reference.run()
    ladder = [TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=3, checkpoint_policy="selective"),
              TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=3)]
    task = bn_task(kind)
    inject = {
        # in the window's second micro-batch's forward: the first forward and backward have run
        "second-forward": {"after_ops": forward_ops(task) + 4, "phase": "forward"},
        "first-backward": {"after_ops": 3, "phase": "backward"},
        # then again in the selectively checkpointed replay's backward, in a recomputation
        "twice": {"after_ops": 22, "phase": "backward", "times": 2},
    }[where]
    trainer = _FailsAtStep3(task, PLAIN, opts(tmp_path, "oom", max_steps=STEPS), memory_guard=InjectingGuard(10**12),
                            ladder=ladder)
    trainer.inject = inject
    trainer.run()
    times = inject.get("times", 1)
    assert trainer.memory_guard.injected == times  # type: ignore[union-attr]
    assert [r["step"] for r in trainer.recoveries] == [3] * times and trainer.config == ladder[times - 1]
    assert in_recomputation == [False] + [True] * (times - 1)
    assert batch_counts(trainer.model) == [STEPS * PLAIN.grad_accum_steps] * 3
    assert_same_model(trainer.model, reference.model)
