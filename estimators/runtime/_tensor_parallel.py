"""Tensor parallelism: which linears of a model split over ``tp`` processes, and splitting them.

A block's attention and MLP each become a column-wise split (the projections that fan out:
q/k/v, up/gate; each rank computes ``1/tp`` of the heads or of the hidden units) followed by a
row-wise split (the projection back: o, down; each rank's partial product is summed by one
all-reduce), as Megatron-LM and torchtitan split them, with DTensor's ``ColwiseParallel`` and
``RowwiseParallel``. The activations between the two stay plain local tensors of ``1/tp`` the
width; everything outside the pairs (embeddings, norms) is replicated, and its gradients
need no reduction, since every rank of a group sees the same batch. A language model's head is
split over the vocabulary (``_loss_parallel``). The replicated
parameters are DTensors too (``Replicate`` on the ``tp`` mesh; their modules take and give
plain tensors, as torchtitan's ``NoParallel`` does): an optimizer's multi-tensor kernels and
FSDP2 want every parameter of one kind, on one mesh.

Which modules split, first found wins:

1. the model file's ``tp_plan(model) -> {pattern: "colwise" | "rowwise"}``;
2. a Hugging Face model's own ``base_model_tp_plan`` (its config's), "colwise"/"rowwise"
   entries only (the others, e.g. ``colwise_rep`` for the head, stay replicated);
3. inferred: in each block of the block stack, a module whose linear children all have the
   names of a known column-wise or row-wise role (``q_proj``, ``wk``, ``fc1``, ``up_proj`` ...;
   ``o_proj``, ``wo``, ``fc2``, ``down_proj`` ...) and that has both kinds splits them. A fused
   q/k/v projection (``c_attn``, ``qkv``) is not split: its column-wise shards would cut
   across q, k and v, so its module stays replicated.

Patterns match a module's dotted name, ``*`` one part of it (``layers.*.attn.wq``), and may
match its end (a Hugging Face plan names modules below the base model).

The head counts of a split attention (``n_heads``, ``num_key_value_heads`` ... on the module
that holds the column-wise linears) are divided by ``tp``, as torchtitan does, so that code
that reshapes by them sees its local heads. What is left that does not fit (a reshape by the
full width) fails the traced step, and tensor parallelism is refused for the model with the
reason.

Sequence parallelism (``TrainConfig.sequence_parallel``, Megatron-LM's, torchtitan's
``SequenceParallel``): between the split pairs the block stack's residual stream is sharded
on the sequence (dimension 1: hidden states are ``(batch, sequence, ...)``), so that the norms
there, the residual adds and the inputs a checkpointed block keeps are ``1/tp`` of their size
on each rank. The first block's hidden states are cut (each rank keeps its part: no
communication), each split pair all-gathers them before its column-wise linears and its
row-wise linear reduce-scatters where it would all-reduce (the same bytes), and the last
block's output is gathered again for what follows the stack (the last norm, the head, the
loss). What runs between the pairs must work on each position alone: only norms may hold
parameters there (anything else is refused with its name), and the blocks must run one after
another on each other's outputs, as a layer loop does. A norm's weight then gets a partial
gradient from each rank's part of the sequence, all-reduced as it is accumulated.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn

from .._errors import ConfigError
from ._checkpoint import BlockFinder, find_block_stack
from ._loss_parallel import find_head, split_head

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TpStyle", "TpPlan", "TpPlanHook", "resolve_tp_plan", "apply_tp", "sequence_parallel_refusal",
           "HEAD_ATTRIBUTES", "SEQUENCE_DIM"]

TpStyle = Literal["colwise", "rowwise"]
TpPlanHook = Callable[[nn.Module], Mapping[str, str]]

# The names the common model codes give their projections (Hugging Face, torchtitan/Llama,
# GPT-2/NeoX, T5, BERT-style, diffusers). Lowercase, the module's own name.
_COLWISE = frozenset({
    "q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "wq", "wk", "wv",
    "to_q", "to_k", "to_v", "gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "wi",
    "wi_0", "wi_1", "lin1", "dense_h_to_4h", "gate", "up",
})
_ROWWISE = frozenset({
    "o_proj", "out_proj", "o", "wo", "c_proj", "fc2", "fc_out", "w2", "down_proj", "lin2",
    "dense_4h_to_h", "down", "proj", "out",
})
HEAD_ATTRIBUTES = ("n_heads", "num_heads", "n_head", "num_attention_heads", "n_kv_heads", "num_key_value_heads",
                   "n_kv_head", "num_kv_heads", "nheads", "heads", "kv_heads")
"""Attributes of an attention module that count its heads: divided by ``tp`` when it splits."""


@dataclass(frozen=True, slots=True)
class TpPlan:
    """Each split linear's dotted name and style, and where the plan came from."""

    styles: dict[str, TpStyle]
    source: str
    """``tp_plan(model)``, ``base_model_tp_plan`` or ``inferred``."""
    head: str | None = None
    """The head split over the vocabulary (``_loss_parallel``), if any."""
    head_note: str | None = None
    """Why the model's head is not split, where it has one."""

    @property
    def split(self) -> set[str]:
        """The names of every linear the plan splits, the head's included."""
        return set(self.styles) | ({self.head} if self.head else set())


