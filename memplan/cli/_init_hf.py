"""``memplan init --from hf:<repo id | directory | config.json>``: a model file for a Hugging Face model.

The file is plain ``transformers`` (and ``peft`` for LoRA) code the user can read and edit, not a
call into memplan: ``model()`` builds the model from its config while memplan only estimates
(on the meta device, no weights) and loads the pretrained weights when it trains, where they
are on this machine; ``train_data()`` tokenizes a text or JSONL file with the model's own
tokenizer (or, with no file, makes seeded random tokens so that the file trains as written);
``settings`` holds the sequence length's global batch, learning rate and length of training.
What is found locally is decided here, once, and written into the file with a comment, so
that training never waits on the network for a file init did not find.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimators import ConfigError
from estimators.task._hf import HEADS, HF_PREFIX, hf_task, is_hf_source, load_hf_config

__all__ = ["HFInit", "hf_model_file", "write_hf_model_file", "DEFAULT_SEQ_LEN"]

DEFAULT_SEQ_LEN = 1024
"""Tokens per sample when ``--seq-len`` is not given (the model's context where that is shorter)."""

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_DATA_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json")


@dataclass(frozen=True)
class HFInit:
    """What ``init --from`` found and chose: written into the model file and said on the terminal."""

    ref: str
    """The repo id, or the absolute path of the folder or config.json."""
    model_type: str
    head: str
    seq_len: int
    global_batch: int
    weights: str | None
    """Where pretrained weights are on this machine (the folder or repo id), or None."""
    tokenizer: str | None
    data: str | None
    text_field: str
    lora_rank: int | None
    lora_targets: tuple[str, ...] | None
    num_labels: int

    def notes(self) -> list[str]:
        """One line each for what the user must know: where weights and data come from."""
        lines = []
        if self.weights is not None:
            lines.append(f"weights: the pretrained weights of {self.weights} are loaded when training")
        else:
            lines.append(f"weights: none found locally for {self.ref}: model.py trains from the config's random "
                         f"initialisation; download them (hf download {self.ref}) and rerun init --force, "
                         "or set WEIGHTS in model.py")
        if self.data is not None:
            lines.append(f"data: {self.data}, tokenized with {self.tokenizer}'s tokenizer into {self.seq_len}-token samples")
        else:
            lines.append("data: none given (--data FILE): model.py trains on random tokens; set DATA to a .txt or "
                         ".jsonl file")
        return lines


def _local_path(ref: str) -> Path | None:
    path = Path(ref).expanduser()
    if path.exists() or ref.startswith((".", "/", "~")) or ref.endswith(".json"):
        return path.resolve()
    return None


def _cached(repo: str, names: tuple[str, ...]) -> bool:
    """Whether the local Hub cache holds one of ``names`` for ``repo``."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for name in names:
        try:
            if isinstance(try_to_load_from_cache(repo, name), str):
                return True
        except Exception:  # noqa: BLE001 - a name the cache cannot look up is not there
            continue
    return False


def _has(folder: Path, names: tuple[str, ...]) -> bool:
    return any((folder / name).is_file() for name in names) or (
        names is _WEIGHT_FILES and any(folder.glob("model-*.safetensors")))


def _check_data(data: str, head: str, text_field: str) -> str:
    path = Path(data).expanduser()
    if not path.is_file():
        raise ConfigError(f"--data {data}: no such file; give a .txt or .jsonl file of training text")
    if path.suffix.lower() not in _DATA_SUFFIXES:
        raise ConfigError(f"--data {data}: not a text or JSONL file ({path.suffix or 'no suffix'}); give a .txt or "
                          ".jsonl file (one JSON object per line with a {text_field!r} field)")
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    if head == "seq-cls" and not jsonl:
        raise ConfigError(f"--data {data}: sequence classification needs labels; give a .jsonl file with "
                          f"{text_field!r} and 'label' fields")
    if jsonl:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        if first is None:
            raise ConfigError(f"--data {data}: the file is empty; give training text")
        try:
            row = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--data {data}: line 1 is not JSON ({exc.msg}); give one JSON object per line") from None
        needed = [text_field] + (["label"] if head == "seq-cls" else [])
        missing = [k for k in needed if not isinstance(row, dict) or k not in row]
        if missing:
            raise ConfigError(f"--data {data}: line 1 has no {', '.join(map(repr, missing))} field; name the text "
                              "field with --text-field")
    return str(path.resolve())


def hf_model_file(ref: str, *, seq_len: int | None = None, head: str | None = None, global_batch: int = 16,
                  data: str | None = None, text_field: str = "text", lora_rank: int | None = None,
                  lora_targets: tuple[str, ...] | None = None, num_labels: int | None = None) -> tuple[HFInit, str]:
    """What ``init --from`` found for ``ref`` and the text of its model file."""
    if not is_hf_source(ref):
        raise ConfigError(f"init --from {ref}: give a Hugging Face model, hf:<repo id | directory | config.json>")
    bare = ref[len(HF_PREFIX):]
    head = head or "causal-lm"
    if global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch}: must be a whole number >= 1")
    labels = 2 if num_labels is None else num_labels
    probe_len = seq_len or DEFAULT_SEQ_LEN
    # Planned as memplan would plan it (config read, head and LoRA targets built on meta):
    # a file is only written for a model that can be planned.
    hf_task(bare, seq_len=probe_len, task=head, lora_rank=lora_rank, lora_targets=lora_targets, num_labels=labels)
    config = load_hf_config(bare)
    if seq_len is None:
        context = getattr(config, "max_position_embeddings", None)
        seq_len = min(DEFAULT_SEQ_LEN, context) if isinstance(context, int) and context > 0 else DEFAULT_SEQ_LEN
    local = _local_path(bare)
    if local is not None:
        folder = local if local.is_dir() else local.parent
        where = str(local)
        weights = str(folder) if _has(folder, _WEIGHT_FILES) else None
        tokenizer = str(folder) if _has(folder, _TOKENIZER_FILES) else None
    else:
        where = bare
        weights = bare if _cached(bare, _WEIGHT_FILES) else None
        tokenizer = bare if _cached(bare, _TOKENIZER_FILES) else None
    if data is not None:
        data = _check_data(data, head, text_field)
        if tokenizer is None:
            raise ConfigError(f"--data needs {bare}'s tokenizer, which is not on this machine; download it "
                              f"(hf download {bare} tokenizer.json tokenizer_config.json) or point at a folder that "
                              "holds one")
    found = HFInit(ref=where, model_type=str(getattr(config, "model_type", "?")), head=head, seq_len=seq_len,
                   global_batch=global_batch, weights=weights, tokenizer=tokenizer, data=data,
                   text_field=text_field, lora_rank=lora_rank, lora_targets=lora_targets, num_labels=labels)
    return found, _render(found)


def write_hf_model_file(path: str | Path, ref: str, *, force: bool = False, **options: Any) -> HFInit:
    """Write the model file of ``ref`` to ``path`` (kept unless ``force``); returns what was found."""
    target = Path(path)
    if target.exists() and not force:
        raise ConfigError(f"{target} already exists; remove it or run memplan init --force")
    found, text = hf_model_file(ref, **options)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return found


_PEFT_TASK = {"causal-lm": ', task_type="CAUSAL_LM"', "seq-cls": ', task_type="SEQ_CLS"', "masked-lm": ""}

_TEMPLATE = string.Template('''"""A memplan model file for $ref, written by `memplan init --from`.

memplan fit model.py --vram 24GB                  # plan the fastest configuration that fits, then train it
memplan plan model.py --gpu A100-80GB --vram 80GB  # plan another card without having it

memplan calls model() on the meta device while it only estimates (no weights, no memory), and
for real when it trains. Edit freely; keep the names.
"""

import functools
import json
import os

import torch
import transformers
from torch.utils.data import TensorDataset

# Found on this machine by memplan init: read there, without asking the Hub again.
SOURCE = $source  # the config (and tokenizer): a Hub repo id, a folder or a config.json
# $weights_note
WEIGHTS = $weights
TOKENIZER = $tokenizer  # None: not on this machine
# A .txt file, or .jsonl with one {"$text_field": ...} object a line$label_note; None: random tokens.
DATA = $data
TEXT_FIELD = $text_field_repr
SEQ_LEN = $seq_len  # tokens per sample: what memory and step time are planned for
HEAD = "$auto"  # the head trained ($head)
LORA_RANK = $lora_rank  # a PEFT LoRA fine-tune of this rank, the base frozen; None: a full fine-tune
LORA_TARGETS = $lora_targets  # the modules given adapters; None: PEFT's defaults for $model_type
NUM_LABELS = $num_labels

# Defaults for this model; the command line and a config file override them.
settings = {
    "global_batch": $global_batch,   # sequences per optimizer step: micro-batch x accumulation x devices
    "epochs": 1,
    "lr": $lr,             # $lr_note
    "warmup_steps": 10,
}

# memplan builds the model several times while it plans (estimates, probes): no progress bars.
transformers.utils.logging.disable_progress_bar()
_DTYPE = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _here(path):
    return path if os.path.isabs(path) else os.path.join(os.path.dirname(os.path.abspath(__file__)), path)


@functools.cache
def _config():
    # Found on this machine by memplan init: read it there, without asking the Hub again.
    config = transformers.AutoConfig.from_pretrained(SOURCE, local_files_only=True)
    config.use_cache = False  # training keeps no KV cache$config_extra
    return config


def model():
    auto = getattr(transformers, HEAD)
    estimating = torch.empty(0).device.type == "meta"  # memplan builds on meta to estimate
    if WEIGHTS is not None and not estimating:
        # fp32 master weights whatever the checkpoint's dtype: the precision is the plan's choice.
        net = auto.from_pretrained(WEIGHTS, config=_config(), local_files_only=True, **{_DTYPE: torch.float32})
    else:
        net = auto.from_config(_config(), **{_DTYPE: torch.float32})
    if LORA_RANK is not None:
        import peft

        lora = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                               target_modules=LORA_TARGETS$peft_task)
        net = peft.get_peft_model(net, lora)
    return net


def loss(model, batch):
    """The model's own loss (its head's cross-entropy; labels of -100 are ignored)."""
$loss_body


@functools.cache
def _tokenizer():
    if TOKENIZER is None:
        raise ValueError(f"no tokenizer for {SOURCE} on this machine; download it or set TOKENIZER")
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


def _rows():
    """The data file's texts (and labels): a .txt file is one text, a .jsonl file one a line."""
    path = _here(DATA)
    if not path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            return [(f.read(), None)]
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if TEXT_FIELD not in row:
                    raise ValueError(f"{DATA} line {number} has no {TEXT_FIELD!r} field; set TEXT_FIELD")
                rows.append((row[TEXT_FIELD], row.get("label")))
    return rows

