"""The text ``memplan plan --emit TOOL`` prints, and what that tool cannot express of the plan."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from estimators import ConfigError

from . import TOOLS

if TYPE_CHECKING:
    from ..planning import Plan

__all__ = ["emit", "caveats"]


def _tool(tool: str) -> str:
    if tool not in TOOLS:
        raise ConfigError(f"no export to {tool!r}; use one of {', '.join(TOOLS)}")
    return tool


def emit(plan: Plan, tool: str) -> str:
    """``tool``'s settings for the plan: JSON keyword arguments (hf, trl, lightning), an
    ``accelerate launch`` config YAML (accelerate), ``key=value`` overrides (torchtune)."""
    tool = _tool(tool)
    if tool == "hf":
        from ._plan_facts import layout
        from .hf._export import _args
        return json.dumps(_args(layout(plan)), indent=2)
    if tool == "trl":
        return json.dumps(_quiet(plan, "trl"), indent=2)
    if tool == "lightning":
        return json.dumps(_quiet(plan, "lightning"), indent=2)
    if tool == "accelerate":
        from .accelerate._export import config_yaml
        return config_yaml(plan)
    return " ".join(_quiet(plan, "torchtune"))


def _quiet(plan: Plan, tool: str) -> Any:
    # The caveats are the caller's to print (``caveats``), not warnings on top of them.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if tool == "trl":
            from .trl._export import sft_config
            return sft_config(plan)
        if tool == "lightning":
            from .lightning._export import trainer_kwargs
            return trainer_kwargs(plan)
        from .torchtune._export import overrides
        return overrides(plan)


def caveats(plan: Plan, tool: str) -> list[str]:
    """What ``tool`` cannot express of the plan, each with what the export does instead."""
    tool = _tool(tool)
    if tool == "hf":
        from .hf._export import caveats as found
    elif tool == "trl":
        from .trl._export import caveats as found
    elif tool == "lightning":
        from .lightning._export import caveats as found
    elif tool == "accelerate":
        from .accelerate._export import caveats as found
    else:
        from .torchtune._export import caveats as found
    return found(plan)