def resolve_tp_plan(model: nn.Module, tp: int, *, hook: TpPlanHook | None = None,
                    finder: BlockFinder | None = None) -> TpPlan:
    """The plan that splits ``model`` over ``tp`` ranks; raises ``ConfigError`` naming why it
    cannot be split (nothing to split, or a width or head count that ``tp`` does not divide)."""
    if hook is not None:
        raw = hook(model)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"tp_plan(model) must return a dict of module pattern -> 'colwise'/'rowwise', "
                              f"got {type(raw).__name__}")
        styles = _match(model, raw, strict=True)
        source = "tp_plan(model)"
    else:
        hf = _hf_plan(model)
        if hf:
            styles, source = _match(model, hf, strict=False), "base_model_tp_plan"
        else:
            styles, source = _infer(model, finder), "inferred"
    if not styles:
        raise ConfigError(
            "tensor parallelism found nothing to split in this model (no attention or MLP linears named "
            "like q_proj/k_proj/v_proj/o_proj or fc1/fc2, up_proj/down_proj); define "
            "tp_plan(model) -> {'layers.*.attn.wq': 'colwise', ...} in the model file, or use tp=1")
    _check_divisible(model, styles, tp)
    head, head_note = find_head(model, tp, split=set(styles), finder=finder)
    return TpPlan(styles, source, head, head_note)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TpPlan, *, sequence_parallel: bool = False,
             finder: BlockFinder | None = None) -> nn.Module:
    """Split ``plan``'s linears over the 1-D ``mesh`` (in place) and divide the head counts of
    the modules that hold the column-wise ones; with ``sequence_parallel``, also shard the
    sequence between the split pairs of the block stack (``finder`` names it, as for
    checkpointing). Returns ``model``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    modules = dict(model.named_modules())
    parents = _parents(plan)
    owners = _owners(model, plan.split)
    blocks: list[nn.Module] = []
    stream: set[str] = set()
    if sequence_parallel:
        blocks, stream = _sequence_region(model, plan, parents, owners, finder)
    for parent_name in parents:
        parent = modules[parent_name]
        for attr in HEAD_ATTRIBUTES:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // tp)
    # Sequence parallel: the row-wise linear reduce-scatters its partial sums over the
    # sequence instead of all-reducing them (the same bytes, a 1/tp output).
    rowwise = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM)) if sequence_parallel else RowwiseParallel()
    parallelize_module(model, mesh, {name: ColwiseParallel() if style == "colwise" else rowwise
                                     for name, style in plan.styles.items()})
    if plan.head is not None:
        split_head(model, mesh, plan.head)
    _replicate_the_rest(model, mesh, owners, stream)
    if sequence_parallel:
        for name in parents:
            modules[name].register_forward_pre_hook(_gathered_sequence(mesh), with_kwargs=True)
        _shard_the_stream(blocks, mesh)
        _gradients_as_their_parameters(model)
    return model


def sequence_parallel_refusal(model: nn.Module, plan: TpPlan, *, finder: BlockFinder | None = None) -> str | None:
    """Why ``model`` split by ``plan`` cannot also shard its sequence (None: it can, as far as
    its modules tell; the traced step checks the shapes). ``model`` may be on meta."""
    parents = _parents(plan)
    try:
        _sequence_region(model, plan, parents, _owners(model, plan.split), finder)
    except ConfigError as exc:
        return str(exc)
    return None


def _parents(plan: TpPlan) -> list[str]:
    """The modules that hold a split pair (its column-wise linears)."""
    return list(dict.fromkeys(name.rsplit(".", 1)[0] for name, style in plan.styles.items()
                              if style == "colwise" and "." in name))


def _owners(model: nn.Module, split: set[str]) -> list[str]:
    """The outermost modules that hold parameters the split leaves (each replicated); raises
    when one of them also holds split linears."""
    owners: list[str] = []
    for name, module in model.named_modules():
        if name in split:
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        inside = [s for s in split if s.startswith(f"{name}.") or not name]
        if inside:
            raise ConfigError(
                f"tensor parallelism: {name or 'the model'} holds parameters of its own ({own[0]}) beside split "
                f"linears ({inside[0]}); move them into a submodule, or use tp=1")
        if not any(name.startswith(f"{o}.") or not o for o in owners):
            owners.append(name)
    return owners


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh, owners: list[str], stream: set[str]) -> None:
    """Every parameter the split left plain becomes a replicated DTensor (a tied one once, in
    every module that holds it); the ``owners`` convert their tensor inputs to replicated
    DTensors (those in the sequence-parallel ``stream``: to DTensors sharded on the
    sequence) and their DTensor outputs back to local tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    replicas: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for n, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            if id(p) not in replicas:
                replicas[id(p)] = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                                               requires_grad=p.requires_grad)
            setattr(module, n, replicas[id(p)])
    modules = dict(model.named_modules())
    if owners:
        # A DTensor's local tensor is a view of it: FSDP2 warns of every forward whose output is
        # one (an in-place op on it would skip its backward hook) -- here, each step's logits
        # when the head is replicated. The step never changes them in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)
    for name in owners:
        modules[name].register_forward_pre_hook(_dtensor_inputs(mesh, sharded=name in stream), with_kwargs=True)
        modules[name].register_forward_hook(_local_outputs)