$data_body


def train_data():
    samples = _samples()
    return TensorDataset(*(t[: len(t) - _held_out(len(t))] for t in samples))


def val_data():
    """The last 5% of the samples (at least one), held out: validation loss and early stopping."""
    samples = _samples()
    return TensorDataset(*(t[len(t) - _held_out(len(t)):] for t in samples))


def _held_out(n):
    return max(1, n // 20) if n > 1 else 0
''')

_LM_LOSS = """    input_ids, labels = batch
    return model(input_ids=input_ids, labels=labels).loss"""

_CLS_LOSS = """    input_ids, attention_mask, labels = batch
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss"""

_LM_DATA = '''@functools.cache
def _samples():
    """Token ids packed end to end into SEQ_LEN-token samples (the remainder dropped); the
    labels are the ids: the model shifts them for next-token prediction."""
    if DATA is None:
        ids = torch.randint(0, _config().vocab_size, (256, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        return ids, ids.clone()
    tok = _tokenizer()
    texts = [text for text, _ in _rows()]
    ids = []
    for encoded in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    n = len(ids) // SEQ_LEN
    if n < 2:
        raise ValueError(f"{DATA} holds {len(ids)} tokens, fewer than two samples of {SEQ_LEN}; "
                         "give more text or a shorter SEQ_LEN")
    ids = torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)
    return ids, ids.clone()'''

_MLM_DATA = '''@functools.cache
def _samples():
    """Token ids packed end to end into SEQ_LEN-token samples, 15% of them masked once (seeded):
    the labels are the masked tokens' ids and -100 (ignored) elsewhere."""
    g = torch.Generator().manual_seed(0)
    if DATA is None:
        ids = torch.randint(0, _config().vocab_size, (256, SEQ_LEN), generator=g)
        mask_id = 0
    else:
        tok = _tokenizer()
        if tok.mask_token_id is None:
            raise ValueError(f"{TOKENIZER}'s tokenizer has no mask token; masked-LM training needs one")
        mask_id = tok.mask_token_id
        flat = []
        for encoded in tok([text for text, _ in _rows()], add_special_tokens=False)["input_ids"]:
            flat.extend(encoded)
        n = len(flat) // SEQ_LEN
        if n < 2:
            raise ValueError(f"{DATA} holds {len(flat)} tokens, fewer than two samples of {SEQ_LEN}; "
                             "give more text or a shorter SEQ_LEN")
        ids = torch.tensor(flat[: n * SEQ_LEN]).view(n, SEQ_LEN)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), labels'''

_CLS_DATA = '''@functools.cache
def _samples():
    """Each text truncated or padded to SEQ_LEN tokens, with its attention mask and class (the
    labels' distinct values, sorted, numbered from 0)."""
    if DATA is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, _config().vocab_size, (256, SEQ_LEN), generator=g)
        return ids, torch.ones_like(ids), torch.randint(0, NUM_LABELS, (256,), generator=g)
    tok = _tokenizer()
    tok.pad_token_id = _config().pad_token_id  # the id the head looks for
    rows = _rows()
    classes = sorted({label for _, label in rows}, key=str)
    if len(classes) > NUM_LABELS:
        raise ValueError(f"{DATA} has {len(classes)} labels but NUM_LABELS is {NUM_LABELS}; raise NUM_LABELS")
    encoded = tok([text for text, _ in rows], truncation=True, max_length=SEQ_LEN, padding="max_length",
                  return_tensors="pt")
    labels = torch.tensor([classes.index(label) for _, label in rows])
    return encoded["input_ids"], encoded["attention_mask"], labels


