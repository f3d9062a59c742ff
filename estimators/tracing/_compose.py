"""The trace of a whole block stack, composed from traces of the model cut to a few blocks.

A cut trace (``trace_step(cut=...)``, :mod:`._depth`) tags every allocation, event and op
with the block it belongs to (-1: none). Its items -- events and ops, in the order recorded --
fall into *fixed* items (tag -1: the embeddings, the loss, the optimizer's multi-tensor ops,
everything outside the blocks) and *sweeps*: stretches of tagged items, between fixed ones,
whose blocks go up (a forward, an optimizer's pass over the parameters) or down (a backward),
each block's items a *run*.

The blocks of a cut are of two kinds: the first and the last (*edges*, which touch the
embeddings and the head) and the *interior* ones. Every interior block of one type (plain or
checkpointed) must make the same runs, allocation for allocation and op for op, except for
which neighbour's allocation an event refers to: an event refers to an allocation of its own
block, of a block ``delta`` away (the previous block's output, freed in this block's
backward), or to a fixed one. The stack of ``n`` blocks is then composed: its edges are the
cut's, and each interior block makes its type's runs in every sweep, an event that refers to a
neighbour taking its allocation from a cut block with a neighbour of the same kind there
(*witness*). Fixed allocations and ops are the cut's, their sizes (a bucket of every
gradient, the optimizer's multi-tensor ops' bytes) affine in the number of blocks, fitted from
a second cut one block deeper; that second cut, composed from the first, must equal its own
trace.

What cannot be composed raises :class:`~._depth.NotComposable` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .._config import TrainConfig
from .._errors import MemplanError
from ..runtime._checkpoint import find_block_stack
from ..task._task import Task
from ._depth import DepthCut, NotComposable, block_differences
from ._recorder import OpRecord
from ._steady import RawEvents
from ._trace import DataDependentShapes, TaggedRaw, Trace, finish_trace, trace_step

__all__ = ["FULL_TRACE_ENV", "Composer", "CutCache", "CutTracer", "StackFacts", "compose_enabled", "compose_trace",
           "cut_patterns", "same_trace", "stack_facts", "stack_pattern", "trace_composed"]

FULL_TRACE_ENV = "MEMPLAN_FULL_TRACE"
"""Set to 1 to trace every configuration whole (no composition of the block stack)."""

Pattern = tuple[bool, ...]
"""Per block of a stack: is it checkpointed?"""

_EVENT, _OP = 0, 1
_EDGE_FIRST, _EDGE_LAST = "first", "last"


@dataclass
class _Sweep:
    """Tagged items between two fixed ones: each block's run, the blocks going up (1) or down
    (-1; 0 for a single run)."""

    direction: int
    runs: dict[int, list[int]]


@dataclass
class _Parsed:
    """One cut trace, read into fixed items and sweeps."""

    tagged: TaggedRaw
    pattern: Pattern
    items: list[tuple[int, int]]  # (_EVENT or _OP, index), in recorded order
    owned: list[list[int]]  # per block: its allocations in creation order
    ordinal: np.ndarray  # per allocation: its place in its block's list (fixed: among the fixed)
    fixed_allocs: list[int]
    fixed_ops: list[int]
    segments: list[int | _Sweep] = field(default_factory=list)
    """A fixed item, or a sweep."""

    @property
    def k(self) -> int:
        return len(self.pattern)

    def kind(self, j: int) -> Hashable:
        """Edges are themselves; an interior block is its type."""
        if j == 0:
            return _EDGE_FIRST
        if j == self.k - 1:
            return _EDGE_LAST
        return self.pattern[j]


def _items(raw: RawEvents) -> list[tuple[int, int]]:
    """Events and ops in the order they were recorded (an op after the events of its outputs)."""
    items: list[tuple[int, int]] = []
    op = 0
    n_ops = len(raw.ops)
    for e in range(len(raw.event_alloc) + 1):
        while op < n_ops and raw.op_positions[op] <= e:
            items.append((_OP, op))
            op += 1
        if e < len(raw.event_alloc):
            items.append((_EVENT, e))
    while op < n_ops:
        items.append((_OP, op))
        op += 1
    return items


def _sorted_frees(tagged: TaggedRaw) -> TaggedRaw:
    """``tagged`` with each burst of frees (storages that die at one moment: between two
    allocations or ops) sorted by allocation, each event keeping its tag: their order is what
    hashing decided, and the finished trace puts them in its canonical order anyway.

    A burst outside any block that frees allocations of one block and its neighbours (and
    fixed ones) right after an op of that block is that op's block's: a loop over the
    parameters drops one parameter's temporary while it works on the next; a layer loop drops
    the previous block's output (offloaded where the block saved it) when a block returns, in
    the burst where FSDP2 reshards the block's own parameters."""
    raw = tagged.raw
    alloc, sign, phase = list(raw.event_alloc), raw.event_sign, raw.event_phase
    tags = list(tagged.event_block)
    after, owner = tagged.event_after_op, tagged.alloc_block
    cuts = set(raw.op_positions)  # an op between two frees ends a burst
    i, n = 0, len(alloc)
    while i < n:
        if sign[i] < 0:
            j = i + 1
            while j < n and sign[j] < 0 and phase[j] == phase[i] and j not in cuts:
                j += 1
            outside = [e for e in range(i, j) if after[e] >= 0]
            if outside:
                ops = {after[e] for e in outside}
                owners = {owner[alloc[e]] for e in outside} - {-1}
                if len(ops) == 1:
                    op = ops.pop()
                    if all(abs(o - op) <= 1 for o in owners):
                        for e in outside:
                            tags[e] = op
            if j - i > 1:
                burst = sorted(zip(alloc[i:j], tags[i:j]))
                alloc[i:j] = [a for a, _ in burst]
                tags[i:j] = [t for _, t in burst]
            i = j
        else:
            i += 1
    return replace(tagged, raw=replace(raw, event_alloc=alloc), event_block=tags)


