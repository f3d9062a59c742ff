"""The common problems of training a network, their causes and fixes; the doctor's findings
name one of them, and its report prints both."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tabulate import tabulate

__all__ = ["PROBLEMS", "Problem", "Finding", "DoctorReport"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True, slots=True)
class Problem:
    title: str
    cause: str
    fix: str


PROBLEMS: dict[str, Problem] = {
    "nan_output": Problem(
        "NaN/Inf in the outputs",
        "an op without a safe domain (log, sqrt or division of values near 0 or below), overflow in fp16, or bad inputs",
        "clamp before log/sqrt (x.clamp_min(1e-8)), add eps to divisions, use log_softmax instead of log(softmax), check the inputs",
    ),
    "nan_loss": Problem(
        "the loss became NaN/Inf during training",
        "a learning rate too high for the model, an unstable loss (log of 0), or exploding activations",
        "lower the learning rate (memplan lr-find), clip gradients, use a numerically stable loss",
    ),
    "nan_grad": Problem(
        "NaN/Inf in the gradients",
        "non-finite outputs or loss, or a backward through an op at a singular point (sqrt(0), norm of 0)",
        "fix the forward first; add eps inside sqrt/norm; clip gradients",
    ),
    "exploding_grad": Problem(
        "exploding gradients",
        "weights initialised too large, deep stacks without normalisation or residuals, a learning rate too high",
        "use the layers' default (Kaiming/Xavier) init, add normalisation or residual connections, clip gradients (max-norm 1.0), lower the lr",
    ),
    "vanishing_grad": Problem(
        "vanishing gradients",
        "saturating activations (sigmoid/tanh) in deep stacks, weights initialised too small, no residual paths",
        "use ReLU/GELU, the default init, normalisation layers or residual connections",
    ),
    "dead_params": Problem(
        "parameters that never get a gradient",
        "a branch not used in forward, an output detached or left out of the loss, or units stuck at zero (dead ReLUs)",
        "use the branch in forward or delete it; do not .detach() what should learn; freeze on purpose with requires_grad_(False)",
    ),
    "no_overfit": Problem(
        "cannot overfit one batch",
        "a bug between the model, loss and labels (wrong target, softmax before cross_entropy, labels misaligned), or an lr far off",
        "check that loss() compares the right outputs with the right labels; pass logits (not probabilities) to cross_entropy; try another lr",
    ),
    "no_signal": Problem(
        "held-out loss does not improve: the labels look unrelated to the inputs",
        "shuffled or misaligned labels (inputs and labels permuted separately), or inputs that carry no information about them",
        "check that train_data() pairs each input with its own label; look at a few items by hand",
    ),
    "initial_loss": Problem(
        "the initial loss is far above chance",
        "outputs scaled too large at init (large weights, missing normalisation), or labels outside the classes",
        "use the default init; expect about log(classes) for cross-entropy at start",
    ),
    "init_constant": Problem(
        "a layer initialised to one value",
        "all units of the layer start equal (constant init) and learn the same thing",
        "initialise with the layer's reset_parameters() (random, Kaiming/Xavier)",
    ),
    "init_scale": Problem(
        "weights initialised at an unusual scale",
        "a custom init far from 1/sqrt(fan_in)",
        "use nn.init.kaiming_uniform_/xavier_uniform_ or the layer's default init",
    ),
    "input_nonfinite": Problem(
        "NaN/Inf in the inputs", "missing values in the data", "impute or drop them in train_data()"
    ),
    "input_scale": Problem(
        "inputs are not normalised",
        "raw features with large magnitudes (pixels 0..255, unscaled units)",
        "standardise features (subtract the mean, divide by the std) or scale to [0, 1]",
    ),
    "constant_features": Problem(
        "input features that never change",
        "padding, empty columns, or a broken preprocessing step",
        "drop the constant features or check the preprocessing",
    ),
    "label_imbalance": Problem(
        "unbalanced labels",
        "some classes are far rarer than others (or only one class is present)",
        "re-sample (WeightedRandomSampler) or weight the loss (cross_entropy(weight=...)); check the labels",
    ),
    "input_bound": Problem(
        "the training step waits for data",
        "loading and collating a batch takes as long as training on it",
        "use DataLoader(num_workers=N, pin_memory=True), pre-process once, keep the dataset in tensors",
    ),
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the doctor found: ``problem`` is a key of :data:`PROBLEMS`."""

    check: str
    problem: str
    severity: Severity
    detail: str

    def to_dict(self) -> dict[str, Any]:
        p = PROBLEMS[self.problem]
        return {**asdict(self), "title": p.title, "cause": p.cause, "fix": p.fix}


@dataclass(frozen=True)
class DoctorReport:
    """Every finding plus the figures the checks measured (per-layer statistics, losses)."""

    model: str
    findings: tuple[Finding, ...]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """No errors or warnings (information alone is healthy)."""
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "healthy": self.healthy,
            "findings": [f.to_dict() for f in self.findings],
            "stats": self.stats,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=float)

    def text(self, checks: Sequence[str] = ()) -> str:
        lines = [f"memplan doctor: {self.model}"]
        if checks:
            lines.append("checks run: " + ", ".join(checks))
        if self.healthy:
            lines.append("healthy: no problems found" + (" (notes below)" if self.findings else ""))
        rows = []
        for f in sorted(self.findings, key=lambda f: ("error", "warning", "info").index(f.severity)):
            p = PROBLEMS[f.problem]
            rows.append([f.severity, f.check, f"{p.title}: {f.detail}", p.cause, p.fix])
        if rows:
            lines.append(
                tabulate(
                    rows,
                    headers=["severity", "check", "finding", "likely cause", "fix"],
                    maxcolwidths=[None, None, 48, 36, 40],
                )
            )
        return "\n".join(lines)
