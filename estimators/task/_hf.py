"""``hf:`` model sources: a Hugging Face model planned from its config alone.

``hf:<repo id | directory | config.json>`` names a ``transformers`` model. Only its config is
read (from the directory, the file, or the local Hub cache and then the Hub;
``HF_HUB_OFFLINE=1`` keeps it to the cache); the model is built from it with no weights:
on the meta device for the trace, for real (and randomly initialised) only where a probe runs
real steps. Batches are synthetic token ids of the sequence length asked for, and the loss is
the model's own (``model(**batch).loss``): the causal-LM head's shifted cross-entropy by
default, or that of the sequence-classification or masked-LM head. With a LoRA rank, the base
is frozen and PEFT's adapters are what is trained (the optimizer sees only them).

``transformers`` (and ``peft`` for LoRA) are imported only here, only when an ``hf:`` source is
used: ``pip install 'memplan[hf]'``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .._errors import ConfigError, ModelFileError
from .._types import Batch
from ._task import Task, load_task

__all__ = ["HF_PREFIX", "HEADS", "HFSource", "is_hf_source", "hf_task", "load_hf_config", "load_source"]

HF_PREFIX = "hf:"

HEADS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
}
"""``--task``: the head the model is trained with, by the ``transformers`` auto class that builds it."""

_PEFT_TASK = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "masked-lm": None}

_INSTALL = "pip install 'memplan[hf]'"


def is_hf_source(ref: object) -> bool:
    """Whether a model argument names an ``hf:`` source rather than a model file."""
    return isinstance(ref, str) and ref.startswith(HF_PREFIX)


@dataclass(frozen=True)
class HFSource:
    """What an ``hf:`` task is made of: where the config is, and how the model is trained."""

    ref: str
    """The repo id, directory or config.json (without ``hf:``)."""
    seq_len: int
    head: str = "causal-lm"
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    """Module names (or suffixes) given adapters; None: PEFT's defaults for the architecture."""
    num_labels: int = 2
    """Classes of the sequence-classification head."""

    def __post_init__(self) -> None:
        if not self.ref:
            raise ConfigError("hf: names no model; give a repo id, a directory or a config.json, e.g. hf:Qwen/Qwen2.5-0.5B")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError(f"hf:{self.ref}: the sequence length must be a positive integer, got {self.seq_len!r}; "
                              "pass --seq-len N (seq_len=N)")
        if self.head not in HEADS:
            raise ConfigError(f"hf:{self.ref}: unknown task {self.head!r}; use one of {', '.join(HEADS)}")
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int)
                                           or self.lora_rank < 1):
            raise ConfigError(f"hf:{self.ref}: the LoRA rank must be a positive integer, got {self.lora_rank!r}")
        if self.lora_targets is not None and self.lora_rank is None:
            raise ConfigError(f"hf:{self.ref}: LoRA targets were given without a rank; add --lora-rank R")
        if self.lora_rank is not None and _PEFT_TASK[self.head] is None and not self.lora_targets:
            raise ConfigError(f"hf:{self.ref}: LoRA of a {self.head} head needs its targets; pass --lora-targets")

    @property
    def name(self) -> str:
        lora = f" LoRA r={self.lora_rank}" if self.lora_rank is not None else ""
        return f"hf:{self.ref} ({self.head}, {self.seq_len} tokens{lora})"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"hf: models need transformers, which is not installed; {_INSTALL}") from None
    # transformers logs a warning for every config field it does not know and for each
    # model it builds with random weights: here that is the point, not news.
    transformers.logging.set_verbosity_error()
    return transformers