def _dtensor_inputs(mesh: DeviceMesh, *, sharded: bool
                    ) -> Callable[..., tuple[tuple[object, ...], dict[str, object]]]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.utils._pytree import tree_map

    def to_dtensor(t: object) -> object:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            # A norm of the sequence-parallel stream sees its rank's part of the sequence: its
            # weight's gradient is then a partial sum (see _gradients_as_their_parameters).
            placement = Shard(SEQUENCE_DIM) if sharded and t.dim() > SEQUENCE_DIM else Replicate()
            return DTensor.from_local(t, mesh, [placement], run_check=False)
        return t

    def hook(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
             ) -> tuple[tuple[object, ...], dict[str, object]]:
        return tree_map(to_dtensor, args), tree_map(to_dtensor, kwargs)

    return hook


def _local_outputs(_module: nn.Module, _args: object, output: object) -> object:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, output)


SEQUENCE_DIM = 1
"""The sequence dimension of the hidden states between blocks (batch first, as Hugging Face's
and torchtitan's models keep them)."""

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)
_HIDDEN_NAMES = ("hidden_states", "hidden", "x", "h", "input", "inputs", "inputs_embeds")


def _is_norm(module: nn.Module) -> bool:
    # A norm works on each token alone: on a part of the sequence it computes that part's
    # output exactly (its weight's gradient is a partial sum, which is reduced).
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith(("Norm", "LayerNorm", "RMSNorm"))


