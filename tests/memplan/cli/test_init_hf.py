"""memplan init --from hf:...: a model file for a Hugging Face model that loads what is on the
machine, reads the user's text, and plans and trains like the hf: source it came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf import words, write_hub_cache, write_pretrained, write_tiny, write_tokenizer

from estimators import Estimator, TrainConfig, hf_task, load_task
from memplan.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama")


def init(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["init", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_file_loads_the_pretrained_weights_and_packs_the_text(pretrained: Path, tmp_path: Path, capsys) -> None:
    data = tmp_path / "data.txt"
    data.write_text(words(700))
    code, out, err = init(capsys, str(tmp_path / "run"), "--from", f"hf:{pretrained}", "--seq-len", "16",
                          "--data", str(data), "--global-batch", "4")
    assert code == 0, err
    assert "pretrained weights" in out and "next: memplan fit" in out
    task = load_task(tmp_path / "run" / "model.py")
    assert task.settings["global_batch"] == 4 and task.settings["lr"] == 2e-5
    # Trained for real: the saved weights. Estimated on meta: built from the config, no weights.
    net = task.build_model()
    import transformers
    original = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained))
    for (name, p), (_, q) in zip(net.named_parameters(), original.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    with torch.device("meta"):
        assert next(task.build_model().parameters()).device.type == "meta"
    # The text packed end to end: ~700 words, an end token after the one document, 16 a sample;
    # 5% (at least one) held out for validation.
    train, val = task.train_data(), task.val_data()
    assert len(train) + len(val) == 701 // 16 and len(val) == max(1, (701 // 16) // 20)
    ids, labels = train[0]
    assert ids.shape == (16,) and torch.equal(ids, labels)
    tok = transformers.AutoTokenizer.from_pretrained(str(pretrained))
    assert tok.decode(ids) == words(16)


def test_a_model_file_plans_as_its_hf_source_does(pretrained: Path, tmp_path: Path, capsys) -> None:
    # No --data: seeded random tokens of the sequence length, as the hf: source plans; the
    # same model, batch and loss give the same bytes.
    code, _, err = init(capsys, str(tmp_path), "--from", f"hf:{pretrained}", "--seq-len", "32", "--lora-rank", "4")
    assert code == 0, err
    from_file = load_task(tmp_path / "model.py")
    assert from_file.settings["lr"] == 2e-4
    config = TrainConfig(micro_batch_size=4)
    planned = Estimator(hf_task(str(pretrained), seq_len=32, lora_rank=4), device="cpu").estimate(config)
    written = Estimator(from_file, device="cpu").estimate(config)
    assert written.peak_bytes == planned.peak_bytes
    assert written.breakdown["optimizer"] == planned.breakdown["optimizer"]
    trainable = [n for n, p in from_file.build_model().named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_what_is_missing_locally_is_said(tmp_path: Path, capsys, monkeypatch) -> None:
    # A repo id whose cache holds the config only: the file builds from the config (said), and
    # --data, which needs the tokenizer, is refused with the download that fixes it.
    # Both libraries read the cache folder from this constant at each call (the variable
    # HF_HUB_CACHE only at import).
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(write_hub_cache(tmp_path / "cache", "acme/tiny")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = init(capsys, str(tmp_path / "a"), "--from", "hf:acme/tiny", "--seq-len", "8")
    assert code == 0, err
    assert "none found locally for acme/tiny" in out and "hf download acme/tiny" in out
    text = (tmp_path / "a" / "model.py").read_text()
    assert "WEIGHTS = None" in text and "SOURCE = 'acme/tiny'" in text
    task = load_task(tmp_path / "a" / "model.py")
    assert isinstance(task.build_model(), torch.nn.Module) and len(task.train_data()) > 0
    (tmp_path / "d.txt").write_text(words(50))
    code, _, err = init(capsys, str(tmp_path / "b"), "--from", "hf:acme/tiny", "--data", str(tmp_path / "d.txt"))
    assert code == 2 and "tokenizer" in err and "hf download acme/tiny tokenizer.json" in err
    assert not (tmp_path / "b" / "model.py").exists()


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "8"], "--seq-len: only with --from hf:"),
    (["--from", "model.py"], "give a Hugging Face model, hf:"),
    (["--from", "hf:{tiny}", "--data", "{tmp}/missing.txt"], "no such file"),
    (["--from", "hf:{tiny}", "--data", "{tmp}/rows.csv"], "not a text or JSONL file"),
    (["--from", "hf:{tiny}", "--data", "{tmp}/rows.jsonl", "--text-field", "body"], "no 'body' field"),
    (["--from", "hf:{tiny}", "--task", "seq-cls", "--data", "{tmp}/text.txt"], "needs labels"),
    (["--from", "hf:{tiny}", "--global-batch", "0"], "--global-batch"),
], ids=["flag-without-from", "not-hf", "no-data-file", "csv", "no-field", "cls-from-text", "batch-0"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    tiny = write_tokenizer(write_tiny(tmp_path / "tiny"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    (tmp_path / "text.txt").write_text(words(40))
    argv = [a.format(tiny=tiny, tmp=tmp_path) for a in argv]
    code, out, err = init(capsys, str(tmp_path / "out"), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "model.py").exists()


def test_an_existing_file_is_kept_unless_forced(pretrained: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "model.py").write_text("mine = 1\n")
    code, _, err = init(capsys, str(tmp_path), "--from", f"hf:{pretrained}")
    assert code == 2 and "already exists" in err and (tmp_path / "model.py").read_text() == "mine = 1\n"
    code, out, err = init(capsys, str(tmp_path), "--from", f"hf:{pretrained}", "--force")
    assert code == 0, err
    # The model's context (256 positions) is shorter than the default 1024 tokens: it is used.
    assert "SEQ_LEN = 256" in (tmp_path / "model.py").read_text() and "256 tokens" in out


def test_classification_and_masked_lm_read_their_data(tmp_path: Path, capsys) -> None:
    import transformers

    tiny = write_tokenizer(write_tiny(tmp_path / "tiny"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": words(3 + i % 5, i), "label": ["neg", "pos", "mid"][i % 3]}) + "\n"
                            for i in range(30)))
    code, _, err = init(capsys, str(tmp_path / "cls"), "--from", f"hf:{tiny}", "--task", "seq-cls", "--num-labels",
                        "3", "--seq-len", "8", "--data", str(rows))
    assert code == 0, err
    task = load_task(tmp_path / "cls" / "model.py")
    ids, mask, labels = (torch.stack(t) for t in zip(*[task.train_data()[i] for i in range(28)], strict=True))
    assert ids.shape == (28, 8) and sorted(set(labels.tolist())) == [0, 1, 2]  # mid, neg, pos
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # three words, padded
    net = task.build_model()
    assert net.config.num_labels == 3 and net.config.pad_token_id == 2  # the tokenizer's [PAD]
    assert task.loss_fn(net, (ids[:2], mask[:2], labels[:2])).ndim == 0

    bert = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=64, max_position_embeddings=64).save_pretrained(bert)
    write_tokenizer(bert)
    (tmp_path / "text.txt").write_text(words(2000))
    code, _, err = init(capsys, str(tmp_path / "mlm"), "--from", f"hf:{bert}", "--task", "masked-lm",
                        "--seq-len", "32", "--data", str(tmp_path / "text.txt"))
    assert code == 0, err
    task = load_task(tmp_path / "mlm" / "model.py")
    ids, labels = (torch.stack(t) for t in zip(*list(task.train_data()), strict=True))
    masked = labels != -100
    assert 0.1 < masked.float().mean() < 0.2
    assert bool((ids[masked] == 3).all()) and bool((ids[~masked] != 3).all())  # [MASK] is id 3


@pytest.mark.slow
def test_fit_trains_the_written_file(pretrained: Path, tmp_path: Path) -> None:
    # The whole path a user takes: init, then memplan fit in its own process.
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": words(40, i)}) + "\n" for i in range(40)))
    assert main(["init", str(tmp_path), "--from", f"hf:{pretrained}", "--seq-len", "32", "--data", str(data),
                 "--global-batch", "8"]) == 0
    run = subprocess.run([sys.executable, "-m", "memplan.cli", "fit", str(tmp_path / "model.py"), "--vram", "1GB",
                          "--max-steps", "3", "--probe-top", "0", "--compile-top", "0", "--trials", "4",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 3
    assert (tmp_path / "out" / "model.pt").stat().st_size > 0
    assert "val_loss" in run.stdout