def load_hf_config(ref: str) -> Any:
    """The ``PretrainedConfig`` of a repo id, a directory holding ``config.json``, or the file.

    A local path is read as it is; a repo id from the local Hub cache first, then the Hub
    (``HF_HUB_OFFLINE=1``: the cache only). Every failure is a one-line :class:`ConfigError`
    that says what to do.
    """
    transformers = _transformers()
    path = Path(ref).expanduser()
    local = path.exists() or ref.startswith((".", "/", "~")) or ref.endswith(".json")
    if local:
        if path.is_dir() and not (path / "config.json").is_file():
            raise ConfigError(f"hf:{ref}: the directory holds no config.json; point at the model's folder or its config.json")
        if not path.exists():
            raise ConfigError(f"hf:{ref}: no such file or directory; give a repo id, a model folder or its config.json")
        try:
            if path.is_file():
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict) or "model_type" not in data:
                    raise ConfigError(f"hf:{ref}: not a transformers config (no model_type); give the model's config.json")
                config_class = transformers.AutoConfig.for_model(data["model_type"]).__class__
                return config_class.from_dict(data)
            return transformers.AutoConfig.from_pretrained(str(path))
        except ConfigError:
            raise
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"hf:{ref}: {_one_line(exc)}; this transformers ({transformers.__version__}) cannot read "
                              "the config: upgrade it (pip install -U transformers)") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"hf:{ref}: cannot read the config ({_one_line(exc)}); fix or replace config.json") from None
    return _hub_config(transformers, ref)


def _hub_config(transformers: Any, repo: str) -> Any:
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - a repo id the cache cannot even look up: the Hub says why
        cached = None
    if isinstance(cached, str):
        # In the cache: read there, with no request to the Hub (which retries for half a
        # minute before it gives up on a machine without a network).
        return transformers.AutoConfig.from_pretrained(str(Path(cached).parent))
    try:
        return transformers.AutoConfig.from_pretrained(repo)
    except Exception as exc:  # noqa: BLE001 - the Hub's many errors, each turned into its fix
        kind = type(exc).__name__
        text = str(exc)
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        if "gated" in text.lower() or kind == "GatedRepoError":
            fix = (f"accept its licence on https://huggingface.co/{repo} and log in (hf auth login), "
                   "or pass a local directory or config.json")
            raise ConfigError(f"hf:{repo} is a gated repository; {fix}") from None
        if kind in ("RepositoryNotFoundError",) or "is not a local folder and is not a valid model identifier" in text:
            raise ConfigError(f"hf:{repo}: no such repository on the Hub (or it is private); check the name, "
                              "or pass a local directory or config.json") from None
        if isinstance(exc, (ValueError, KeyError)) and "model_type" in text:
            raise ConfigError(f"hf:{repo}: {_one_line(exc)}; upgrade transformers (pip install -U transformers)") from None
        where = "the local Hub cache has no config for it" if offline else "it could not be fetched from the Hub"
        raise ConfigError(f"hf:{repo}: {where} ({kind}); download it once with `hf download {repo} config.json`, "
                          "or pass a local directory or config.json") from None


def hf_task(ref: str, *, seq_len: int | None, task: str | None = None, lora_rank: int | None = None,
            lora_targets: Sequence[str] | None = None, num_labels: int = 2, name: str | None = None) -> Task:
    """The :class:`~estimators.Task` of an ``hf:`` source (the prefix is optional here).

    ``seq_len`` tokens per sample (required); ``task``: ``causal-lm`` (default), ``seq-cls`` or
    ``masked-lm``; ``lora_rank`` plans a PEFT LoRA fine-tune of ``lora_targets`` (default:
    PEFT's targets for the architecture).
    """

    bare = ref[len(HF_PREFIX):] if ref.startswith(HF_PREFIX) else ref
    if seq_len is None:
        raise ConfigError(f"hf:{bare}: a Hugging Face model needs the sequence length it is trained at; pass --seq-len N "
                          "(seq_len=N)")
    source = HFSource(bare, seq_len, task or "causal-lm", lora_rank,
                      tuple(lora_targets) if lora_targets is not None else None, num_labels)
    config = _training_config(load_hf_config(bare), source)
    # Built once on meta (no memory, no time to speak of): a head the architecture lacks or
    # LoRA targets it does not have are refused here, not in the middle of a search.
    with torch.device("meta"):
        _build_model(config, source)
    # Module-level functions bound with partial: the task pickles by reference, so a probe's
    # child process rebuilds it without the model file it does not have.
    return Task(
        name=name or source.name,
        build_model=functools.partial(_build_model, config, source),
        loss_fn=_model_loss,
        sample_fn=functools.partial(_token_batch, source, int(getattr(config, "vocab_size", 0) or 0)),
        settings={},
        source_hash=_source_hash(config, source),
        origin={"hf": source.ref, "seq_len": source.seq_len, "task": source.head, "lora_rank": source.lora_rank,
                "lora_targets": list(source.lora_targets) if source.lora_targets else None},
    )