def _pad_id():
    """The tokenizer's padding (else its end-of-text) token, or 0 with no tokenizer."""
    if TOKENIZER is None:
        return 0
    tok = _tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return 0 if pad is None else pad'''


def _render(found: HFInit) -> str:
    lora = found.lora_rank is not None
    cls_extra = ("\n    config.num_labels = NUM_LABELS\n"
                 "    if config.pad_token_id is None:  # the head finds each text's last token by it\n"
                 "        config.pad_token_id = _pad_id()")
    return _TEMPLATE.substitute(
        ref=found.ref,
        source=repr(found.ref),
        weights=repr(found.weights),
        weights_note=("The pretrained weights, loaded when training; None: the config's random initialisation."
                      if found.weights is not None else
                      "Pretrained weights: none on this machine, so the config's random initialisation; "
                      "set a folder or repo id."),
        label_note=' and a "label"' if found.head == "seq-cls" else "",
        tokenizer=repr(found.tokenizer),
        data=repr(found.data),
        text_field=found.text_field,
        text_field_repr=repr(found.text_field),
        seq_len=found.seq_len,
        auto=HEADS[found.head],
        head=found.head,
        lora_rank=found.lora_rank,
        lora_targets=repr(list(found.lora_targets)) if found.lora_targets else "None",
        model_type=found.model_type,
        num_labels=found.num_labels,
        global_batch=found.global_batch,
        lr="2e-4" if lora else "2e-5",
        lr_note=("LoRA adapters learn at ~10x a full fine-tune's rate" if lora
                 else "a full fine-tune of pretrained weights: small steps"),
        config_extra=cls_extra if found.head == "seq-cls" else "",
        peft_task=_PEFT_TASK[found.head],
        loss_body=_CLS_LOSS if found.head == "seq-cls" else _LM_LOSS,
        data_body={"causal-lm": _LM_DATA, "masked-lm": _MLM_DATA, "seq-cls": _CLS_DATA}[found.head],
    )
