"""The model file's ``settings`` contract: the keys memplan reads, and the values it reads them as.

``settings`` takes every training option (the fields of ``memplan.training.TrainOptions`` a
user sets, type-checked by ``memplan._option_sources.resolve_options`` when options are resolved)
plus ``global_batch``, ``weight_decay`` and ``target``. :func:`check_settings` runs where a
``Task`` is made, so that nothing is silently misread later:

* a key that is not memplan's but is close to one (``global_bach``) is an error naming the
  key memplan would have read; left alone it would be ignored and the default used;
* the keys estimators itself reads, and those misread when wrong (truncated by ``int()``,
  failing inside a training step), are checked: :data:`_CHECKS`;
* a key that is neither is the user's own (settings may hold them): returned, and
  :func:`warn_ignored` says once that memplan ignores it.

``None`` means "not set" (the default) for every checked key.

This module is below memplan and does not import it: :data:`SETTINGS_KEYS` is a literal, which
``tests/estimators/task/test_settings_check.py`` keeps equal to the options memplan has.
"""

from __future__ import annotations

import difflib
import logging
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping

from .._errors import ConfigError
from .._types import Setting

__all__ = ["DEFAULT_EPOCHS", "SETTINGS_KEYS", "check_settings", "near_miss", "warn_ignored"]

DEFAULT_EPOCHS = 3
"""Passes over the training data when nothing sets a training length (no ``epochs`` or
``max_steps`` in the options, the config file or the model file's settings): the Hugging Face
Trainer's ``num_train_epochs``, a length that trains, where one pass rarely does. Here, below the
trainer and the search, so that the search's predicted training time counts the same length."""

SETTINGS_KEYS: frozenset[str] = frozenset({
    # memplan.training.TrainOptions' options (memplan._option_sources.option_specs())
    "anneal_strategy", "base_momentum", "checkpoint_every", "compile", "cooldown", "cycle_momentum",
    "drop_last", "early_stopping_min_delta", "early_stopping_patience", "ema_decay", "epochs",
    "eval_every", "gamma", "grad_clip", "grad_clip_mode", "label_smoothing", "lr", "max_momentum",
    "max_nonfinite", "max_steps", "metrics_path", "milestones", "min_lr", "monitor", "monitor_mode",
    "num_workers", "pct_start", "persistent_workers", "pin_memory", "prefetch_factor",
    "scaler_backoff_factor", "scaler_growth_factor", "scaler_growth_interval", "scaler_init_scale",
    "schedule", "schedule_args", "step_size", "t_0", "t_mult", "warmup_steps",
    # the search's and the default optimizer's, and the run's goal
    "global_batch", "weight_decay", "target",
})
"""Every key memplan reads from a model file's ``settings``."""

NEAR_MISS_CUTOFF = 0.8
"""``difflib`` similarity from which an unknown key is taken for a misspelt known one
(``global_bach``, ``epoch``, ``warmup_step``; not ``batch_size``, ``learning_rate`` or
``momentum``)."""

log = logging.getLogger("memplan")


def near_miss(key: object) -> str | None:
    """The known key ``key`` is a misspelling of (another case, ``-`` for ``_``, a typo), else None."""
    if not isinstance(key, str):
        return None
    normal = key.strip().lower().replace("-", "_")
    if normal in SETTINGS_KEYS:
        return normal
    close = difflib.get_close_matches(normal, SETTINGS_KEYS, n=1, cutoff=NEAR_MISS_CUTOFF)
    # A whole word of a known key is a name of its own, not a typo: "momentum" (an SGD
    # optimizer's, say) is not "max_momentum".
    return close[0] if close and normal not in close[0].split("_") else None


# -- the values ---------------------------------------------------------------------------------

def _whole(value: Setting, least: int) -> bool:
    # numbers.Integral: int and numpy's integers; bool is an int but no count, 16.0 a float.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= least


