"""Tiny Hugging Face configs written by the tests: the architectures of popular models at a
size a CPU trains in milliseconds, read offline like a downloaded model's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_config(kind: str = "llama", **overrides: Any) -> Any:
    """A tiny config of ``kind`` (llama, qwen2, mistral, gemma, phi3)."""
    import transformers

    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
               "gemma": "GemmaConfig", "phi3": "Phi3Config"}
    values = {**TINY, **overrides}
    if kind == "gemma":
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
    if kind == "phi3":
        values.setdefault("pad_token_id", 0)
    return getattr(transformers, classes[kind])(**values)


def write_tiny(folder: Path, kind: str = "llama", **overrides: Any) -> Path:
    """``folder`` holding the config.json of a tiny ``kind`` model (created); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_config(kind, **overrides).save_pretrained(folder)
    return folder


def write_hub_cache(cache: Path, repo: str, kind: str = "llama", **overrides: Any) -> Path:
    """A local Hub cache (the layout ``huggingface_hub`` downloads into) holding ``repo``'s config
    only; returns the cache folder, for ``HF_HUB_CACHE``."""
    commit = "0" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    write_tiny(root / "snapshots" / commit, kind, **overrides)
    return cache


WORDS = "the cat sat on a mat and the dog ran to the park while birds sang in trees".split()


def write_pretrained(folder: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """``folder`` holding a downloaded model's files: the config, weights (seeded) and a word-level
    tokenizer of :data:`WORDS` with end, padding, unknown and mask tokens; returns the folder."""
    import torch
    import transformers

    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return write_tokenizer(folder)


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of :data:`WORDS` saved into ``folder`` (ids below 64)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(
        vocab_size=64, special_tokens=["[UNK]", "[EOS]", "[PAD]", "[MASK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]",
                                         pad_token="[PAD]", mask_token="[MASK]").save_pretrained(folder)
    return folder


def words(n: int, start: int = 0) -> str:
    """``n`` words of :data:`WORDS`, round and round from ``start``."""
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))
