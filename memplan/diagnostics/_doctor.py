"""``memplan doctor``: the checks that tell a training bug from a hard problem.

Each check runs on the model file's own model, loss, optimizer and data, on the CPU by
default, seeded, in a few seconds for small models:

* **init**: per layer, weight std against 1/sqrt(fan_in) (the scale of PyTorch's defaults)
  and layers whose weights are all one value;
* **data**: non-finite inputs, input magnitudes, constant features, label balance;
* **outputs**: non-finite outputs (and the first module that produced them), the initial loss
  against chance (log of the classes) for classification;
* **gradients**: per layer norms after one backward: non-finite, exploding (norm > 1e3),
  vanishing (a layer's gradient/weight ratio 1e-5 of the largest), and parameters that get no
  gradient (or only zeros) in any step of the overfit run;
* **overfit**: up to N steps (300) on one batch of 4 items must bring its loss to a tenth of
  the start;
* **signal**: a short training (60 steps of 32) on other items must lower the loss of held-out items
  (shuffled labels cannot);
* **loader**: a DataLoader batch against a training step on it (input-bound when loading
  takes as long as the step; only a note under 10 ms a step, where any loader's fixed cost
  shows).

Each finding names an entry of :data:`memplan.diagnostics._problems.PROBLEMS` (cause and fix).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, Subset

from estimators import Task, load_task, to_device

from ..planning._space import DEFAULT_GLOBAL_BATCH
from ._problems import DoctorReport, Finding, Severity
from ._steps import PlainSteps, fresh_model

__all__ = ["doctor", "CHECKS", "loader_finding"]

CHECKS = ("init", "data", "outputs", "gradients", "overfit", "signal", "loader")
_EXPLODING = 1e3
_VANISHING_RATIO = 1e-5


def _set(out: list[Finding], check: str, problem: str, severity: str, detail: str) -> None:
    out.append(Finding(check, problem, severity, detail))  # type: ignore[arg-type]


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _to(batch: Any, device: str) -> Any:
    return to_device(batch, torch.device(device))  # as the trainer moves a batch


def check_init(model: nn.Module, out: list[Finding], stats: dict[str, Any]) -> None:
    layers = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or not isinstance(weight, torch.Tensor):
            continue
        w = weight.detach().float()
        fan_in = w[0].numel()
        std = float(w.std()) if w.numel() > 1 else 0.0
        ratio = std * math.sqrt(fan_in)
        layers[name] = {"std": std, "std_x_sqrt_fan_in": ratio, "mean": float(w.mean())}
        if w.numel() > 1 and std == 0.0 and float(w.abs().max()) > 0:
            _set(out, "init", "init_constant", "warning", f"{name}.weight is {float(w.flatten()[0]):.4g} everywhere")
        elif w.numel() > 1 and std == 0.0:
            _set(out, "init", "init_constant", "info", f"{name}.weight starts at zero (fine for a last layer only)")
        elif ratio > 10 or 0 < ratio < 0.01:
            _set(out, "init", "init_scale", "warning",
                 f"{name}.weight std {std:.3g} is {ratio:.3g} / sqrt(fan_in={fan_in}) (defaults give about 0.6)")
    stats["init"] = layers


def _inputs_and_labels(batch: Any) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor) \
            and not batch[1].is_floating_point():
        inputs = [x for x in tree_flatten(batch[0])[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
        return inputs, batch[1]
    return [x for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()], None


def check_data(task: Task, out: list[Finding], stats: dict[str, Any], *, items: int = 512) -> None:
    n = min(items, task.dataset_size() or items)
    inputs, labels = _inputs_and_labels(task.real_batch(n))
    info: dict[str, Any] = {"items": n}
    for k, x in enumerate(inputs):
        x = x.float()
        if not _finite(x):
            _set(
                out,
                "data",
                "input_nonfinite",
                "error",
                f"input {k}: {int((~torch.isfinite(x)).sum())} non-finite values",
            )
            continue
        peak = float(x.abs().max()) if x.numel() else 0.0
        info[f"input{k}"] = {
            "min": float(x.min()),
            "max": float(x.max()),
            "mean": float(x.mean()),
            "std": float(x.std()),
        }
        if peak > 100:
            _set(out, "data", "input_scale", "warning", f"input {k} reaches {peak:.4g} (mean {float(x.mean()):.3g})")
        if x.dim() >= 2 and x.shape[0] > 1:
            const = x.flatten(1).std(dim=0) == 0
            share = float(const.float().mean())
            info[f"input{k}"]["constant_features"] = int(const.sum())
            if share >= 0.5:
                _set(
                    out,
                    "data",
                    "constant_features",
                    "warning",
                    f"input {k}: {int(const.sum())} of {const.numel()} features are constant over {n} items",
                )
            elif const.any():
                _set(
                    out,
                    "data",
                    "constant_features",
                    "info",
                    f"input {k}: {int(const.sum())} of {const.numel()} features are constant over {n} items",
                )
    # One label per item (classification); token targets of a sequence model are as skewed
    # as the language itself, which is no bug.
    if labels is not None and labels.dim() == 1:
        counts = torch.bincount(labels.flatten().clamp_min(0))
        present = counts[counts > 0]
        info["label_counts"] = counts.tolist()[:100]
        if len(present) == 1:
            _set(out, "data", "label_imbalance", "error", f"all {n} items have label {int(counts.argmax())}")
        elif len(present) and float(present.max()) >= 10 * float(present.min()):
            _set(
                out,
                "data",
                "label_imbalance",
                "warning",
                f"the commonest label has {int(present.max())} items, the rarest {int(present.min())} (of {n})",
            )
    stats["data"] = info


def _first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> str | None:
    found: list[str] = []

    def hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def fn(_m: nn.Module, _inp: Any, output: Any) -> None:
            if not found and any(
                isinstance(t, torch.Tensor) and t.is_floating_point() and not _finite(t)
                for t in tree_flatten(output)[0]
            ):
                found.append(name or type(model).__name__)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def check_outputs(task: Task, model: nn.Module, batch: Any, out: list[Finding], stats: dict[str, Any]) -> None:
    outputs: list[torch.Tensor] = []
    handle = model.register_forward_hook(
        lambda _m, _i, o: outputs.extend(t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor))
    )
    try:
        with torch.no_grad():
            loss = task.compute_loss(model, batch)
    finally:
        handle.remove()
    floats = [t.float() for t in outputs if t.is_floating_point()]
    if floats:
        y = floats[0]
        stats["outputs"] = {
            "mean": float(y.nan_to_num().mean()),
            "std": float(y.nan_to_num().std()) if y.numel() > 1 else 0.0,
            "abs_max": float(y.nan_to_num().abs().max()),
            "shape": list(y.shape),
        }
    stats["initial_loss"] = float(loss)
    if any(not _finite(t) for t in floats) or not _finite(loss):
        where = _first_nonfinite_module(model, lambda: task.compute_loss(model, batch))
        _set(
            out,
            "outputs",
            "nan_output",
            "error",
            f"first non-finite values come out of {where!r}" if where else f"the loss is {float(loss)}",
        )
        return
    _inputs, labels = _inputs_and_labels(batch)
    if labels is not None and floats and floats[0].dim() >= 2:
        classes = floats[0].shape[-1] if floats[0].dim() == 2 else floats[0].shape[1]
        chance = math.log(max(classes, 2))
        stats["chance_loss"] = chance
        if float(loss) > 3 * chance + 1:
            _set(
                out,
                "outputs",
                "initial_loss",
                "warning",
                f"initial loss {float(loss):.3g} against {chance:.3g} for {classes} classes at random",
            )


def _grad_norms(model: nn.Module) -> dict[str, float | None]:
    return {
        n: (None if p.grad is None else float(p.grad.detach().float().norm()))
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def check_gradients(
    norms: dict[str, float | None], model: nn.Module, out: list[Finding], stats: dict[str, Any]
) -> None:
    weights = {n: float(p.detach().float().norm()) for n, p in model.named_parameters() if p.requires_grad}
    stats["grad_norms"] = norms
    bad = [n for n, g in norms.items() if g is not None and not math.isfinite(g)]
    if bad:
        _set(out, "gradients", "nan_grad", "error", f"non-finite gradients in {', '.join(bad[:5])}")
        return
    present = {n: g for n, g in norms.items() if g is not None}
    big = {n: g for n, g in present.items() if g > _EXPLODING}
    if big:
        worst = max(big, key=big.__getitem__)
        _set(
            out,
            "gradients",
            "exploding_grad",
            "warning",
            f"{len(big)} tensors have gradient norms above {_EXPLODING:g}; largest {worst} ({big[worst]:.3g})",
        )
    ratios = {n: g / (weights[n] + 1e-12) for n, g in present.items() if g > 0 and weights[n] > 0}
    if ratios:
        top = max(ratios.values())
        small = [n for n, r in ratios.items() if r < _VANISHING_RATIO * top]
        if small:
            _set(
                out,
                "gradients",
                "vanishing_grad",
                "warning",
                f"{', '.join(small[:5])}: gradient/weight {min(ratios[n] for n in small):.2g} against {top:.2g} elsewhere",
            )


def check_dead(seen: dict[str, bool], out: list[Finding], steps: int) -> None:
    dead = [n for n, ok in seen.items() if not ok]
    if dead:
        _set(
            out,
            "gradients",
            "dead_params",
            "warning",
            f"{len(dead)} parameter tensors got no (or only zero) gradient in {steps} steps: {', '.join(dead[:6])}",
        )


def _train_steps(
    task: Task,
    model: nn.Module,
    batches: Callable[[int], Any],
    steps: int,
    seen: dict[str, bool] | None = None,
    done: Callable[[list[float]], bool] | None = None,
) -> list[float]:
    """Up to ``steps`` of the trainer's own step (``_steps.PlainSteps``); stops at a NaN/inf
    loss (recorded) or when ``done(losses)``. ``seen`` marks the parameters that got a
    non-zero gradient."""
    plain = PlainSteps(task, model, str(next(model.parameters()).device))

    def mark(m: nn.Module) -> None:
        assert seen is not None
        for n, p in m.named_parameters():
            if p.grad is not None and bool((p.grad != 0).any()):
                seen[n] = True

    losses = []
    for step in range(steps):
        value = plain.step(batches(step), on_gradients=mark if seen is not None else None)
        if not math.isfinite(value):
            losses.append(float("nan"))
            break
        losses.append(value)
        if done is not None and done(losses):
            break
    return losses


def _eval_loss(task: Task, model: nn.Module, batch: Any) -> float:
    """The loss with dropout off and norms on their running statistics."""
    model.eval()
    with torch.no_grad():
        value = float(task.compute_loss(model, batch))
    model.train()
    return value


def check_overfit(
    task: Task,
    model: nn.Module,
    batch: Any,
    steps: int,
    out: list[Finding],
    stats: dict[str, Any],
    seen: dict[str, bool],
) -> None:
    # Judged in eval mode (dropout off), every 10 steps: memorised once that loss is a tenth
    # of the start, and the remaining steps would only confirm it. BatchNorm's running
    # statistics lag the training loss by a few dozen steps, hence eval mode, not the last loss.
    def memorised(losses: list[float]) -> bool:
        return len(losses) % 10 == 0 and _eval_loss(task, model, batch) <= 0.1 * losses[0]

    losses = _train_steps(task, model, lambda _s: batch, steps, seen, done=memorised)
    stats["overfit_losses"] = losses
    if losses and not math.isfinite(losses[-1]):
        _set(out, "overfit", "nan_loss", "error", f"at step {len(losses)} of overfitting one batch")
        return
    final = _eval_loss(task, model, batch)
    stats["overfit_final_loss"] = final
    if losses and final > 0.1 * losses[0] and final > 1e-3:
        _set(
            out,
            "overfit",
            "no_overfit",
            "warning",
            f"loss {losses[0]:.3g} -> {final:.3g} after {len(losses)} steps on one batch (expected below {0.1 * losses[0]:.3g})",
        )


def check_signal(task: Task, device: str, seed: int, steps: int, out: list[Finding], stats: dict[str, Any]) -> None:
    data = task.dataset()
    n = task.dataset_size() or 0
    held = min(256, n // 4)
    if data is None or held < 16:
        return
    train_n, batch = n - held, 32
    held_batch = _to(task.real_batch(held, offset=train_n), device)
    model = fresh_model(task, device, seed + 1)

    def held_loss() -> float:
        model.eval()
        with torch.no_grad():
            value = float(task.compute_loss(model, held_batch))
        model.train()
        return value

    before = held_loss()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(train_n, generator=g).tolist()

    def batches(step: int) -> Any:
        idx = [order[(step * batch + i) % train_n] for i in range(batch)]
        return _to(task.collate([data[i] for i in idx]), device)

    losses = _train_steps(task, model, batches, steps)
    after = held_loss()
    stats["signal"] = {
        "held_out_before": before,
        "held_out_after": after,
        "train_first": losses[:1],
        "train_last": losses[-1:],
    }
    if math.isfinite(after) and after > 0.95 * before:
        _set(
            out,
            "signal",
            "no_signal",
            "warning",
            f"held-out loss {before:.3g} -> {after:.3g} after {steps} training steps ({held} held-out items)",
        )


_SMALL_STEP_S = 0.01


def loader_finding(load_s: float, step_s: float) -> Finding | None:
    """Input-bound when loading a batch takes as long as a training step on it. Below 10 ms a
    step, the loader's fixed cost per batch shows for any dataset: a note, not a problem."""
    if step_s > 0 and load_s >= step_s:
        severity: Severity = "warning" if step_s >= _SMALL_STEP_S else "info"
        return Finding(
            "loader",
            "input_bound",
            severity,
            f"a batch takes {load_s * 1e3:.3g} ms to load and {step_s * 1e3:.3g} ms to train on",
        )
    return None


