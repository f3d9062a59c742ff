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
