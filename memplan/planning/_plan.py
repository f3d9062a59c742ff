"""The plan: the chosen configuration, its runners-up, and why.

A ``Plan`` is frozen, round-trips through JSON (``save``/``load``), prints as a table, and
carries the *ladder* that OOM recovery steps down: configurations with the same global batch
and strictly less predicted memory, each the fastest of what is left below the previous one.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tabulate import tabulate

from estimators import ConfigError, Estimate, Task, TrainConfig, format_size
from estimators.task._task_data import structure_fingerprint

from .._version import __version__
from ._inputs import meta_model
from ._space import layout_key

__all__ = ["PlanEntry", "Plan", "provenance", "check_plan_model", "needed_bytes", "RACED_NOTE", "ANCHORED_NOTE",
           "BASES"]

PLAN_FORMAT = 1

_RECREATE = "re-create it with memplan plan MODEL.py --out plan.json"
"""The fix of a plan file that contradicts itself (``Plan.load`` names the file)."""

RACED_NOTE = "time: median of"
"""How an estimate's note begins when its step time was measured by a race, not predicted."""

ANCHORED_NOTE = "time: the time model's"
"""How a prediction's note begins when its time is scaled to the measured best's."""

BASES = {
    "measured": "{anchor}'s own measured step ({how}), its memory probed: the figure the rows are compared to",
    "raced": "{anchor}'s figure times the speed ratio its races measured (median of the rounds, step against step "
             "in one process)",
    "probed": "a probe of a few steps in its own process",
    "predicted": "the time model's prediction",
    "modelled": "the CUDA time model's prediction",
}
"""What a row's samples/s is, by its ``basis`` (the table's legend)."""


def needed_bytes(estimate: Estimate) -> int:
    """The memory a configuration needs against the budget: its peak and the CUDA context."""
    return estimate.peak_bytes + estimate.context_bytes


def excess_bytes(estimate: Estimate, limit: int, host_limit: int | None = None) -> int:
    """Bytes over the tighter of the device's ``limit`` and the host's (<= 0: it fits)."""
    over = needed_bytes(estimate) - limit
    return max(over, estimate.host_bytes - host_limit) if host_limit is not None else over


@dataclass(frozen=True, kw_only=True)
class PlanEntry:
    """One configuration with its predicted and (when probed) measured figures."""

    config: TrainConfig
    predicted: Estimate
    measured: Estimate | None = None
    probe_status: str | None = None
    """ok | oom | error | timeout, when a probe ran."""
    basis: str | None = None
    """What the entry's time figure is, on the plan's one basis (``BASES``); None: from the
    estimates (a plan ranked by prediction, or written before the field)."""

    @property
    def peak_bytes(self) -> int:
        """The memory figure the budget is held against: measured when there is one."""
        source = self.measured if self.measured is not None else self.predicted
        return source.peak_bytes + source.context_bytes

    @property
    def samples_per_s(self) -> float:
        source = self.measured if (self.measured is not None and self.measured.samples_per_s) else self.predicted
        return float(source.samples_per_s or 0.0)

    @property
    def source(self) -> str:
        """What the time figure is (``BASES``): measured (the figure the others are taken
        from: a race's median step, its memory probed), raced (that figure times the races'
        ratios), probed (a probe in its own process), modelled (a CUDA prediction) or
        predicted."""
        if self.basis is not None:
            return self.basis
        if self.measured is not None:
            return "measured"
        if any(n.startswith(RACED_NOTE) for n in self.predicted.notes):
            return "raced"
        return "modelled" if self.predicted.modelled else "predicted"

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "predicted": self.predicted.to_dict(),
            "measured": self.measured.to_dict() if self.measured else None,
            "probe_status": self.probe_status,
            "basis": self.basis,
            "peak_bytes": self.peak_bytes,
            "samples_per_s": self.samples_per_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanEntry:
        return cls(
            config=TrainConfig.from_dict(data["config"]),
            predicted=Estimate.from_dict(data["predicted"]),
            measured=Estimate.from_dict(data["measured"]) if data.get("measured") else None,
            probe_status=data.get("probe_status"),
            basis=data.get("basis"),  # absent from older plan files
        )


