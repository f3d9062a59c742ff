"""What a search starts from: the task, its estimator, the budget, the model on meta.

A model may come as a model file, a ``Task`` or an ``nn.Module``; each is one ``Task``. Its
estimator is kept while the task lives, so that a second search of it re-uses its traces.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.nn as nn

from estimators import (
    ConfigError,
    Estimator,
    Task,
    detect_local_gpu,
    format_size,
    hf_task,
    is_hf_source,
    load_task,
    parse_size,
)

__all__ = ["host_budget_for", "resolve_task", "estimator_for", "default_budget", "budget_for", "vram_beyond_device",
           "meta_model", "can_probe"]


_ESTIMATORS: weakref.WeakKeyDictionary[Task, dict[tuple[str | None, str | None], Estimator]] = (
    weakref.WeakKeyDictionary()
)


def estimator_for(task: Task, *, device: str | None, gpu: str | None) -> Estimator:
    """One estimator per task and target, kept while the task lives: searching the same task
    again (another budget, another global batch) reuses its traces."""
    per_task = _ESTIMATORS.setdefault(task, {})
    key = (device, gpu)
    if key not in per_task:
        per_task[key] = Estimator(task, device=device, gpu=gpu)
    return per_task[key]


def resolve_task(model: Task | str | os.PathLike[str] | nn.Module, sample: Any = None, *,
                 seq_len: int | None = None, **module_parts: Any) -> Task:
    """The task of a model file, an ``hf:`` source (at ``seq_len`` tokens), a ``Task``, or an
    ``nn.Module`` with ``sample`` and/or the ``module_parts`` of :meth:`Task.from_module`
    (``loss``, ``optimizer``, ``train_data``, ``val_data``, ``collate``, ``settings``)."""
    if is_hf_source(model) or seq_len is not None:
        if not is_hf_source(model):
            raise ConfigError("seq_len= applies to hf: models only; a model file's or module's batches set their shapes")
        if sample is not None or any(v is not None for v in module_parts.values()):
            raise ConfigError("an hf: model brings its own batches and loss; drop sample=, loss=, train_data=, ...")
        assert isinstance(model, str)  # is_hf_source
        return hf_task(model, seq_len=seq_len)
    parts = {k: v for k, v in module_parts.items() if v is not None}
    if isinstance(model, Task):
        if sample is not None or parts:
            raise ConfigError(f"{', '.join(['sample', *parts])} go with an nn.Module; a Task carries its own")
        return model
    if isinstance(model, nn.Module):
        if sample is None and parts.get("train_data") is None:
            raise ConfigError(
                f"search({type(model).__name__}) needs batches: pass sample= (a batch, or a callable "
                "batch_size -> batch) or train_data= (a Dataset)"
            )
        return Task.from_module(model, sample, **parts)
    if sample is not None or parts:
        raise ConfigError(
            f"{', '.join(['sample', *parts])} go with an nn.Module; a model file defines its own "
            "(loss(), optimizer(), train_data(), ...)"
        )
    return load_task(os.fspath(model))


def default_budget(estimator: Estimator) -> tuple[int, str]:
    """The budget when --vram is not given, and where it came from."""
    if estimator.device == "cuda":
        if torch.cuda.is_available() and _local_matches(estimator):
            free, _total = torch.cuda.mem_get_info()
            return int(free), "free memory of the local GPU"
        assert estimator.spec is not None
        return estimator.spec.memory_bytes, f"memory of {estimator.spec.name}"
    # CPU: half of what the machine has available now, so the OS and other work keep room.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2, "half of the available RAM"
    except OSError:
        pass
    return 8 * 10**9, "a default of 8 GB"


def budget_for(estimator: Estimator, vram: int | str | None) -> int:
    """The budget in bytes: ``vram`` parsed, or the default for the target."""
    if vram is None:
        budget, _source = default_budget(estimator)
        return budget
    budget = parse_size(vram, what="--vram")
    if budget <= 0:
        raise ConfigError("--vram must be more than 0 bytes; e.g. --vram 12GB")
    return budget


def host_budget_for(host_memory: int | str | None) -> int:
    """Host memory a plan may hold (CPU offload's states): ``host_memory`` parsed, or this
    machine's RAM (a plan for a card that is not here assumes its host has as much)."""
    if host_memory is not None:
        value = parse_size(host_memory, what="--host-memory")
        if value <= 0:
            raise ConfigError("--host-memory must be more than 0 bytes; e.g. --host-memory 64GB")
        return value
    ram = _physical_ram()
    return ram if ram is not None else 16 * 10**9


def vram_beyond_device(estimator: Estimator, budget: int, gpu: str | None) -> str | None:
    """One line when the budget (``--vram``) is more memory than the target can have: this
    machine's RAM for its CPU, the total memory of its GPU, or the memory of the card named by
    ``gpu`` (``--gpu``); None when it is not, or the target's memory is not known. Not a
    refusal: a plan for a bigger machine may be meant, and the line names ``--gpu`` for that."""
    asked = format_size(budget)
    if estimator.device == "cpu":
        ram = _physical_ram()
        if ram is None or budget <= ram:
            return None
        return (f"--vram {asked} is more than this machine's {format_size(ram)} of memory; the plan assumes memory "
                "it does not have (to plan for a GPU that is not here, name it with --gpu)")
    spec = estimator.spec
    if spec is None:
        return None
    if gpu is not None:
        if budget <= spec.memory_bytes:
            return None
        return (f"--vram {asked} is more than the {_card_size(spec.memory_bytes)} of the --gpu {spec.name}; the plan "
                "assumes memory the card does not have (name a bigger card with --gpu)")
    total = spec.memory_bytes
    if torch.cuda.is_available() and _local_matches(estimator):
        try:
            total = int(torch.cuda.mem_get_info()[1])
        except RuntimeError:
            pass
    if budget <= total:
        return None
    return (f"--vram {asked} is more than the {_card_size(total)} of this machine's GPU ({spec.name}); the plan "
            "assumes memory it does not have (to plan for a bigger card, name it with --gpu)")


def _card_size(n: int) -> str:
    """A card's memory as --vram reads it (GB) and as cards are sold (GiB): ``85.9 GB (80.0 GiB)``."""
    return f"{format_size(n)} ({format_size(n, binary=True)})"


def _physical_ram() -> int | None:
    """This machine's physical RAM in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _local_matches(estimator: Estimator) -> bool:
    local = detect_local_gpu()
    return local is not None and estimator.spec is not None and local.name == estimator.spec.name


def meta_model(task: Task) -> nn.Module:
    if task.prebuilt is not None:
        return task.prebuilt
    try:
        with torch.device("meta"):
            return task.build_model()
    except Exception:  # noqa: BLE001 - some models only build for real
        return task.build_model()


def can_probe(estimator: Estimator, gpu: str | None) -> bool:
    if estimator.device == "cpu":
        return True
    return torch.cuda.is_available() and (gpu is None or _local_matches(estimator))