def check_loader(
    task: Task, model: nn.Module, device: str, out: list[Finding], stats: dict[str, Any], batches: int = 8
) -> None:
    # A whole number >= 1 or None (checked where the task was made: estimators.task._settings).
    batch_size = int(task.settings.get("global_batch") or DEFAULT_GLOBAL_BATCH)
    data = task.dataset()
    if data is None:  # a task of sample batches only: no loader to time
        return
    loader = DataLoader(
        Subset(data, range(min(task.dataset_size() or 0, batch_size * batches))),
        batch_size=batch_size,
        collate_fn=task.collate,
    )
    start = time.perf_counter()
    loaded = [b for b in loader]
    load_s = (time.perf_counter() - start) / max(len(loaded), 1)
    plain = PlainSteps(task, model, device)
    start = time.perf_counter()
    for b in loaded:
        plain.step(_to(b, device))
    step_s = (time.perf_counter() - start) / max(len(loaded), 1)
    stats["loader"] = {"load_ms": load_s * 1e3, "step_ms": step_s * 1e3, "batch_size": batch_size}
    finding = loader_finding(load_s, step_s)
    if finding is not None:
        out.append(finding)


def doctor(
    model: Task | str,
    *,
    device: str = "cpu",
    steps: int = 300,
    signal_steps: int = 60,
    seed: int = 0,
    checks: tuple[str, ...] = CHECKS,
) -> DoctorReport:
    """Run the checks on a model file (or :class:`Task`) and return what they found.

    ``steps``: the most steps of overfitting one batch (it stops once memorised: a
    transformer's loss sits on the unigram plateau for a while before it memorises);
    ``signal_steps``: the short training of the held-out check (batch 32).

    >>> report = doctor("examples/digits.py")     # doctest: +SKIP
    >>> report.healthy                            # doctest: +SKIP
    True
    """
    task = load_task(model) if isinstance(model, str) else model
    out: list[Finding] = []
    stats: dict[str, Any] = {}
    net = fresh_model(task, device, seed)
    # A few items, as the recipe goes: any working model memorises them in a hundred steps.
    batch = _to(task.real_batch(min(4, task.dataset_size() or 4)), device)
    if "init" in checks:
        check_init(net, out, stats)
    if "data" in checks:
        check_data(task, out, stats)
    if "outputs" in checks:
        check_outputs(task, net, batch, out, stats)
    if any(f.problem == "nan_output" for f in out):
        return DoctorReport(task.name, tuple(out), stats)  # nothing downstream of NaNs means anything
    seen = {n: False for n, p in net.named_parameters() if p.requires_grad}
    if "gradients" in checks:
        net.zero_grad(set_to_none=True)
        task.compute_loss(net, batch).backward()
        check_gradients(_grad_norms(net), net, out, stats)
        net.zero_grad(set_to_none=True)
    if "overfit" in checks or "gradients" in checks:
        check_overfit(task, net, batch, steps, out, stats, seen)
        if "gradients" in checks:
            check_dead(seen, out, steps)
        if "overfit" not in checks:
            out[:] = [f for f in out if f.check != "overfit"]
    if "signal" in checks:
        check_signal(task, device, seed, signal_steps, out, stats)
    if "loader" in checks and task.dataset() is not None:
        check_loader(task, fresh_model(task, device, seed), device, out, stats)
    return DoctorReport(task.name, tuple(out), stats)
