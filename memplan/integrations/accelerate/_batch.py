"""The plan's OOM ladder as accelerate's ``find_executable_batch_size(reduce_batch_size_fn=...)``.

accelerate calls ``function(batch_size, ...)`` from ``starting_batch_size``; on an exception its
``should_reduce_batch_size`` takes for an out-of-memory error it calls ``reduce_batch_size_fn()``
(no arguments) and retries with the ``int`` it returns (0 stops it). The function here answers
with the micro-batch of the plan's next rung (``Plan.ladder``: the same global batch, strictly
less memory, the fastest left), and keeps that rung's accumulation for the training function
to read, so the global batch stays the plan's::

    reduce = reduce_batch_size_fn(plan)

    @find_executable_batch_size(starting_batch_size=plan.config.micro_batch_size,
                                reduce_batch_size_fn=reduce)
    def train(batch_size):
        accelerator.gradient_accumulation_steps = reduce.grad_accum_steps  # or accumulation_for(plan, batch_size)
        ...

The starting batch size must be ``plan.config.micro_batch_size`` (``reduce.starting_batch_size``):
the ladder steps down from the plan's choice.
"""

from __future__ import annotations

from estimators import ConfigError, TrainConfig, TrainingError

from ...planning import Plan

__all__ = ["reduce_batch_size_fn", "accumulation_for", "LadderStep"]

# What a batch size alone can say: a rung that also changes these needs the training function to
# apply them (``LadderStep.config``), which accelerate's contract does not carry.
_BATCH_ONLY = ("micro_batch_size", "grad_accum_steps")


def _global_batch(plan: Plan) -> int:
    return plan.global_batch if plan.global_batch is not None else plan.config.global_batch


def accumulation_for(plan: Plan, micro_batch: int) -> int:
    """The accumulation that makes ``plan``'s global batch at ``micro_batch`` on the plan's
    processes; a :class:`ConfigError` when it is not a whole number."""
    c = plan.config
    per_step = micro_batch * c.world_size
    if micro_batch < 1 or _global_batch(plan) % per_step:
        raise ConfigError(
            f"micro-batch {micro_batch} x {c.world_size} process{'es' if c.world_size != 1 else ''} does not divide "
            f"the plan's global batch of {_global_batch(plan)}; start find_executable_batch_size at "
            f"plan.config.micro_batch_size ({c.micro_batch_size}) and take the batch sizes reduce_batch_size_fn(plan) "
            "gives")
    return _global_batch(plan) // per_step


class LadderStep:
    """The ``reduce_batch_size_fn`` of one run: each call steps to the next rung and returns its
    micro-batch. ``config`` (with ``micro_batch_size`` and ``grad_accum_steps``) is the rung the
    last returned batch size belongs to: before any call, the plan's choice."""

    def __init__(self, plan: Plan, *, batch_only: bool = True) -> None:
        self.plan = plan
        self.starting_batch_size = plan.config.micro_batch_size
        """What ``find_executable_batch_size`` must start from."""
        self.config: TrainConfig = plan.config
        self.tried: list[TrainConfig] = [plan.config]
        """The configurations handed out so far (the plan's choice first)."""
        start = plan.config
        rungs = [e.config for e in plan.ladder()]
        if batch_only:
            same = {f: getattr(start, f) for f in TrainConfig.__dataclass_fields__ if f not in _BATCH_ONLY}
            rungs = [r for r in rungs if all(getattr(r, f) == v for f, v in same.items())]
        self.rungs = rungs
        """The configurations left to step down to, in order."""
        self._batch_only = batch_only

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """The accumulation that goes with the last batch size returned: the global batch stays."""
        return self.config.grad_accum_steps

    def __call__(self) -> int:
        # A rung whose micro-batch is not smaller would be retried by a function that applies
        # only the batch size, and fail the same way; with batch_only=False the caller applies
        # the whole rung (checkpointing, precision, ...) and the same micro-batch may be new.
        while self.rungs:
            nxt = self.rungs.pop(0)
            if self._batch_only and nxt.micro_batch_size >= self.config.micro_batch_size:
                continue
            self.config = nxt
            self.tried.append(nxt)
            return nxt.micro_batch_size
        c = self.config
        raise TrainingError(
            f"out of memory at micro-batch {c.micro_batch_size} x {c.grad_accum_steps} accumulation, the last rung of "
            f"the plan's ladder: no configuration with the same global batch of {_global_batch(self.plan)} needs less "
            f"(tried: {'; '.join(t.describe() for t in self.tried)}); plan again for the memory the device really has "
            "free (memplan plan MODEL.py --vram SIZE) or with a smaller --global-batch")


def reduce_batch_size_fn(plan: Plan, *, batch_only: bool = True) -> LadderStep:
    """A ``reduce_batch_size_fn`` for accelerate's ``find_executable_batch_size`` that walks
    ``plan``'s ladder: each out-of-memory error steps to the next rung, whose micro-batch it
    returns; ``.grad_accum_steps`` (or :func:`accumulation_for`) is the accumulation that keeps
    the global batch. Start at ``plan.config.micro_batch_size``. When no rung is left it raises
    :class:`~estimators.TrainingError` (the OOM is its context).

    ``batch_only`` (default): only the rungs that differ from the plan's choice in micro-batch
    and accumulation, what a batch size can carry; ``False``: every rung, the training function
    applying ``.config`` (checkpointing, precision, ...) itself.
    """
    return LadderStep(plan, batch_only=batch_only)
