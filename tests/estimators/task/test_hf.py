"""hf: sources: a Hugging Face model planned from its config, offline, with the model's own loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from estimators import ConfigError, Estimator, TrainConfig, hf_task, load_source, probe
from helpers.hf import write_hub_cache, write_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.mark.parametrize("options", [{}, {"lora_rank": 4}, {"task": "seq-cls"}],
                         ids=["causal-lm", "lora", "seq-cls"])
def test_the_estimate_is_the_real_steps_peak(tiny: Path, options: dict) -> None:
    # The trace builds the model on meta from the config; the probe builds it for real in a
    # child process (the task pickled by reference) and steps it: the same bytes.
    task = hf_task(f"hf:{tiny}", seq_len=64, **options)
    config = TrainConfig(micro_batch_size=4)
    predicted = Estimator(task, device="cpu").estimate(config)
    measured = probe(task, config, device="cpu", steps=2)
    assert measured.status == "ok", measured.message
    assert measured.estimate is not None
    assert predicted.peak_bytes == pytest.approx(measured.estimate.peak_bytes, rel=0.01)


def test_lora_trains_only_the_adapters(tiny: Path) -> None:
    full = hf_task(str(tiny), seq_len=16)
    lora = hf_task(str(tiny), seq_len=16, lora_rank=2, lora_targets=["q_proj", "v_proj"])
    model = lora.build_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".q_proj." in n for n in trainable) and not any("k_proj" in n for n in trainable)
    est_full = Estimator(full, device="cpu").estimate(TrainConfig(micro_batch_size=1))
    est_lora = Estimator(lora, device="cpu").estimate(TrainConfig(micro_batch_size=1))
    # AdamW's two states (and a step count each) cover the adapters only.
    adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad)
    assert 2 * adapter_bytes <= est_lora.breakdown["optimizer"] <= 2 * adapter_bytes + 8 * len(trainable)
    assert est_full.breakdown["optimizer"] > 20 * est_lora.breakdown["optimizer"]


def test_the_batches_and_the_config_are_trainings(tiny: Path, tmp_path: Path) -> None:
    # A config saved in bf16 (as published ones are) still builds fp32 master weights, with
    # no KV cache; batches are seeded token ids of the sequence length.
    data = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "torch_dtype": "bfloat16", "dtype": "bfloat16",
                                                      "use_cache": True}))
    task = hf_task(f"hf:{tmp_path / 'config.json'}", seq_len=24)
    model = task.build_model()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.use_cache is False
    batch = task.real_batch(3)
    assert batch["input_ids"].shape == (3, 24) and torch.equal(batch["labels"], batch["input_ids"])
    assert int(batch["input_ids"].max()) < data["vocab_size"]
    assert torch.equal(task.real_batch(3)["input_ids"], batch["input_ids"])
    loss = task.compute_loss(model, batch)
    assert loss.dim() == 0 and 3.0 < float(loss) < 7.0  # about log(vocab 128) = 4.85 at random weights
    cls = hf_task(str(tiny), seq_len=8, task="seq-cls", num_labels=3).real_batch(4)
    assert cls["labels"].shape == (4,) and int(cls["labels"].max()) < 3


@pytest.mark.parametrize(("call", "message"), [
    (lambda d: hf_task(str(d), seq_len=None), "--seq-len"),
    (lambda d: hf_task(str(d), seq_len=0), "positive integer"),
    (lambda d: hf_task(str(d), seq_len=8, task="vision"), "unknown task 'vision'"),
    (lambda d: hf_task(str(d), seq_len=8, lora_targets=["q_proj"]), "--lora-rank"),
    (lambda d: hf_task(str(d.parent), seq_len=8), "no config.json"),
    (lambda d: hf_task(str(d / "missing.json"), seq_len=8), "no such file"),
    (lambda d: load_source("examples/digits.py", seq_len=8), "--seq-len applies to hf: models only"),
    (lambda d: hf_task(str(d), seq_len=8, lora_rank=2, lora_targets=["no_such_module"]), "--lora-targets"),
], ids=["no-seq-len", "zero-seq-len", "task", "targets-no-rank", "dir-without-config", "missing", "file-flags",
        "bad-targets"])
def test_bad_input_is_one_line_with_the_fix(tiny: Path, call, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        call(tiny)
    assert "\n" not in str(err.value)


def _memplan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_the_command_line_reads_a_repo_id_from_the_local_hub_cache(tmp_path: Path, monkeypatch, capsys) -> None:
    cache = write_hub_cache(tmp_path / "hub", "acme/tiny-qwen", kind="qwen2")
    run = _memplan("estimate", "hf:acme/tiny-qwen", "--seq-len", "16", "-b", "2", "--json",
                   env={"HF_HUB_CACHE": str(cache)})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["config"]["micro_batch_size"] == 2 and out["peak_allocated_bytes"] > 0
    # The refusals, in-process (the command line's entry point, the same cache and offline mode:
    # huggingface_hub read HF_HUB_CACHE when it was imported, so its constant is pointed there).
    import huggingface_hub.constants

    from memplan.cli import main
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert main(["estimate", "hf:acme/not-cached", "--seq-len", "16", "-b", "2"]) == 2
    missing = capsys.readouterr().err
    assert "local Hub cache has no config" in missing and "hf download acme/not-cached" in missing
    # fit trains a model file's data: an hf: source is pointed at memplan init.
    assert main(["fit", "hf:acme/tiny-qwen", "--vram", "1GB"]) == 2
    assert "memplan init --from hf:acme/tiny-qwen" in capsys.readouterr().err