def _number(value: Setting) -> bool:
    # numbers.Real: int, float, numpy's scalars; not bool, not a string that reads as a number.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _lr(value: Setting) -> bool:
    if isinstance(value, str):
        return value.strip().lower() == "auto"
    return _number(value) and value > 0


def _target(value: Setting) -> bool:
    # memplan.training._metrics compares final_metrics[target["metric"]] with float(target["value"]);
    # other keys of the mapping are copied into summary.json as they are.
    return (isinstance(value, Mapping) and isinstance(value.get("metric"), str) and bool(value["metric"].strip())
            and _number(value.get("value")))


_CHECKS: dict[str, tuple[Callable[[Setting], bool], str, str]] = {
    "global_batch": (lambda v: _whole(v, 1), "a whole number >= 1 (samples per optimizer step)",
                     '"global_batch": 32'),
    "lr": (_lr, 'a finite number > 0 or "auto" (memplan lr-find\'s suggestion)', '"lr": 3e-4'),
    "weight_decay": (lambda v: _number(v) and v >= 0, "a finite number >= 0", '"weight_decay": 0.01'),
    "epochs": (lambda v: _whole(v, 1), "a whole number >= 1", '"epochs": 3'),
    "max_steps": (lambda v: _whole(v, 1), "a whole number >= 1", '"max_steps": 1000'),
    "warmup_steps": (lambda v: _whole(v, 0), "a whole number >= 0", '"warmup_steps": 100'),
    "target": (_target, 'a dict with a "metric" name and a number "value"',
               '"target": {"metric": "val_accuracy", "value": 0.97}'),
}
"""The keys checked here: ``(accepts, what it must be, an example)``. The other options are
checked by ``memplan._option_sources.resolve_options``, where options are resolved."""

def _shown(value: Setting) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_settings(settings: Mapping[str, Setting], where: str) -> tuple[str, ...]:
    """The keys of ``settings`` (of the model file or task ``where``) that are not memplan's
    and not close to one of its keys: the user's own, which memplan ignores.

    Raises :class:`ConfigError`, one line naming the key, ``where`` and the fix, for a key
    close to a known one (a misspelling) and for a value of a key in :data:`_CHECKS` that
    is not what it must be."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"settings in {where} must be a dict, got {type(settings).__name__}; "
                          'write settings = {"global_batch": 32, ...}')
    unknown: list[str] = []
    for key, value in settings.items():
        if key in SETTINGS_KEYS:
            check = _CHECKS.get(key)
            if check is not None and value is not None and not check[0](value):
                accepts, what, example = check
                unquoted = _as_number(value) if isinstance(value, str) else None
                if unquoted is not None and accepts(unquoted):
                    fix = f'write it without quotes, "{key}": {value.strip()}'
                else:
                    fix = f"write e.g. {example}, or leave it out for the default"
                raise ConfigError(f"settings[{key!r}] in {where} must be {what}, got {_shown(value)}; {fix}")
            continue
        known = near_miss(key)
        if known is not None:
            raise ConfigError(f"settings[{key!r}] in {where} is not a memplan setting; did you mean {known!r}? "
                              f"rename it (a key of your own needs a name further from {known!r})")
        unknown.append(key)
    return tuple(unknown)


def _as_number(text: str) -> int | float | None:
    """The number a string holds (``"32"``, ``"3e-4"``), else None."""
    for kind in (int, float):
        try:
            return kind(text.strip())
        except ValueError:
            pass
    return None


_WARNED: set[tuple[Hashable, str]] = set()
"""(task, key) pairs already warned about in this process (a task is copied by
``dataclasses.replace``, which checks its settings again)."""


def warn_ignored(keys: Iterable[str], where: str, *, task: Hashable) -> None:
    """One warning per ``task`` and key (on the ``memplan`` logger, which the CLI shows on
    stderr) that ``settings[key]`` of ``where`` is not read by memplan."""
    for key in keys:
        seen = (task, repr(key))
        if seen in _WARNED:
            continue
        _WARNED.add(seen)
        log.warning("settings[%r] in %s is not a memplan setting; memplan ignores it", key, where)