def _parse(tagged: TaggedRaw, pattern: Pattern) -> _Parsed:
    tagged = _sorted_frees(tagged)
    raw = tagged.raw
    k = len(pattern)
    owner = tagged.alloc_block
    owned: list[list[int]] = [[] for _ in range(k)]
    fixed_allocs: list[int] = []
    ordinal = np.zeros(len(raw.alloc_bytes), dtype=np.int64)
    for a, b in enumerate(owner):
        if b >= k:
            raise NotComposable(f"an allocation is tagged with block {b} of a {k}-block cut")
        target = fixed_allocs if b < 0 else owned[b]
        ordinal[a] = len(target)
        target.append(a)
    items = _items(raw)
    parsed = _Parsed(tagged, pattern, items, owned, ordinal, fixed_allocs, [])
    segments = parsed.segments
    runs: list[tuple[int, list[int]]] = []  # the open sweep's runs
    direction = 0

    def close() -> None:
        nonlocal runs, direction
        if runs:
            segments.append(_Sweep(direction, dict(runs)))
        runs, direction = [], 0

    for i, (kind, index) in enumerate(items):
        tag = tagged.event_block[index] if kind == _EVENT else tagged.op_block[index]
        if kind == _OP and tag < 0:
            parsed.fixed_ops.append(index)
        if tag < 0:
            close()
            segments.append(i)
            continue
        if runs and runs[-1][0] == tag:
            runs[-1][1].append(i)
            continue
        step = 0 if not runs else (1 if tag > runs[-1][0] else -1)
        if runs and direction not in (0, step):
            close()
            step = 0
        if step:
            direction = step
        runs.append((tag, [i]))
    close()
    return parsed


def _ref(p: _Parsed, item: int, block: int) -> tuple[object, ...]:
    """What an item of ``block``'s run is: an op's record, or an event's sign, phase,
    allocation size (its category is the allocation's, see ``Composer._attributes``) and the
    allocation it refers to: ("fixed", index) or ("rel", delta, ordinal)."""
    kind, index = p.items[item]
    raw = p.tagged.raw
    if kind == _OP:
        return (_OP, raw.ops[index])
    a = raw.event_alloc[index]
    owner = p.tagged.alloc_block[a]
    ref: tuple[object, ...] = ("fixed", a) if owner < 0 else ("rel", owner - block, int(p.ordinal[a]))
    return (_EVENT, raw.event_sign[index], raw.event_phase[index], raw.alloc_bytes[a], -1, *ref)


@dataclass
class _Template:
    """The runs of one interior type in one sweep: per position, the item, and for an event
    referring to a neighbour the ordinal each witness (block, delta -> kind there) gives."""

    items: list[tuple[object, ...]]
    witnesses: list[dict[tuple[int, Hashable], int]]


