"""The messages of a probe: what the parent asks a probe child (a :class:`Request`), and what
the child answers (a :class:`Reply`); both pickled over the child's socket (``_wire``).

A request's ``kind`` names its handler (``_child.HANDLERS``: ``probe`` or ``race``); each
handler reads the fields of its kind, and its reply holds the fields of its kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict

from .._types import Setting

if TYPE_CHECKING:
    from .._step_options import StepOptions

__all__ = ["ConfigDict", "ProbeStatus", "Reply", "Request", "TaskPayload"]

ProbeStatus = Literal["ok", "oom", "error", "timeout"]

ConfigDict = dict[str, int | str | bool]
"""A ``TrainConfig`` as ``TrainConfig.to_dict`` writes it."""


class TaskPayload(TypedDict, total=False):
    """How the child gets the task: a model file's path (with what the parent knows of it
    already), or the in-memory task pickled (``blob``)."""

    path: str
    name: str
    settings: dict[str, Setting] | None
    shape_policy: str
    shapes: object
    """The task's ``ShapeProfile`` when the parent has found it (the child does not scan the data again)."""
    step: StepOptions
    blob: bytes


class Request(TypedDict, total=False):
    """What a probe child is asked (``Prober.request``)."""

    task: TaskPayload
    device: str
    sys_path: list[str]
    num_threads: int
    env: dict[str, str]
    cwd: str
    kind: Literal["probe", "race"]
    warmup: int
    # kind "probe"
    config: ConfigDict
    steps: int
    budget_bytes: int | None
    # kind "race"
    configs: list[ConfigDict]
    rounds: int
    compiled: list[bool] | None
    guard_bytes: int | None


class Reply(TypedDict, total=False):
    """What a probe child answers."""

    status: ProbeStatus
    message: str
    steps_s: float
    """Seconds of the training steps themselves (the rest of the probe's time is overhead)."""
    raised: bool
    # kind "probe"
    estimate: dict[str, object] | None
    """The measured ``Estimate`` as ``Estimate.to_dict`` writes it."""
    first_step_extra_s: float | None
    # kind "race"
    step_times: list[list[float]]