def _optional_bool(value: Any, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be true, false or null, got {value!r}; re-create the plan with memplan plan --out")


def _optional_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ConfigError(f"{name} must be a whole number or null, got {value!r}; {_RECREATE}")


def provenance(*, device: str, gpu: str | None, source_hash: str | None, source_path: str | None,
               structure: tuple[int, str] | None = None, model_name: str | None = None,
               origin: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where the plan comes from. ``source_hash`` is the model file's (or, for an in-memory
    module, ``module_fingerprint``'s); ``structure`` the model's ``structure_fingerprint``
    (parameter count, hash of the parameters' and buffers' names, shapes, dtypes and
    trainability): what ``check_plan_model`` holds a model to train against; ``origin`` where a
    task not read from a model file comes from (``Task.origin``: an ``hf:`` model's repo and
    sequence length, which the exports to other trainers read)."""
    out: dict[str, Any] = {
        "memplan": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "gpu": gpu,
        "model_file": source_path,
        "model_file_sha256_16": source_hash,
    }
    if model_name is not None:
        out["model_name"] = model_name
    if origin:
        out["origin"] = dict(origin)
    if structure is not None:
        out["model_parameters"], out["model_structure_sha256_16"] = structure
    out["host"] = platform.node()
    out["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return out


def check_plan_model(plan: Plan, task: Task, model: nn.Module | None = None, *,
                     plan_file: str | os.PathLike[str] | None = None) -> list[str]:
    """Whether ``plan`` was made for ``task``'s model: the warnings to show (``[]``: it was).

    The same model file (or in-memory module's fingerprint) as the plan's provenance records:
    ``[]``, nothing built. Otherwise the model (``model``, as the task builds it before any
    wrapping or conversion; else built on meta) is held to the structure the plan recorded:
    another parameter count, or other names, shapes, dtypes or trainability, raise
    :class:`ConfigError` (its predictions are for another model); the same structure from an
    edited file is one warning line, as is a plan written before structures were recorded
    whose model file differs. ``plan_file`` names the plan in the messages."""
    prov = plan.provenance
    recorded = prov.get("model_file_sha256_16")
    if recorded is not None and recorded == task.source_hash:
        return []
    name = Path(plan_file).name if plan_file is not None else "the plan"
    theirs, ours = _recorded_model(prov), _task_model(task)
    fix = _plan_again(task, plan_file)
    params, digest = prov.get("model_parameters"), prov.get("model_structure_sha256_16")
    if not isinstance(params, int) or not isinstance(digest, str):
        if recorded is None and task.source_hash is None:
            return []  # nothing recorded, nothing to compare
        return [f"{name} records no model structure (an older plan) and was made from {_made_from(theirs, ours)} "
                f"({_which_hash(task)} differs): its predictions may not hold; plan again if the model changed: {fix}"]
    count, mine = structure_fingerprint(model if model is not None else meta_model(task))
    if params != count:
        raise ConfigError(f"{name} was made for a model of {params:,} parameters ({theirs}), not this one of "
                          f"{count:,} ({ours}); plan it with {fix}")
    if digest != mine:
        raise ConfigError(f"{name} was made for another model of {count:,} parameters ({theirs}): its parameters' or "
                          f"buffers' names, shapes, dtypes or trainability differ from this one's ({ours}); "
                          f"plan it with {fix}")
    if recorded is None and task.source_hash is None:
        return []
    return [f"{name} was made from {_made_from(theirs, ours)} ({_which_hash(task)} differs; the parameters' names, "
            f"shapes and dtypes are the same): the predictions may no longer hold; plan again if the model changed: "
            f"{fix}"]


def _recorded_model(prov: Mapping[str, Any]) -> str:
    """The model the plan was made for, in a few words: its file's name, or the module's."""
    if prov.get("model_file"):
        return Path(str(prov["model_file"])).name
    return str(prov.get("model_name") or "an in-memory model")


def _task_model(task: Task) -> str:
    return Path(task.source_path).name if task.source_path else task.name


def _made_from(theirs: str, ours: str) -> str:
    return f"another version of {ours}" if theirs == ours else f"{theirs}, not {ours}"


def _which_hash(task: Task) -> str:
    return "the file's hash" if task.source_path else "the module's fingerprint of its layers and inputs"


def _plan_again(task: Task, plan_file: str | os.PathLike[str] | None) -> str:
    """The command that plans ``task`` again into ``plan_file``."""
    if not task.source_path:
        return "memplan.search(model, ...) for this model"
    try:
        model = os.path.relpath(task.source_path)
    except ValueError:  # another drive
        model = task.source_path
    if model.startswith(os.pardir):
        model = task.source_path
    return f"memplan plan {model} --out {os.fspath(plan_file) if plan_file is not None else 'plan.json'}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The ranked result of a search: ``entries[0]`` is the chosen configuration."""

    entries: tuple[PlanEntry, ...]
    budget_bytes: int
    margin: float
    device: str
    gpu: str | None
    global_batch: int | None
    trials: int
    provenance: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    failures: Mapping[TrainConfig, str] = field(default_factory=dict)
    """Configurations that could not be traced or run, each with its reason (infeasible
    trials); ``notes`` sums them up in one line."""
    compile: bool | None = None
    """torch.compile, measured by probes: True when the compiled step was faster and fits (the
    first entry's figures are then the compiled step's, and ``fit`` trains compiled), False when
    it was measured not to be, None when not evaluated (no device to probe; see the notes)."""

    def __post_init__(self) -> None:
        # What a plan file says must agree with itself: a hand-edited entry (another micro-batch
        # than its figures are for, a global batch the plan did not fix) trains something the
        # plan never predicted.
        if not self.entries:
            raise ConfigError(f"the plan has no configurations; {_RECREATE}")
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0:
            raise ConfigError(f"the plan's budget_bytes must be a number of bytes above 0, got {self.budget_bytes!r}; "
                              f"{_RECREATE}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"the plan's margin must be in [0, 1), got {self.margin!r}; {_RECREATE}")
        for rank, e in enumerate(self.entries, 1):
            c = e.config
            if self.global_batch is not None and c.global_batch != self.global_batch:
                raise ConfigError(
                    f"entry #{rank} ({c.describe()}) makes a global batch of {c.global_batch} (micro-batch "
                    f"{c.micro_batch_size} x {c.micro_batches} accumulation x {c.world_size} "
                    f"process{'es' if c.world_size != 1 else ''}), not the "
                    f"plan's global batch of {self.global_batch}; {_RECREATE}")
            for what, est in (("predicted", e.predicted), ("measured", e.measured)):
                if est is not None and est.config != c:
                    raise ConfigError(f"entry #{rank}'s configuration ({c.describe()}) is not the one its {what} "
                                      f"figures are for ({est.config.describe()}); {_RECREATE}")
        if self.best.peak_bytes > self.budget_bytes:
            raise ConfigError(f"the chosen configuration (entry #1, {self.config.describe()}) needs "
                              f"{format_size(self.best.peak_bytes)}, more than the plan's budget of "
                              f"{format_size(self.budget_bytes)}; {_RECREATE}")

    @property
    def best(self) -> PlanEntry:
        return self.entries[0]

    @property
    def config(self) -> TrainConfig:
        return self.best.config

    @property
    def launch(self) -> dict[str, int]:
        """What running the chosen configuration needs: processes per node and nodes
        (``torchrun --nproc-per-node … --nnodes …``; one process for single-device plans)."""
        c = self.config
        nodes = c.nodes
        return {"nproc_per_node": c.world_size // nodes, "nnodes": nodes}

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.best.peak_bytes

    def ladder(self, start: TrainConfig | None = None) -> list[PlanEntry]:
        """Configurations to step down to after an OOM at ``start`` (default: the best).

        Same global batch; each rung needs strictly less memory than the one above and is
        the fastest such configuration.
        """
        current = start or self.best.config
        above = next((e for e in self.entries if e.config == current), self.best)
        rungs: list[PlanEntry] = []
        limit = above.peak_bytes
        # Same global batch, and the same processes: the ranks of a run cannot change; the same
        # data order, so that a resumed run meets the same batches.
        candidates = [e for e in self.entries if e.config.global_batch == current.global_batch and e.config != current
                      and layout_key(e.config) == layout_key(current)
                      and e.config.length_grouped == current.length_grouped
                      # The optimizer and the weights' dtype are not switched in a running process.
                      and e.config.optimizer_in_backward == current.optimizer_in_backward
                      and (e.config.precision == "bf16-true") == (current.precision == "bf16-true")]
        while True:
            lower = [e for e in candidates if e.peak_bytes < limit and e not in rungs]
            if not lower:
                return rungs
            nxt = max(lower, key=lambda e: (e.samples_per_s, -e.peak_bytes))
            rungs.append(nxt)
            limit = nxt.peak_bytes

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "budget_bytes": self.budget_bytes,
            "margin": self.margin,
            "device": self.device,
            "gpu": self.gpu,
            "global_batch": self.global_batch,
            "trials": self.trials,
            "headroom_bytes": self.headroom_bytes,
            "launch": self.launch,
            "provenance": dict(self.provenance),
            "notes": list(self.notes),
            "failures": [{"config": c.to_dict(), "reason": r} for c, r in self.failures.items()],
            "compile": self.compile,
            "entries": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ConfigError(f"plan format {data.get('format')!r} is not {PLAN_FORMAT}; re-run memplan plan")
        return cls(
            entries=tuple(PlanEntry.from_dict(e) for e in data["entries"]),
            budget_bytes=int(data["budget_bytes"]),
            margin=float(data["margin"]),
            device=data["device"],
            gpu=data.get("gpu"),
            global_batch=_optional_int(data.get("global_batch"), "global_batch"),
            trials=int(data.get("trials", 0)),
            provenance=dict(data.get("provenance", {})),
            notes=tuple(data.get("notes", ())),
            failures={TrainConfig.from_dict(f["config"]): str(f["reason"]) for f in data.get("failures", ())},
            compile=_optional_bool(data.get("compile"), "compile"),  # absent from older plan files
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON, atomically: a reader sees the old file or the whole new one."""
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"cannot save the plan to {p}: it is a folder; give a file name, e.g. {p / 'plan.json'}")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=2))
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)  # a failed write leaves no *.tmp behind
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"plan file {str(path)!r} not found; create one with memplan plan MODEL.py --out plan.json"
            ) from None
        except ValueError as exc:
            raise ConfigError(
                f"plan file {str(path)!r} is not valid JSON ({exc}); re-create it with memplan plan"
            ) from None
        try:
            return cls.from_dict(data)
        except KeyError as exc:
            raise ConfigError(f"plan file {str(path)!r} lacks {exc}; re-create it with memplan plan --out") from None
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                # The fix names this plan's own model file and path where the plan knows them.
                made_from = (data.get("provenance") or {}).get("model_file") if isinstance(data, dict) else None
                model = Path(made_from).name if isinstance(made_from, str) and made_from else "MODEL.py"
                text = str(exc).replace("MODEL.py --out plan.json", f"{model} --out {path}")
                raise ConfigError(f"plan file {str(path)!r}: {text}") from None
            raise ConfigError(
                f"plan file {str(path)!r} is not a memplan plan ({type(exc).__name__}: {exc}); "
                "re-create it with memplan plan --out"
            ) from None

    # -- display -----------------------------------------------------------------------
    def table(self, limit: int = 10) -> str:
        rows = []
        best = self.best.samples_per_s
        for rank, e in enumerate(self.entries[:limit], 1):
            c = e.config
            rows.append(
                [
                    rank,
                    c.micro_batch_size,
                    c.micro_batches,  # a pipeline's micro-batches are its accumulation
                    c.precision,
                    f"{c.checkpoint_segments} {c.checkpoint_policy}"
                    if c.checkpoint_policy != "full"
                    else c.checkpoint_segments,
                    layout_key(c),
                    _offloads(e),
                    format_size(e.peak_bytes),
                    e.samples_per_s,
                    e.samples_per_s / best if best > 0 else "-",
                    e.source,
                ]
            )
        target = self.gpu or self.device
        head = (
            f"plan for {target}, budget {format_size(self.budget_bytes)} "
            f"(margin {self.margin:.0%}), headroom {format_size(self.headroom_bytes)}; "
            f"{len(self.entries)} feasible of {self.trials} configurations tried"
        )
        table = tabulate(
            rows,
            headers=[
                "#",
                "micro",
                "accum",
                "precision",
                "ckpt",
                "strategy",
                "techniques",
                "peak",
                "samples/s",
                "vs #1",
                "basis",
            ],
            tablefmt="simple",
            floatfmt=("g",) * 8 + (",.1f", ".2f"),
        )
        return "\n".join([head, table, *self._basis_lines(limit), *self._compile_line(),
                          *(f"note: {n}" for n in self.notes)])

    def _basis_lines(self, limit: int) -> list[str]:
        """The legend of the samples/s column: what each basis shown is, from which row."""
        shown = self.entries[:limit]
        found = {e.source for e in shown}
        anchor = next((i for i, e in enumerate(self.entries, 1) if e.source == "measured"), None)
        if anchor is None:
            anchor = next((i for i, e in enumerate(self.entries, 1) if e.source == "probed"), None)
        lines = []
        for basis in BASES:
            if basis not in found:
                continue
            if basis == "predicted" and anchor is not None and any(
                    e.source == "predicted" and any(n.startswith(ANCHORED_NOTE) for n in e.predicted.notes)
                    for e in shown):
                what = (f"the time model (refitted by the measurements) scaled so that #{anchor}'s prediction is "
                        f"its measured figure")
            else:
                what = BASES[basis].format(anchor=f"#{anchor}", how=self._measured_how(anchor))
            lines.append(f"  {basis}: {what}")
        if not lines:
            return []
        return ["samples/s, on one basis (vs #1: the ratio to row 1's):", *lines]

    def _measured_how(self, rank: int | None) -> str:
        """How row ``rank``'s time was measured, in a few words."""
        if rank is None:
            return "-"
        e = self.entries[rank - 1]
        notes = e.measured.notes if e.measured is not None else e.predicted.notes
        if any(n.startswith("torch.compile: the compiled step") for n in notes):
            return ("compiled: its eager figure times the median ratio of eager against compiled raced in one "
                    "process; the other rows are eager")
        raced = next((n for n in notes if n.startswith(RACED_NOTE) and "raced step against step" in n), None)
        if raced is not None:
            rounds = raced[len(RACED_NOTE):].split()[0]
            return f"median of {rounds} steps raced step against step in one process"
        return "a probe in its own process"

    def _compile_line(self) -> list[str]:
        """The table's line on torch.compile (the figures are in the notes)."""
        if self.compile is None:
            return []
        return [
            "torch.compile: on (measured faster; #1's figures are the compiled step's, fit trains compiled)"
            if self.compile
            else "torch.compile: off (measured, not faster within the budget)"
        ]


def _offloads(entry: PlanEntry) -> str:
    """The row's techniques beyond the columns ("-" for none): what it offloads, with the
    host memory that takes, and the optimizer step in backward."""
    c = entry.config
    parts = [name for name, on in (("states", c.cpu_offload), ("activations", c.offload_activations)) if on]
    used = [f"{'+'.join(parts)} offloaded ({format_size(entry.predicted.host_bytes)} host)"] if parts else []
    if c.optimizer_in_backward:
        used.append("optimizer in backward")
    return ", ".join(used) or "-"