class Composer:
    """Compose traces of any depth from a cut trace ``deep`` (whose interior has every pair of
    neighbouring types the stacks to compose have: the templates and witnesses come from it)
    and a shallower one, ``shallow`` (the fixed items' growth per block comes from the two),
    which must agree: :meth:`check` composes the shallow cut and compares it with its trace."""

    def __init__(self, deep: TaggedRaw, deep_pattern: Pattern, shallow: TaggedRaw, shallow_pattern: Pattern) -> None:
        if len(shallow_pattern) >= len(deep_pattern):
            raise ValueError("the shallow cut must have fewer blocks than the deep one")
        self.deep = _parse(deep, deep_pattern)
        self.shallow = _parse(shallow, shallow_pattern)
        self._templates = self._read_templates(self.deep)
        self._slopes()

    # -- reading the deep cut ------------------------------------------------------------
    def _read_templates(self, p: _Parsed) -> list[dict[bool, _Template]]:
        """Per sweep: the template of each interior type present (checked equal across the
        type's interior blocks)."""
        interior = {t: [j for j in range(1, p.k - 1) if p.pattern[j] == t] for t in set(p.pattern[1:-1])}
        raw = p.tagged.raw
        host, resized = set(raw.host), set(raw.resized)
        self._contexts: dict[bool, list[tuple[Hashable, Hashable, list[tuple[int, bool, bool]]]]] = {}
        for t, blocks in interior.items():
            lists = [[raw.alloc_bytes[a] for a in p.owned[j]] for j in blocks]
            if any(x != lists[0] for x in lists[1:]):
                raise NotComposable("interior blocks of one type allocate differently")
            # What an allocation holds, and where, may hang on the neighbours (a block's output
            # is an activation when a checkpointed block saves it, a temporary when the next
            # block casts it and saves the copy): kept per block with its neighbours' kinds.
            self._contexts[t] = [(p.kind(j - 1), p.kind(j + 1),
                                  [(raw.alloc_category[a], a in host, a in resized) for a in p.owned[j]])
                                 for j in blocks]
        out: list[dict[bool, _Template]] = []
        for segment in p.segments:
            if not isinstance(segment, _Sweep):
                continue
            by_block = segment.runs
            templates: dict[bool, _Template] = {}
            for t, blocks in interior.items():
                present = [j for j in blocks if j in by_block]
                if not present:
                    continue
                if len(present) != len(blocks):
                    raise NotComposable("interior blocks of one type differ in what they do in one pass")
                first = [_ref(p, i, blocks[0]) for i in by_block[blocks[0]]]
                witnesses: list[dict[tuple[int, Hashable], int]] = [{} for _ in first]
                for j in blocks:
                    refs = first if j == blocks[0] else [_ref(p, i, j) for i in by_block[j]]
                    if len(refs) != len(first):
                        raise NotComposable("interior blocks of one type differ in length")
                    for pos, (r, f) in enumerate(zip(refs, first)):
                        if r[0] == _EVENT and r[5] == "rel" and f[5] == "rel" and r[6] != 0 and r[:7] == f[:7]:
                            delta = r[6]
                            assert isinstance(delta, int)
                            if not 0 <= j + delta < p.k:
                                raise NotComposable("an event refers past the cut's edge")
                            key = (delta, p.kind(j + delta))
                            previous = witnesses[pos].setdefault(key, int(r[7]))  # type: ignore[call-overload]
                            if previous != r[7]:
                                raise NotComposable("interior blocks of one type refer to their neighbours differently")
                        elif r != f:
                            raise NotComposable("interior blocks of one type differ")
                templates[t] = _Template(first, witnesses)
            out.append(templates)
        return out

    def _attributes(self, t: bool, q: int, left: Hashable, right: Hashable) -> tuple[int, bool, bool]:
        """Category, host and resized of allocation ``q`` of an interior block of type ``t``
        between neighbours of kinds ``left`` and ``right``: a deep-cut block's with the same
        neighbours, else with the same right or left one, when those agree."""
        contexts = self._contexts[t]
        for match in (lambda lk, rk: lk == left and rk == right, lambda lk, rk: rk == right,
                      lambda lk, rk: lk == left, lambda lk, rk: True):
            values = {attrs[q] for lk, rk, attrs in contexts if match(lk, rk)}
            if len(values) == 1:
                return values.pop()
            if values:
                break
        raise NotComposable("what an interior block's allocation holds depends on neighbours the cut lacks")

    def _slopes(self) -> None:
        """Sizes of the fixed allocations and costs of the fixed ops per added block (the deep
        cut's are ``a``'s, the shallow cut's ``b``'s)."""
        a, b = self.deep, self.shallow
        ra, rb = a.tagged.raw, b.tagged.raw
        if len(a.fixed_allocs) != len(b.fixed_allocs) or len(a.fixed_ops) != len(b.fixed_ops):
            raise NotComposable("the allocations or ops outside the blocks change with the depth")
        if any(ra.alloc_category[x] != rb.alloc_category[y] for x, y in zip(a.fixed_allocs, b.fixed_allocs)):
            raise NotComposable("the allocations outside the blocks change with the depth")
        dk = a.k - b.k
        sa = np.array([ra.alloc_bytes[x] for x in a.fixed_allocs], dtype=np.int64)
        sb = np.array([rb.alloc_bytes[y] for y in b.fixed_allocs], dtype=np.int64)
        self._alloc_slope = (sa - sb) / dk
        self._fixed_alloc_index = {x: i for i, x in enumerate(a.fixed_allocs)}
        op_slopes: dict[int, tuple[float, float, float]] = {}
        for x, y in zip(a.fixed_ops, b.fixed_ops):
            oa, ob = ra.ops[x], rb.ops[y]
            if (oa.name, oa.phase, oa.dtype, oa.moves_data) != (ob.name, ob.phase, ob.dtype, ob.moves_data):
                raise NotComposable("the ops outside the blocks change with the depth")
            if (oa.flops, oa.bytes_moved, oa.new_bytes) != (ob.flops, ob.bytes_moved, ob.new_bytes):
                op_slopes[x] = ((oa.flops - ob.flops) / dk, (oa.bytes_moved - ob.bytes_moved) / dk,
                                (oa.new_bytes - ob.new_bytes) / dk)
        self._op_slopes = op_slopes

    # -- composing ----------------------------------------------------------------------
    def compose(self, pattern: Pattern) -> RawEvents:
        """The recorded events of the stack ``pattern`` (its first and last types those of
        the cuts'; its interior types found in the deep cut's interior)."""
        p = self.deep
        n = len(pattern)
        if n < 3:
            raise NotComposable("a stack of fewer than three blocks has no interior to compose")
        if pattern[0] != p.pattern[0] or pattern[-1] != p.pattern[-1]:
            raise NotComposable("the stack's first or last block is checkpointed unlike the cut's")
        raw = p.tagged.raw
        grow = n - p.k

        def virtual_kind(v: int) -> Hashable:
            return _EDGE_FIRST if v == 0 else _EDGE_LAST if v == n - 1 else pattern[v]

        out_bytes: list[int] = []
        out_cat: list[int] = []
        ids: dict[tuple[int, int], int] = {}
        sizes_fixed = np.rint(np.array([raw.alloc_bytes[x] for x in p.fixed_allocs], dtype=np.float64)
                              + self._alloc_slope * grow).astype(np.int64)
        if (sizes_fixed < 0).any():
            raise NotComposable("an allocation outside the blocks shrinks below zero")
        # A block's allocation list: the first cut's edge or any interior block of its type.
        interior_block = {t: next(j for j in range(1, p.k - 1) if p.pattern[j] == t) for t in set(p.pattern[1:-1])}

        def donor(v: int) -> int:
            if v == 0:
                return 0
            if v == n - 1:
                return p.k - 1
            t = pattern[v]
            if t not in interior_block:
                raise NotComposable("the cut has no interior block of the stack's types")
            return interior_block[t]

        host = set(raw.host)
        resized = set(raw.resized)
        out_host: list[int] = []
        out_resized: list[int] = []

        def alloc_id(key: tuple[int, int], nbytes: int, attributes: tuple[int, bool, bool]) -> int:
            got = ids.get(key)
            if got is None:
                got = ids[key] = len(out_bytes)
                out_bytes.append(nbytes)
                out_cat.append(attributes[0])
                if attributes[1]:
                    out_host.append(got)
                if attributes[2]:
                    out_resized.append(got)
            return got

        def own(a: int) -> tuple[int, bool, bool]:
            return raw.alloc_category[a], a in host, a in resized

        def fixed_id(a: int) -> int:
            i = self._fixed_alloc_index[a]
            return alloc_id((-1, i), int(sizes_fixed[i]), own(a))

        def block_id(v: int, q: int) -> int:
            got = ids.get((v, q))
            if got is not None:
                return got
            a = p.owned[donor(v)][q]
            if v in (0, n - 1):
                attributes = own(a)
            else:
                attributes = self._attributes(pattern[v], q, virtual_kind(v - 1), virtual_kind(v + 1))
            return alloc_id((v, q), raw.alloc_bytes[a], attributes)

        ev_alloc: list[int] = []
        ev_sign: list[int] = []
        ev_phase: list[int] = []
        ops: list[OpRecord] = []
        positions: list[int] = []

        def emit_op(op: OpRecord) -> None:
            ops.append(op)
            positions.append(len(ev_alloc))

        def emit_real(item: int, block: int, v: int) -> None:
            """An item of a cut block that is one block of the stack (an edge), or fixed."""
            kind, index = p.items[item]
            if kind == _OP:
                op = raw.ops[index]
                slope = self._op_slopes.get(index) if block < 0 else None
                if slope is not None:
                    op = replace(op, flops=int(round(op.flops + slope[0] * grow)),
                                 bytes_moved=int(round(op.bytes_moved + slope[1] * grow)),
                                 new_bytes=int(round(op.new_bytes + slope[2] * grow)))
                emit_op(op)
                return
            a = raw.event_alloc[index]
            owner = p.tagged.alloc_block[a]
            if owner < 0:
                target = fixed_id(a)
            else:
                if block < 0:
                    raise NotComposable("an event outside the blocks refers to a block's allocation")
                delta = owner - block
                u = v + delta
                if not 0 <= u < n or virtual_kind(u) != p.kind(owner):
                    raise NotComposable("an edge block refers to a neighbour unlike the cut's")
                target = block_id(u, int(p.ordinal[a]))
            ev_alloc.append(target)
            ev_sign.append(raw.event_sign[index])
            ev_phase.append(raw.event_phase[index])

        def emit_template(template: _Template, v: int) -> None:
            for pos, item in enumerate(template.items):
                if item[0] == _OP:
                    op = item[1]
                    assert isinstance(op, OpRecord)
                    emit_op(op)
                    continue
                _, sign, phase, _, _, ref_kind, *rest = item
                if ref_kind == "fixed":
                    target = fixed_id(int(rest[0]))  # type: ignore[call-overload]
                else:
                    delta, q = int(rest[0]), int(rest[1])  # type: ignore[call-overload]
                    u = v + delta
                    if not 0 <= u < n:
                        raise NotComposable("an event refers past the stack's edge")
                    if delta:
                        found = template.witnesses[pos].get((delta, virtual_kind(u)))
                        if found is None:
                            raise NotComposable("the cut has no block with such a neighbour")
                        q = found
                    target = block_id(u, q)
                ev_alloc.append(target)
                ev_sign.append(sign)  # type: ignore[arg-type]
                ev_phase.append(phase)  # type: ignore[arg-type]

        sweep = 0
        for segment in p.segments:
            if not isinstance(segment, _Sweep):
                emit_real(segment, -1, -1)
                continue
            direction, by_block = segment.direction, segment.runs
            templates = self._templates[sweep]
            sweep += 1
            if direction == 0:
                # One run: an edge's (an interior one would be one of several, see _read_templates).
                (only,) = by_block
                if 0 < only < p.k - 1:
                    raise NotComposable("an interior block acts alone, with no direction to repeat it in")
                direction = 1
            order = range(n) if direction > 0 else range(n - 1, -1, -1)
            for v in order:
                if v == 0 or v == n - 1:
                    j = 0 if v == 0 else p.k - 1
                    for item in by_block.get(j, ()):
                        emit_real(item, j, v)
                elif pattern[v] in templates:
                    emit_template(templates[pattern[v]], v)
        return RawEvents(alloc_bytes=out_bytes, alloc_category=out_cat, event_alloc=ev_alloc, event_sign=ev_sign,
                         event_phase=ev_phase, phase_labels=list(raw.phase_labels), ops=ops,
                         op_positions=positions, host=out_host, op_workspace=None, resized=out_resized)

    def trace(self, pattern: Pattern, config: TrainConfig, batch_size: int) -> Trace:
        """The composed trace of the stack ``pattern`` for ``config``, finished as a traced
        one is (later steps derived, frees in canonical order)."""
        t = self.deep.tagged
        return finish_trace(self.compose(pattern), config, batch_size, t.method, t.notes, derive=t.derive)

    def check(self, config: TrainConfig, batch_size: int, shallow: Trace) -> str | None:
        """None when the shallow cut composed from the deep one equals its trace; else how not."""
        return same_trace(self.trace(self.shallow.pattern, config, batch_size), shallow)


