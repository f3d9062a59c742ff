"""The second, steady-state training step, derived from a trace of the first.

A trace needs two optimizer steps: the first creates the optimizer state (and any cache a
model fills lazily) while the allocator's history forms, the second is the steady state that
every later step repeats. On fake tensors, each step costs the same dispatch time, so for a
one-device configuration the second step is built from the first instead of traced:

* an allocation created in step 1 and released within it (activations, gradients, the
  batch, temporaries) is created and released again, at the same points, in step 2;
* an allocation created in step 1 that outlives it (optimizer state, a lazily built cache)
  exists once: step 2 does not create it again, and the ops that only created such state
  (``zeros_like`` for Adam's moments) do not run again;
* an allocation from before step 1 that step 1 released is gone in step 2.

Step 2 thus replays step 1's kernels with step 1's survivors alive, which is what a real
second step does when the model's control flow does not depend on the step number.
FSDP2 is derived too: its lazy initialisation in step 1 allocates nothing that lives on, and
the unsharded parameters it frees and re-allocates by resizing storages are step 1's
transients (derived and traced second steps have the same peaks, allocated, reserved and
host, on fp32, bf16-mixed, bf16-true, accumulation, checkpointing and CPU offload). The ops
that first created those storages are not repeated: step 2 re-allocates them by resizing. DDP (its buckets are
rebuilt at step 2) differs between steps in other ways and is traced for two steps; so are
real runs.

Likewise a step without gradient accumulation is the first micro-batch of an accumulating
step (``drop_second_micro``): one trace of accumulation 2 serves accumulation 1 too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._recorder import OpRecord

__all__ = ["RawEvents", "drop_second_micro", "repeat_first_step"]


@dataclass(kw_only=True)
class RawEvents:
    """The event table as the recorder writes it, in lists (the columns are
    :class:`~estimators.tracing._events.EventTable`'s), with the ops and what the steady
    derivations need: :func:`repeat_first_step` and :func:`drop_second_micro` append and drop
    rows, which lists do cheaply; ``Trace`` then holds it as arrays."""

    alloc_bytes: list[int]
    alloc_category: list[int]
    event_alloc: list[int]
    event_sign: list[int]
    event_phase: list[int]
    phase_labels: list[str]
    ops: list[OpRecord]
    op_positions: list[int]
    host: list[int]
    op_workspace: list[int] | None = None
    """Per op: scratch bytes measured by a profiled real run (None for fake traces)."""
    resized: list[int] = field(default_factory=list)
    """Allocations freed by resizing their storage to 0 (FSDP2's unsharded parameters): a
    later step re-allocates them by resizing, with no op that creates them."""


def repeat_first_step(raw: RawEvents) -> RawEvents:
    """``raw`` (one traced step: phases "setup", "step 1 …", "end") with step 2 appended."""
    labels = raw.phase_labels
    step1 = [i for i, label in enumerate(labels) if label.startswith("step 1 ")]
    if not step1 or step1 != list(range(step1[0], step1[-1] + 1)) or labels[-1] != "end":
        raise ValueError(f"not a one-step trace: phases {labels}")
    first, last = step1[0], step1[-1]
    shift = len(step1)  # phase index offset of the copy; "end" moves after it
    new_labels = labels[: last + 1] + ["step 2 " + labels[i][len("step 1 "):] for i in step1] + ["end"]

    events = list(zip(raw.event_alloc, raw.event_sign, raw.event_phase))
    in_step = [first <= ph <= last for _, _, ph in events]
    born_in_step: set[int] = set()
    freed_in_step: set[int] = set()
    for (a, s, _), inside in zip(events, in_step):
        if inside:
            (born_in_step if s > 0 else freed_in_step).add(a)
    transient = born_in_step & freed_in_step
    survivors = born_in_step - freed_in_step

    alloc_bytes = list(raw.alloc_bytes)
    alloc_category = list(raw.alloc_category)
    host = set(raw.host)
    copy_of: dict[int, int] = {}
    for a in sorted(transient):
        copy_of[a] = len(alloc_bytes)
        alloc_bytes.append(raw.alloc_bytes[a])
        alloc_category.append(raw.alloc_category[a])
        if a in host:
            host.add(copy_of[a])

    out_alloc, out_sign, out_phase, n_before_end, copied_before = _repeat_events(
        raw, events, in_step, transient, copy_of, last, shift)
    # The op that first made a storage step 2 re-allocates by resizing does not run again.
    ops, positions, workspace = _repeat_ops(raw, first, last, shift, survivors | set(raw.resized), n_before_end,
                                            copied_before)
    return RawEvents(
        alloc_bytes=alloc_bytes,
        alloc_category=alloc_category,
        event_alloc=out_alloc,
        event_sign=out_sign,
        event_phase=out_phase,
        phase_labels=new_labels,
        ops=ops,
        op_positions=positions,
        host=sorted(host),
        op_workspace=workspace,
        resized=sorted(set(raw.resized) | {copy_of[a] for a in raw.resized if a in copy_of}),
    )


def _repeat_events(raw: RawEvents, events: list[tuple[int, int, int]], in_step: list[bool], transient: set[int],
                   copy_of: dict[int, int], last: int, shift: int
                   ) -> tuple[list[int], list[int], list[int], int, list[int]]:
    """The events with step 1's transient allocations made and freed again as step 2, before
    the "end" phase; and where step 2 starts and how many events were copied before each."""
    # Events: everything up to the end of step 1, then the copy, then the "end" phase.
    n_before_end = max((k + 1 for k, (_, _, ph) in enumerate(events) if ph <= last), default=0)
    out_alloc = list(raw.event_alloc[:n_before_end])
    out_sign = list(raw.event_sign[:n_before_end])
    out_phase = list(raw.event_phase[:n_before_end])
    # copied_before[k]: copied events among the first k events (positions for copied ops).
    copied_before = [0] * (len(events) + 1)
    for k, ((a, s, ph), inside) in enumerate(zip(events, in_step)):
        keep = inside and a in transient
        copied_before[k + 1] = copied_before[k] + keep
        if keep:
            out_alloc.append(copy_of[a])
            out_sign.append(s)
            out_phase.append(ph + shift)
    for a, s, ph in events[n_before_end:]:  # the "end" phase, after the copy
        out_alloc.append(a)
        out_sign.append(s)
        out_phase.append(ph + shift)
    return out_alloc, out_sign, out_phase, n_before_end, copied_before


def _repeat_ops(raw: RawEvents, first: int, last: int, shift: int, survivors: set[int], n_before_end: int,
                copied_before: list[int]) -> tuple[list[OpRecord], list[int], list[int] | None]:
    """Ops, their event positions and workspaces: step 1's again as step 2, less those that
    only created surviving state."""
    n_copied = copied_before[-1]
    ops_before, pos_before, ops_step2, pos_step2, ops_after, pos_after = [], [], [], [], [], []
    src_before, src_step2, src_after = [], [], []  # each op's index in ``raw.ops``
    shifted: dict[OpRecord, OpRecord] = {}  # equal records shift to one (a block's ops repeat)

    def moved(op: OpRecord) -> OpRecord:
        out = shifted.get(op)
        if out is None:
            out = shifted[op] = replace(op, phase=op.phase + shift)
        return out

    for k, (op, pos) in enumerate(zip(raw.ops, raw.op_positions)):
        if op.phase <= last:
            ops_before.append(op)
            pos_before.append(pos)
            src_before.append(k)
        if first <= op.phase <= last:
            if not _only_made(raw, op.new_bytes, pos, survivors):
                ops_step2.append(moved(op))
                pos_step2.append(n_before_end + copied_before[pos])
                src_step2.append(k)
        elif op.phase > last:
            ops_after.append(moved(op))
            pos_after.append(pos + n_copied)
            src_after.append(k)
    workspace = raw.op_workspace
    if workspace is not None:
        workspace = [workspace[k] for k in src_before + src_step2 + src_after]
    return ops_before + ops_step2 + ops_after, pos_before + pos_step2 + pos_after, workspace


def _only_made(raw: RawEvents, new_bytes: int, pos: int, survivors: set[int]) -> bool:
    """Did the op whose outputs end at event ``pos`` create storage, all of it surviving?

    An op's new storages are tracked right after it returns: the creations just before
    ``pos`` that add up to its ``new_bytes``."""
    if new_bytes <= 0:
        return False
    total, k = 0, pos - 1
    while total < new_bytes and k >= 0 and raw.event_sign[k] > 0:
        a = raw.event_alloc[k]
        if a not in survivors:
            return False
        total += raw.alloc_bytes[a]
        k -= 1
    return total == new_bytes


def drop_second_micro(raw: RawEvents) -> RawEvents | None:
    """One traced step of two micro-batches (phases "step 1 micro 1 …", "step 1 micro 2 …")
    as the step of one micro-batch: accumulation 1 at the same micro-batch size.

    The first micro-batch of an accumulating step runs what a step without accumulation runs
    (it creates the gradients; the second adds into them), so dropping the second leaves that
    step. This holds only when the second micro-batch is self-contained: every allocation it
    touches is born and released within it. Otherwise (something it frees was made before
    it, or something it makes outlives it) None is returned and the step is traced.
    """
    labels = raw.phase_labels
    second = {i for i, label in enumerate(labels) if label.startswith("step 1 micro 2 ")}
    first = {i for i, label in enumerate(labels) if label.startswith("step 1 micro 1 ")}
    if not second or not first or any(label.startswith("step 2 ") for label in labels):
        return None
    inside: dict[int, list[int]] = {}
    outside: set[int] = set()
    for a, s, ph in zip(raw.event_alloc, raw.event_sign, raw.event_phase):
        if ph in second:
            inside.setdefault(a, []).append(s)
        else:
            outside.add(a)
    if any(a in outside or sorted(signs) != [-1, 1] for a, signs in inside.items()):
        return None

    kept_phases = [i for i in range(len(labels)) if i not in second]
    new_phase = {old: new for new, old in enumerate(kept_phases)}
    new_labels = ["step 1 " + labels[i][len("step 1 micro 1 "):] if i in first else labels[i] for i in kept_phases]
    kept_allocs = [a for a in range(len(raw.alloc_bytes)) if a not in inside]
    new_alloc = {old: new for new, old in enumerate(kept_allocs)}

    out_alloc, out_sign, out_phase = [], [], []
    dropped_before = [0] * (len(raw.event_alloc) + 1)
    for k, (a, s, ph) in enumerate(zip(raw.event_alloc, raw.event_sign, raw.event_phase)):
        drop = ph in second
        dropped_before[k + 1] = dropped_before[k] + drop
        if not drop:
            out_alloc.append(new_alloc[a])
            out_sign.append(s)
            out_phase.append(new_phase[ph])
    ops, positions, kept_ops = [], [], []
    for k, (op, pos) in enumerate(zip(raw.ops, raw.op_positions)):
        if op.phase not in second:
            ops.append(replace(op, phase=new_phase[op.phase]))
            positions.append(pos - dropped_before[pos])
            kept_ops.append(k)
    return RawEvents(
        alloc_bytes=[raw.alloc_bytes[a] for a in kept_allocs],
        alloc_category=[raw.alloc_category[a] for a in kept_allocs],
        event_alloc=out_alloc,
        event_sign=out_sign,
        event_phase=out_phase,
        phase_labels=new_labels,
        ops=ops,
        op_positions=positions,
        host=sorted(new_alloc[a] for a in raw.host if a in new_alloc),
        op_workspace=None if raw.op_workspace is None else [raw.op_workspace[k] for k in kept_ops],
        resized=sorted(new_alloc[a] for a in raw.resized if a in new_alloc),
    )
