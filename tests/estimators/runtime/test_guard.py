"""Tests of the CPU memory guard (estimators.runtime._guard): exact byte counts, real
torch.OutOfMemoryError in forward and backward, nothing leaked after an OOM, OOM injection,
and the CUDA path with torch.cuda patched."""

from __future__ import annotations

import doctest
import gc
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.oom import InjectingGuard, OOMInjector

from estimators._errors import ConfigError
from estimators.runtime import _guard
from estimators.runtime._guard import MemoryGuard

KB = 1000


def make_mlp() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))
    return model, opt, x, y


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_doctests() -> None:
    from helpers import oom
    assert doctest.testmod(_guard).failed == 0
    assert doctest.testmod(oom).failed == 0


def test_counts_exact_bytes_and_frees() -> None:
    with MemoryGuard(1_000_000) as guard:
        a = torch.zeros(1000)  # 4000 B
        assert guard.live_bytes == 4000
        b = torch.ones(500, dtype=torch.float64)  # 4000 B
        assert guard.live_bytes == 8000
        v = a.view(10, 100)  # a view: no new storage
        a.add_(1)  # in place: no new storage
        assert guard.live_bytes == 8000
        del b
        assert guard.live_bytes == 4000
        del a
        assert guard.live_bytes == 4000  # the view keeps the storage alive
        del v
        assert guard.live_bytes == 0
    assert guard.peak_bytes == 8000


def test_views_of_untracked_tensors_cost_nothing() -> None:
    data = torch.randn(1000, 10)  # a dataset made before the guard (40 kB)
    with MemoryGuard(10 * KB) as guard:
        row = data[3]  # a view: nothing allocated
        rows = data.narrow(0, 0, 10).t()
        assert guard.live_bytes == 0
        batch = torch.stack([data[i] for i in range(10)])  # 400 B, a new storage
        assert guard.live_bytes == 400
        copy = rows.contiguous()  # 400 B more
        assert guard.live_bytes == 800
        del row, rows, batch, copy
    assert guard.live_bytes == 0


def test_under_budget_passes_over_budget_raises() -> None:
    with MemoryGuard(10 * KB) as guard:
        a = torch.zeros(2000)  # 8 kB: fits
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(1000)  # 4 kB more: 12 kB > 10 kB
        assert guard.live_bytes == 8000  # the failed output was dropped
        assert guard.peak_bytes == 8000  # and never counted in the peak (as on CUDA)
        del a
    e = info.value
    assert isinstance(e, torch.OutOfMemoryError) and isinstance(e, RuntimeError)
    assert "out of memory" in str(e) and "4.00 kB" in str(e) and "10.0 kB" in str(e)


def test_track_counts_existing_tensors_once() -> None:
    lin = nn.Linear(100, 100)  # 40 000 + 400 bytes
    guard = MemoryGuard(10**9)
    assert guard.track(lin) == 40_400
    assert guard.track([lin.weight, lin.weight.t()]) == 0  # same storages
    assert guard.live_bytes == 40_400
    tied = nn.Sequential(lin, nn.Linear(100, 100))
    tied[1].weight = lin.weight
    g2 = MemoryGuard(10**9)
    assert g2.track(tied) == 40_000 + 400 + 400
    del tied, lin
    gc.collect()
    assert guard.live_bytes == 0 and g2.live_bytes == 0


def test_resize_in_place_is_remeasured() -> None:
    with MemoryGuard(1_000_000) as guard:
        a = torch.empty(0)
        a.resize_(1000)
        assert guard.live_bytes == 4000
        with pytest.raises(torch.OutOfMemoryError):
            a.resize_(1_000_000)


def test_oom_in_forward_and_nothing_leaks() -> None:
    model, opt, x, y = make_mlp()
    train_step(model, opt, x, y)  # optimizer state exists
    guard = MemoryGuard(10**9)
    guard.track([model, opt, x, y])
    before = guard.live_bytes
    guard.budget_bytes = before + 20 * KB  # the first Linear's output (32 kB) does not fit
    try:
        with guard:
            train_step(model, opt, x, y)
    except torch.OutOfMemoryError as exc:
        assert "aten.addmm" in str(exc)
    else:
        pytest.fail("no OOM")
    gc.collect()
    assert guard.live_bytes == before
    # The guard stays usable: with room, the same step runs and returns to the same level.
    guard.budget_bytes = 10**9
    with guard:
        train_step(model, opt, x, y)
    gc.collect()
    assert guard.live_bytes == before