def compose_trace(deep: Trace, deep_pattern: Pattern, shallow: Trace, shallow_pattern: Pattern,
                  pattern: Pattern, config: TrainConfig | None = None) -> Trace:
    """The trace of the stack ``pattern`` for ``config`` (default: the cuts') from the cut traces
    ``deep`` and ``shallow`` (checked against ``shallow``); :class:`~._depth.NotComposable` when
    they do not agree."""
    config = config or deep.config
    return _checked_composer(deep, deep_pattern, shallow, shallow_pattern, config).trace(pattern, config,
                                                                                       deep.batch_size)


def _checked_composer(deep: Trace, deep_pattern: Pattern, shallow: Trace, shallow_pattern: Pattern,
                      config: TrainConfig) -> Composer:
    """The composer of two cut traces that agree (:class:`~._depth.NotComposable` if not)."""
    assert deep.tagged is not None and shallow.tagged is not None
    composer = Composer(deep.tagged, deep_pattern, shallow.tagged, shallow_pattern)
    why = composer.check(config, deep.batch_size, shallow)
    if why is not None:
        raise NotComposable(f"the shallow cut composed from the deep one differs from its trace: {why}")
    return composer


def same_trace(x: Trace, y: Trace) -> str | None:
    """None when two traces have the same allocations, events, ops and host allocations (and
    the same step without accumulation); else the first difference. The bytes an op that runs
    no kernel would move are not compared: nothing reads them."""
    for name in ("alloc_bytes", "alloc_category", "event_alloc", "event_sign", "event_phase", "host_allocs"):
        u, w = getattr(x, name), getattr(y, name)
        if len(u) != len(w):
            return f"{name}: {len(u)} vs {len(w)}"
        if not np.array_equal(u, w):
            i = int(np.argmax(np.asarray(u) != np.asarray(w)))
            return f"{name}[{i}]: {u[i]} vs {w[i]}"
    if x.phase_labels != y.phase_labels:
        return "phase labels"
    if len(x.ops) != len(y.ops):
        return f"ops: {len(x.ops)} vs {len(y.ops)}"
    for i, (o, q) in enumerate(zip(x.ops, y.ops)):
        # An op that runs no kernel (a view, a metadata query) costs nothing whatever the
        # bytes of its inputs (a view of a DDP bucket holding every gradient): not composed.
        if o != q and (o.moves_data or q.moves_data or replace(o, bytes_moved=q.bytes_moved) != q):
            return f"op {i}: {o} vs {q}"
    if list(x.op_positions) != list(y.op_positions):
        i = next(i for i, (u, w) in enumerate(zip(x.op_positions, y.op_positions)) if u != w)
        return f"op position {i}: {x.op_positions[i]} vs {y.op_positions[i]}"
    if (x.single_micro is None) != (y.single_micro is None):
        return "one has a step without accumulation, the other not"
    if x.single_micro is not None and y.single_micro is not None:
        why = same_trace(x.single_micro, y.single_micro)
        if why is not None:
            return f"without accumulation: {why}"
    return None