def _sequence_region(model: nn.Module, plan: TpPlan, parents: list[str], owners: list[str],
                     finder: BlockFinder | None) -> tuple[list[nn.Module], set[str]]:
    """The block stack whose residual stream is sharded on the sequence, and the owners of
    replicated parameters that see it (norms only); raises ``ConfigError`` naming what would
    see a part of the sequence where it needs all of it."""
    why = "use sequence_parallel=False"
    try:
        blocks = find_block_stack(model, finder)
    except ConfigError:
        blocks = []
    if not blocks:
        raise ConfigError("sequence parallelism shards the residual stream of the model's block stack, and none "
                          f"was found; define checkpoint_blocks(model) in the model file, or {why}")
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]

    def block_of(name: str) -> str | None:
        return next((b for b in block_names if name.startswith(f"{b}.") or not b), None)

    def in_pair(name: str) -> bool:
        return any(name == p or name.startswith(f"{p}.") for p in parents)

    for name in parents:
        if name in block_names:
            raise ConfigError(
                f"sequence parallelism: the block {name} holds its split linears itself, so no module of it takes the "
                f"sequence to gather before them (its attention and MLP would need modules of their own); {why}")
    for name, style in plan.styles.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if block_of(name) is None or parent not in parents:
            raise ConfigError(
                f"sequence parallelism: {name} ({style}) is not in a module of the block stack that holds both the "
                f"column-wise and the row-wise linears of its pair; {why}")
    modules = dict(model.named_modules())
    stream = {o for o in owners if block_of(o) is not None and not in_pair(o)}
    for name in sorted(stream):
        if not _is_norm(modules[name]):
            raise ConfigError(
                f"sequence parallelism: {name} ({type(modules[name]).__name__}) would see 1/tp of the sequence "
                f"between the split pairs, where only norms may; {why}")
    return blocks, stream


