"""Tensor parallelism: which linears of a model split over ``tp`` processes, and splitting them.

A block's attention and MLP each become a column-wise split (the projections that fan out:
q/k/v, up/gate; each rank computes ``1/tp`` of the heads or of the hidden units) followed by a
row-wise split (the projection back: o, down; each rank's partial product is summed by one
all-reduce), as Megatron-LM and torchtitan split them, with DTensor's ``ColwiseParallel`` and
``RowwiseParallel``. The activations between the two stay plain local tensors of ``1/tp`` the
width; everything outside the pairs (embeddings, norms, the head) is replicated, and its
gradients need no reduction, since every rank of a group sees the same batch. The replicated
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

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TpStyle", "TpPlan", "TpPlanHook", "resolve_tp_plan", "apply_tp", "HEAD_ATTRIBUTES"]

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
    return TpPlan(styles, source)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TpPlan) -> nn.Module:
    """Split ``plan``'s linears over the 1-D ``mesh`` (in place) and divide the head counts of
    the modules that hold the column-wise ones; returns ``model``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    modules = dict(model.named_modules())
    for parent_name in dict.fromkeys(name.rsplit(".", 1)[0] for name, style in plan.styles.items()
                                     if style == "colwise" and "." in name):
        parent = modules[parent_name]
        for attr in HEAD_ATTRIBUTES:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // tp)
    parallelize_module(model, mesh, {name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
                                     for name, style in plan.styles.items()})
    _replicate_the_rest(model, mesh, set(plan.styles))
    return model


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh, split: set[str]) -> None:
    """Every parameter the split left plain becomes a replicated DTensor (a tied one once, in
    every module that holds it); the outermost modules that hold them convert their tensor
    inputs to replicated DTensors and their DTensor outputs back to local tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    replicas: dict[int, nn.Parameter] = {}
    owners: list[str] = []
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        inside = [s for s in split if s.startswith(f"{name}.") or not name]
        if inside:
            raise ConfigError(
                f"tensor parallelism: {name or 'the model'} holds parameters of its own ({own[0][0]}) beside split "
                f"linears ({inside[0]}); move them into a submodule, or use tp=1")
        for n, p in own:
            if id(p) not in replicas:
                replicas[id(p)] = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                                               requires_grad=p.requires_grad)
            setattr(module, n, replicas[id(p)])
        if not any(name.startswith(f"{o}.") or not o for o in owners):
            owners.append(name)
    modules = dict(model.named_modules())
    if owners:
        # A DTensor's local tensor is a view of it: FSDP2 warns of every forward whose output is
        # one (an in-place op on it would skip its backward hook) -- here, each step's logits
        # when the head is replicated. The step never changes them in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)
    for name in owners:
        modules[name].register_forward_pre_hook(_replicated_inputs(mesh), with_kwargs=True)
        modules[name].register_forward_hook(_local_outputs)


def _replicated_inputs(mesh: DeviceMesh) -> Callable[..., tuple[tuple[object, ...], dict[str, object]]]:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map

    def to_replicated(t: object) -> object:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t

    def hook(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
             ) -> tuple[tuple[object, ...], dict[str, object]]:
        return tree_map(to_replicated, args), tree_map(to_replicated, kwargs)

    return hook


def _local_outputs(_module: nn.Module, _args: object, output: object) -> object:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, output)


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