def stack_pattern(n_blocks: int, segments: int) -> Pattern:
    """Which blocks of a stack of ``n_blocks`` ``segments`` checkpoints (``select_blocks``)."""
    from ..runtime._checkpoint import select_blocks

    chosen = set(select_blocks(n_blocks, segments))
    return tuple(i in chosen for i in range(n_blocks))


def cut_patterns(pattern: Pattern, *, gain: bool = True) -> tuple[Pattern, Pattern] | None:
    """The two cuts to compose the stack ``pattern`` from: the deep one, the stack's first and
    last blocks around the shortest interior that has every pair of neighbours the stack's
    interior has (so that each interior block's references to its neighbours have a
    witness), and a shallower one, the shortest with some of those pairs and every interior
    type (so that each type's runs are composed once and checked). None when the stack has no
    interior of two blocks, or (``gain``) the cuts would hold as many blocks as the stack;
    ``gain=False`` composes small stacks too, to check composition on small models."""
    n = len(pattern)
    inner = pattern[1:-1]
    if len(inner) < 2:
        return None
    pairs = frozenset(zip(inner, inner[1:]))
    deep = _shortest(inner[0], inner[-1], pairs, pairs, set(inner), 2)
    if deep is None:
        return None
    shallow = _shortest(inner[0], inner[-1], frozenset(), frozenset(zip(deep, deep[1:])), set(inner), 1)
    if shallow is None or len(shallow) >= len(deep):
        return None
    cuts = ((pattern[0], *deep, pattern[-1]), (pattern[0], *shallow, pattern[-1]))
    return cuts if len(cuts[0]) + len(cuts[1]) < n or not gain else None