def _hidden_of(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[int | str, torch.Tensor] | None:
    """Where a block's (or a pair's) hidden states are among its arguments, and they: the
    first positional tensor, else the first keyword named like them."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    for k in _HIDDEN_NAMES:
        value = kwargs.get(k)
        if isinstance(value, torch.Tensor):
            return k, value
    return None


def _with_hidden(args: tuple[object, ...], kwargs: dict[str, object], where: int | str, value: object
                 ) -> tuple[tuple[object, ...], dict[str, object]]:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1:]), kwargs
    return args, {**kwargs, where: value}


def _gathered_sequence(mesh: DeviceMesh) -> Callable[..., tuple[tuple[object, ...], dict[str, object]] | None]:
    """A split pair's input hook: its rank's part of the sequence all-gathered into a
    replicated DTensor, which the column-wise linears take as it is, so that backward sums
    their partial input gradients with one reduce-scatter (Megatron's "g")."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
             ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        found = _hidden_of(args, kwargs)
        if found is None:
            return None
        where, hidden = found
        if isinstance(hidden, DTensor):
            return None
        full = DTensor.from_local(hidden, mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
            mesh, [Replicate()])
        return _with_hidden(args, kwargs, where, full)

    return hook


def _shard_the_stream(blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """The block stack's hidden states enter sharded on the sequence (each rank keeps its
    part: no communication) and leave it gathered, so that what runs before and after the
    stack (embeddings, the last norm, the head, the loss) sees whole sequences."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = mesh.size()
    full_length: list[int] = [0]

    def enter(index: int) -> Callable[..., tuple[tuple[object, ...], dict[str, object]] | None]:
        def hook(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
                 ) -> tuple[tuple[object, ...], dict[str, object]] | None:
            found = _hidden_of(args, kwargs)
            if found is None:
                raise ConfigError("sequence parallelism: a block of the block stack was called without a tensor "
                                  "of hidden states; use sequence_parallel=False")
            where, hidden = found
            # (batch, features) has no sequence: sharding its features would give a norm
            # between the pairs half of what it normalises over.
            if hidden.dim() < 3:
                raise ConfigError(f"sequence parallelism: the blocks' hidden states have shape {tuple(hidden.shape)}, "
                                  "not (batch, sequence, ...); use sequence_parallel=False")
            length = hidden.shape[SEQUENCE_DIM]
            if index == 0:
                full_length[0] = length
            elif length * tp == full_length[0]:
                return None  # the previous block's output, already a part of the sequence
            elif length != full_length[0]:
                raise ConfigError(
                    f"sequence parallelism: block {index} got hidden states of {length} positions where the first "
                    f"block got {full_length[0]}; use sequence_parallel=False")
            if length % tp:
                raise ConfigError(f"sequence parallelism splits the sequence of {length} positions over tp {tp}, "
                                  "which does not divide it; pad the sequences to a multiple of tp, or use "
                                  "sequence_parallel=False")
            part = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False).redistribute(
                mesh, [Shard(SEQUENCE_DIM)]).to_local()
            return _with_hidden(args, kwargs, where, part)

        return hook

    def leave(_module: nn.Module, _args: object, output: object) -> object:
        def gathered(t: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(t, mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
                mesh, [Replicate()]).to_local()

        if isinstance(output, torch.Tensor):
            return gathered(output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([gathered(output[0]), *output[1:]])
        raise ConfigError("sequence parallelism: the last block returns neither its hidden states nor a tuple "
                          "that starts with them; use sequence_parallel=False")

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(enter(index), with_kwargs=True)
    blocks[-1].register_forward_hook(leave)


def _gradients_as_their_parameters(model: nn.Module) -> None:
    """A replicated parameter used on a part of the sequence (a norm's weight, a row-wise
    bias) gets a partial-sum gradient; it is all-reduced into the parameter's placement as
    soon as it is accumulated, so that clipping and the optimizer see whole gradients. (FSDP2
    does the same for its own parameters, which replace these.)"""
    from torch.distributed.tensor import DTensor

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def _pattern(key: str) -> re.Pattern[str]:
    # "layers.*.attn.wq": a dotted name; "*" is one part. A plan written below the base model
    # (Hugging Face's) matches the end of a name.
    body = r"[^.]+".join(re.escape(part) for part in key.split("*"))
    return re.compile(rf"(?:.*\.)?{body}")


def _match(model: nn.Module, raw: Mapping[str, str], *, strict: bool) -> dict[str, TpStyle]:
    styles: dict[str, TpStyle] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for key, style in raw.items():
        if style not in ("colwise", "rowwise"):
            if strict:
                raise ConfigError(f"tp_plan(model): {key!r} has style {style!r}; use 'colwise' or 'rowwise'")
            continue  # a Hugging Face style this split does not use: the module stays replicated
        pattern = _pattern(str(key))
        hits = [name for name in linears if pattern.fullmatch(name)]
        if not hits and strict:
            raise ConfigError(f"tp_plan(model): {key!r} matches no nn.Linear of the model; name a linear by its "
                              "dotted name, '*' for one part (e.g. 'layers.*.attn.wq')")
        for name in hits:
            styles[name] = style  # type: ignore[assignment]  # checked above
    return styles


def _hf_plan(model: nn.Module) -> Mapping[str, str] | None:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    return plan if isinstance(plan, Mapping) and plan else None


def _infer(model: nn.Module, finder: BlockFinder | None) -> dict[str, TpStyle]:
    names = {id(m): name for name, m in model.named_modules()}
    try:
        blocks = find_block_stack(model, finder)
    except Exception:  # noqa: BLE001 - no block stack: nothing is inferred
        return {}
    styles: dict[str, TpStyle] = {}
    for block in blocks:
        for module in block.modules():
            children = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
            kinds = [_role(n) for n, _ in children]
            if not children or None in kinds or "colwise" not in kinds or "rowwise" not in kinds:
                continue
            base = names[id(module)]
            for (n, _), kind in zip(children, kinds):
                assert kind is not None
                styles[f"{base}.{n}" if base else n] = kind
    return styles


def _role(name: str) -> TpStyle | None:
    key = name.lower()
    if key in _COLWISE:
        return "colwise"
    if key in _ROWWISE:
        return "rowwise"
    return None


def _check_divisible(model: nn.Module, styles: Mapping[str, TpStyle], tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in styles.items():
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        width = linear.out_features if style == "colwise" else linear.in_features
        if width % tp:
            side = "outputs" if style == "colwise" else "inputs"
            raise ConfigError(f"tensor parallelism: {name} has {width} {side}, which tp {tp} does not divide; "
                              "use a tp that divides it")
        if style == "colwise" and "." in name:
            parent_name = name.rsplit(".", 1)[0]
            for attr in HEAD_ATTRIBUTES:
                value = getattr(modules[parent_name], attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                    raise ConfigError(f"tensor parallelism: {parent_name}.{attr} is {value}, which tp {tp} does "
                                      "not divide; use a tp that divides the head count")