def test_oom_in_backward() -> None:
    model, opt, x, y = make_mlp()
    train_step(model, opt, x, y)
    guard = MemoryGuard(10**9)
    guard.track([model, opt, x, y])
    before = guard.live_bytes
    with guard:
        loss = F.cross_entropy(model(x), y)
        after_forward = guard.live_bytes
        guard.budget_bytes = after_forward + 1 * KB  # no room for the gradients
        try:
            loss.backward()
        except torch.OutOfMemoryError as exc:
            error = exc
        else:
            pytest.fail("no OOM in backward")
    assert isinstance(error, torch.OutOfMemoryError)
    del loss, error
    gc.collect()
    assert guard.live_bytes == before
    assert all(p.grad is None for p in model.parameters())


def test_oom_inside_checkpointed_block_backward() -> None:
    from torch.utils.checkpoint import checkpoint

    block = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    x = torch.randn(32, 64, requires_grad=True)
    guard = MemoryGuard(10**9)
    guard.track([block, x])
    before = guard.live_bytes
    with guard:
        out = checkpoint(block, x, use_reentrant=False).sum()
        guard.budget_bytes = guard.live_bytes + 10 * KB  # recomputation needs 64 kB
        with pytest.raises(torch.OutOfMemoryError):
            out.backward()
    del out
    gc.collect()
    assert guard.live_bytes == before


def test_peak_and_reset_peak() -> None:
    with MemoryGuard(10**9) as guard:
        a = torch.zeros(10_000)
        b = a * 2
        del b
        assert guard.peak_bytes == 80_000 and guard.live_bytes == 40_000
        guard.reset_peak()
        assert guard.peak_bytes == 40_000
        del a


def test_budget_is_settable_and_validated() -> None:
    guard = MemoryGuard(100)
    guard.budget_bytes = 5000
    assert guard.budget_bytes == 5000
    with pytest.raises(ConfigError):
        guard.budget_bytes = -1
    with pytest.raises(ConfigError):
        MemoryGuard(1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MemoryGuard(100, device="mps")


def test_not_reentrant_and_mode_removed_on_exit() -> None:
    guard = MemoryGuard(10**9)
    with guard:
        with pytest.raises(RuntimeError, match="re-entrant"):
            guard.__enter__()
    a = torch.zeros(1000)  # outside: not counted
    assert guard.live_bytes == 0
    del a


# --------------------------------------------------------------------------- injection


def test_injector_raises_at_the_chosen_op() -> None:
    a = torch.ones(4)
    with OOMInjector(after_ops=3) as inj:
        a + 1
        a * 2
        with pytest.raises(torch.OutOfMemoryError, match="injected before op 3 aten.sub"):
            a - 1
        a - 1  # fired once; recovery proceeds
    assert inj.fired == 1


def test_seeded_injection_is_reproducible_and_recoverable() -> None:
    picks = [OOMInjector(seed=s, max_ops=50).after_ops for s in range(5)]
    assert picks == [OOMInjector(seed=s, max_ops=50).after_ops for s in range(5)]
    assert all(1 <= p <= 50 for p in picks) and len(set(picks)) > 1
    model, opt, x, y = make_mlp()
    failures = 0
    with OOMInjector(seed=7, max_ops=60):
        for _ in range(3):
            try:
                train_step(model, opt, x, y)
            except torch.OutOfMemoryError:
                failures += 1
                opt.zero_grad(set_to_none=True)
    assert failures == 1


def test_injection_in_backward_only() -> None:
    model, opt, x, y = make_mlp()
    with OOMInjector(after_ops=1, phase="backward") as inj:
        loss = F.cross_entropy(model(x), y)  # forward ops are not counted
        assert inj.fired == 0
        with pytest.raises(torch.OutOfMemoryError, match="in backward"):
            loss.backward()
    assert inj.fired == 1


def test_guard_inject_with_phase_labels() -> None:
    model, opt, x, y = make_mlp()
    guard = InjectingGuard(10**9)
    guard.inject(after_ops=2, phase="optimizer")
    with guard:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        assert guard.injected == 0
        guard.phase = "optimizer"
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            opt.step()
    assert guard.injected == 1
    guard.inject(None)  # disarmed
    with guard:
        opt.zero_grad(set_to_none=True)
        train_step(model, opt, x, y)


# --------------------------------------------------------------------------- cuda path


def test_cuda_guard_sets_and_restores_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(total_memory=80 * 10**9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: calls.append(fraction))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 123)
    guard = MemoryGuard(12 * 10**9, device="cuda")
    with guard:
        assert calls == [pytest.approx(0.15)]
        guard.budget_bytes = 8 * 10**9
        assert calls[-1] == pytest.approx(0.1)
        assert guard.live_bytes == 123
        assert guard.track(torch.zeros(10)) == 0
    assert calls[-1] == 1.0


def test_cuda_guard_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no GPU"):
        MemoryGuard(10**9, device="cuda")