def _shortest(start: bool, end: bool, needed: frozenset[tuple[bool, bool]], allowed: frozenset[tuple[bool, bool]],
              types: set[bool], at_least: int) -> tuple[bool, ...] | None:
    """The shortest sequence of at least ``at_least`` types from ``start`` to ``end`` with
    every one of ``types``, whose neighbour pairs are all ``allowed`` and include every one
    ``needed`` (breadth first)."""
    State = tuple[tuple[bool, ...], frozenset[tuple[bool, bool]]]
    frontier: list[State] = [((start,), frozenset())]
    for _ in range(at_least + 8):
        grown: list[State] = []
        for seq, seen in frontier:
            if len(seq) >= at_least and seq[-1] == end and seen >= needed and types <= set(seq):
                return seq
            for t in (False, True):
                pair = (seq[-1], t)
                if pair in allowed:
                    grown.append(((*seq, t), seen | {pair}))
        # One sequence per (last type, types and pairs seen): the rest grow the same way.
        unique: dict[tuple[bool, frozenset[bool], frozenset[tuple[bool, bool]]], State] = {}
        for seq, seen in grown:
            unique.setdefault((seq[-1], frozenset(seq), seen), (seq, seen))
        frontier = list(unique.values())
    return None


# -- the estimator's way in -----------------------------------------------------------------