def _training_config(config: Any, source: HFSource) -> Any:
    """The config as training sees it: no KV cache; a padding id where the classification head
    needs one to find each sequence's last token."""
    config = config.__class__.from_dict(config.to_dict())
    config.use_cache = False
    if source.head == "seq-cls":
        config.num_labels = source.num_labels
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"hf:{source.ref}: the config has no vocab_size; only token models are planned from hf: sources")
    return config


def _build_model(config: Any, source: HFSource) -> nn.Module:
    transformers = _transformers()
    auto = getattr(transformers, HEADS[source.head])
    # fp32 master weights whatever the config's dtype says: the precision is the plan's choice.
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        model = auto.from_config(config, **{dtype_key: torch.float32})
    except ValueError as exc:
        raise ConfigError(f"hf:{source.ref}: {_one_line(exc)}; choose another --task for this architecture") from None
    if source.lora_rank is not None:
        model = _with_lora(model, source)
    return model


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(f"LoRA fine-tunes need peft, which is not installed; {_INSTALL}") from None
    return peft


def _with_lora(model: nn.Module, source: HFSource) -> nn.Module:
    peft = _peft()
    rank = source.lora_rank
    assert rank is not None  # the caller's condition
    task_type = _PEFT_TASK[source.head]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=list(source.lora_targets) if source.lora_targets else None,
                             **({"task_type": task_type} if task_type else {}))
    try:
        with warnings.catch_warnings():
            # PEFT reads a property transformers 5 renamed: its deprecation is not the user's.
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing")
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ConfigError(f"hf:{source.ref}: LoRA: {_one_line(exc)}; name the modules with --lora-targets "
                          "(e.g. q_proj v_proj)") from None


def _token_batch(source: HFSource, vocab: int, batch_size: int) -> Batch:
    """``batch_size`` sequences of random token ids (seeded: the same batch every time) with
    the labels the head's loss needs: the ids themselves for language modelling (the model
    shifts them), one class per sequence for classification."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, source.seq_len), generator=g)
    if source.head == "seq-cls":
        labels = torch.randint(0, source.num_labels, (batch_size,), generator=g)
    else:
        labels = ids.clone()
    return {"input_ids": ids, "labels": labels}


def _model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss for a batch of keyword inputs."""
    if not isinstance(batch, dict):
        raise ModelFileError("an hf: model takes batches of keyword inputs (input_ids, labels, ...)")
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else getattr(out, "loss", None)
    if loss is None:
        raise ModelFileError("the model returned no loss for a batch with labels; choose a head that has one (--task)")
    return loss


def _source_hash(config: Any, source: HFSource) -> str:
    text = config.to_json_string(use_diff=False) + repr((source.head, source.seq_len, source.lora_rank,
                                                         source.lora_targets, source.num_labels))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_source(ref: str, *, seq_len: int | None = None, task: str | None = None, lora_rank: int | None = None,
                lora_targets: Sequence[str] | None = None, num_labels: int | None = None) -> Task:
    """The task a model argument names: an ``hf:`` source (with these options), or a model file
    (which takes none of them: its ``train_data()`` sets the shapes)."""
    if is_hf_source(ref):
        return hf_task(ref, seq_len=seq_len, task=task, lora_rank=lora_rank, lora_targets=lora_targets,
                       num_labels=2 if num_labels is None else num_labels)
    given = [flag for flag, value in (("--seq-len", seq_len), ("--task", task), ("--lora-rank", lora_rank),
                                      ("--lora-targets", lora_targets), ("--num-labels", num_labels))
             if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to hf: models only; a model file's train_data() and model() "
                          f"say what {Path(ref).name} trains (or plan hf:<repo id | directory | config.json>)")


    return load_task(ref)