def compose_enabled() -> bool:
    """Is composition of the block stack on (``MEMPLAN_FULL_TRACE`` unset or 0)?"""
    return os.environ.get(FULL_TRACE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class StackFacts:
    """A task's block stack as composition sees it (``stack_facts``)."""

    blocks: int
    differs: str | None
    """Why the blocks are not all the same module with the same shapes (None: they are)."""
    params: int
    """Parameters of the whole model (what a trace of it costs grows with them)."""


def stack_facts(task: Task) -> StackFacts:
    """The task's block stack: its blocks, whether they are the same, the model's parameters
    (from the model built on the meta device; kept on the task, a property of the model)."""
    key = ("block stack", "composition")
    cached = task._cache.get(key)
    if isinstance(cached, StackFacts):
        return cached
    facts: StackFacts
    model = task.prebuilt
    if model is None:
        try:
            with torch.device("meta"):
                model = task.build_model()
        except Exception as exc:  # noqa: BLE001 - traced whole; a broken model raises there
            facts = StackFacts(0, f"the model cannot be built on the meta device ({type(exc).__name__})", 0)
    if model is not None:
        params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        try:
            blocks = find_block_stack(model, task.checkpoint_blocks)
        except Exception as exc:  # noqa: BLE001 - a model file's finder that fails: traced whole
            facts = StackFacts(0, f"checkpoint_blocks failed ({type(exc).__name__})", params)
        else:
            facts = StackFacts(len(blocks), block_differences(blocks) if len(blocks) > 1 else None, params)
    task._cache[key] = facts
    return facts


def _checkpointed(pattern: Pattern) -> tuple[int, ...]:
    return tuple(i for i, c in enumerate(pattern) if c)


CutTracer = Callable[[DepthCut, DepthCut], tuple[Trace, Trace]]
"""``trace(deep, shallow)``: the traces of the two cuts (the estimator may make one in its
worker process meanwhile)."""


CutCache = dict[Hashable, "Trace | Composer | str"]
"""Cut traces, and the composers of pairs that agree, kept for later compositions (see
:func:`trace_composed`)."""


def _cut_key(config: TrainConfig, batch_size: int, target: str, capability: tuple[int, int] | None,
             cut: DepthCut) -> Hashable:
    # A cut checkpoints its own blocks: stacks checkpointed alike (2, 4 or 8 of 32 blocks, say)
    # trace the same cuts.
    return (config.replace(checkpoint_segments=0, checkpoint_policy="full"), config.checkpoint_policy,
            batch_size, target, capability, cut)


def _trace_or_none(value: object) -> Trace | None:
    return value if isinstance(value, Trace) else None


def trace_composed(task: Task, config: TrainConfig, *, batch_size: int, target: str = "cpu",
                   capability: tuple[int, int] | None = None, trace: Callable[..., Trace] = trace_step,
                   trace_cuts: CutTracer | None = None, gain: bool = True, cache: CutCache | None = None) -> Trace:
    """The fake trace of ``config`` at micro-batch ``batch_size``: composed from two traces
    of the model cut short when its block stack is deep enough to gain (:func:`cut_patterns`),
    else traced whole; a note says which, and why a stack that could gain was traced whole.
    Shapes that depend on data raise ``DataDependentShapes`` either way. ``trace`` is
    ``trace_step`` (or what stands for it); ``trace_cuts`` traces the two cuts (default: one
    after the other, with ``trace``); ``gain=False``: see :func:`cut_patterns`. ``cache`` keeps
    the cut traces, for configurations that differ in which blocks are checkpointed only."""
    def one(cut: DepthCut | None) -> Trace:
        kwargs = {"cut": cut} if cut is not None else {}
        return trace(task, config, batch_size=batch_size, target=target, capability=capability, **kwargs)

    def whole(note: str | None) -> Trace:
        traced = one(None)
        if note is not None:
            traced.notes = (*traced.notes, note)
        return traced

    if config.pp > 1:
        return whole(None)  # each stage is traced whole: its blocks are a part of the stack
    facts = stack_facts(task)
    if facts.blocks < 3:
        return whole(None)
    pattern = stack_pattern(facts.blocks, config.checkpoint_segments)
    cuts = cut_patterns(pattern, gain=gain)
    if cuts is None:
        return whole(None)
    if facts.differs is not None:
        return whole(f"block stack traced whole: {facts.differs}")
    deep_pattern, shallow_pattern = cuts
    deep_cut, shallow_cut = (DepthCut(len(p), _checkpointed(p)) for p in cuts)
    keys = [_cut_key(config, batch_size, target, capability, c) for c in (deep_cut, shallow_cut)]
    # A stack refused once is refused for the other batch sizes and checkpoint settings of the
    # layout (what refuses it is how its blocks refer to one another): their cuts are not traced
    # again just to be refused. At worst a composable setting is traced whole, as without cuts.
    layout = ("refused", config.replace(micro_batch_size=1, grad_accum_steps=1, checkpoint_segments=0,
                                        checkpoint_policy="full"), target, capability)
    refused = cache.get(layout) if cache is not None else None
    if isinstance(refused, str):
        return whole(refused)
    try:
        kept = [_trace_or_none(cache.get(k)) for k in keys] if cache is not None else [None, None]
        if kept[0] is None and kept[1] is None and trace_cuts is not None:
            deep, shallow = trace_cuts(deep_cut, shallow_cut)
        else:
            deep = kept[0] if kept[0] is not None else one(deep_cut)
            shallow = kept[1] if kept[1] is not None else one(shallow_cut)
        if cache is not None:
            cache[keys[0]], cache[keys[1]] = deep, shallow
        pair = ("composer", keys[0], keys[1])
        composer = cache.get(pair) if cache is not None else None
        if not isinstance(composer, Composer):
            composer = _checked_composer(deep, deep_pattern, shallow, shallow_pattern, config)
            if cache is not None:
                cache[pair] = composer
        composed = composer.trace(pattern, config, batch_size)
    except DataDependentShapes:
        raise
    except MemplanError as exc:
        note = f"block stack traced whole: {exc}"
        if cache is not None:
            cache[layout] = note
        return whole(note)
    except Exception as exc:  # noqa: BLE001 - composition must never cost an estimate
        note = f"block stack traced whole: composing failed ({type(exc).__name__}: {exc})"
        if cache is not None:
            cache[layout] = note
        return whole(note)
    composed.notes = (*composed.notes, f"block stack: {facts.blocks} blocks composed from traces of "
                                       f"{deep_cut.keep} and {shallow_cut.keep}, which agree")
    return composed
