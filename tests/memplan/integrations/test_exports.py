"""A plan exported to other trainers, read back by the real packages, offline on CPU: the
keyword arguments build ``TrainingArguments``/``SFTConfig``/``lightning.Trainer``, the YAML loads
with accelerate's own loader, the overrides merge with OmegaConf (torchtune's parser); what a tool
cannot express is said, and the command line prints it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import lightning
import omegaconf
import pytest
import transformers
import trl

from estimators import ConfigError, TrainConfig
from helpers.hf import write_tiny
from helpers.plans import plan_of
from memplan.integrations import TOOLS, caveats, emit

HF = {"origin": {"hf": "acme/tiny", "seq_len": 512, "task": "causal-lm"}}


def plain(**fields) -> object:
    # Micro-batch 4 x accumulation 2; the optimizer step in backward does not accumulate.
    accum = 1 if fields.get("optimizer_in_backward") else 2
    return plan_of(TrainConfig(micro_batch_size=8 // accum, grad_accum_steps=accum, **fields), global_batch=8,
                   provenance=HF)


def quiet(fn, plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(plan)


def test_training_arguments_and_sft_config_take_the_exported_keys(tmp_path: Path) -> None:
    from memplan.integrations.hf import training_args
    from memplan.integrations.trl import sft_config

    plan = plain(precision="bf16-mixed", checkpoint_segments=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **quiet(training_args, plan))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)
    assert args.bf16 and not args.fp16 and args.gradient_checkpointing and args.use_cpu
    sft = trl.SFTConfig(output_dir=str(tmp_path), **quiet(sft_config, plan))
    assert (sft.per_device_train_batch_size, sft.gradient_accumulation_steps, sft.max_length) == (4, 2, 512)
    fsdp = plan_of(TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=4, checkpoint_segments=4,
                               cpu_offload=True), global_batch=8, device="cuda")
    kwargs = quiet(training_args, fsdp)
    assert kwargs["fsdp_config"] == {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                     "activation_checkpointing": True, "cpu_offload": True}
    assert "activation_checkpointing" not in kwargs  # FSDP checkpoints in its config: no second gather
    with pytest.warns(UserWarning, match="torchrun --nproc-per-node 4"):
        training_args(fsdp)


def test_lightning_builds_a_trainer_from_the_kwargs() -> None:
    from memplan.integrations.lightning import trainer_kwargs

    kwargs = quiet(trainer_kwargs, plain(precision="bf16-mixed"))
    assert kwargs == {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "precision": "bf16-mixed",
                      "accumulate_grad_batches": 2}
    trainer = lightning.Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.accumulate_grad_batches == 2 and trainer.precision == "bf16-mixed"
    ddp = quiet(trainer_kwargs, plan_of(TrainConfig(micro_batch_size=2, strategy="ddp", world_size=8, nodes=2),
                                        global_batch=16, device="cuda"))
    assert (ddp["devices"], ddp["num_nodes"], ddp["strategy"], ddp["accelerator"]) == (4, 2, "ddp", "gpu")


def test_accelerate_loads_the_yaml_with_its_own_loader(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    from memplan.integrations.accelerate import config_yaml

    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4, precision="bf16-mixed", strategy="fsdp",
                               world_size=2, checkpoint_segments=3), global_batch=16, device="cuda", compile=True)
    path = tmp_path / "accelerate.yaml"
    path.write_text(config_yaml(plan))
    text = path.read_text()
    assert "gradient_accumulation_steps=4" in text and "DataLoader(batch_size=2)" in text
    loaded = load_config_from_file(str(path))
    assert str(loaded.distributed_type).endswith("FSDP") and loaded.num_processes == 2
    assert str(loaded.mixed_precision).endswith("bf16")
    assert loaded.fsdp_config["fsdp_version"] == 2 and loaded.fsdp_config["fsdp_activation_checkpointing"] is True
    assert str(loaded.dynamo_config["dynamo_backend"]).endswith("INDUCTOR")


def test_torchtune_overrides_merge_as_its_cli_parses_them() -> None:
    from memplan.integrations.torchtune import overrides

    recipe = omegaconf.OmegaConf.create({"batch_size": 1, "gradient_accumulation_steps": 1, "dtype": "bf16",
                                         "tokenizer": {"max_seq_len": None}, "compile": False})
    merged = omegaconf.OmegaConf.merge(recipe, omegaconf.OmegaConf.from_dotlist(
        quiet(overrides, plain(checkpoint_segments=1, optimizer_in_backward=True))))
    assert (merged.batch_size, merged.gradient_accumulation_steps, merged.dtype) == (8, 1, "fp32")
    assert merged.enable_activation_checkpointing is True and merged.optimizer_in_bwd is True
    assert merged.tokenizer.max_seq_len == 512


@pytest.mark.parametrize(("fields", "tool", "said"), [
    ({"optimizer_in_backward": True}, "hf", "optimizer step in backward"),
    ({"checkpoint_segments": 3}, "hf", "checkpoints 3 block(s)"),
    ({"checkpoint_segments": 2, "checkpoint_policy": "selective"}, "accelerate", "selective"),
    ({"precision": "bf16-true"}, "hf", "dtype=torch.bfloat16"),
    ({"precision": "bf16-mixed"}, "torchtune", "no mixed precision"),
    ({"offload_activations": True, "checkpoint_segments": 1}, "lightning", "saved activations"),
    ({"length_grouped": True}, "trl", "length-grouped"),
])
def test_what_a_tool_cannot_express_is_said(fields: dict, tool: str, said: str) -> None:
    plan = plain(**fields)
    assert any(said in line for line in caveats(plan, tool)), caveats(plan, tool)
    assert not any(said in line for line in caveats(plain(), tool))
    text = emit(plan, tool)
    if tool in ("hf", "trl", "lightning"):
        json.loads(text)  # the document stays valid: the caveats go beside it, not into it


def test_every_tool_emits_and_an_unknown_one_is_refused() -> None:
    plan = plain()
    assert all(emit(plan, tool) for tool in TOOLS)
    with pytest.raises(ConfigError, match="use one of hf, trl"):
        emit(plan, "deepspeed")


def test_plan_emit_prints_the_settings_and_the_caveats_on_stderr(tmp_path: Path, capsys) -> None:
    folder = write_tiny(tmp_path / "tiny")
    out = tmp_path / "args.json"
    run = subprocess.run([sys.executable, "-m", "memplan.cli", "plan", f"hf:{folder}", "--seq-len", "32",
                          "--vram", "1GB", "--trials", "3", "--probe-top", "0", "--compile-top", "0",
                          "--global-batch", "8", "--emit", "trl", "--emit-out", str(out), "--no-progress"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    written = json.loads(out.read_text())
    assert written["max_length"] == 32
    assert written["per_device_train_batch_size"] * written["gradient_accumulation_steps"] == 8
    assert f"trl settings written to {out}" in run.stdout
    # A usage error, refused before any search: the command line's own entry point, in-process.
    from memplan.cli import main
    assert main(["plan", f"hf:{folder}", "--seq-len", "32", "--emit-out", str(out)]) == 2
    assert "add --emit" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "said"), [
    (TrainConfig(micro_batch_size=2, grad_accum_steps=1, strategy="fsdp", world_size=4, dp_replicate=2),
     "within groups of 2 ranks (HSDP"),
    (TrainConfig(micro_batch_size=8, tp=2, sequence_parallel=True), "splits the model over tp 2"),
    (TrainConfig(micro_batch_size=2, pp=2, pp_microbatches=4), "cuts the model into pp 2 pipeline stages"),
])
def test_a_layout_the_tools_cannot_express_is_refused_with_the_way_to_train_it(config: TrainConfig, said: str) -> None:
    plan = plan_of(config, global_batch=config.global_batch)
    for tool in TOOLS:
        with pytest.raises(ConfigError, match=r"train it with memplan train MODEL\.py --plan plan\.json "
                                              rf"--nproc {config.ranks}") as info:
            emit(plan, tool)
        assert said in str(info.value) and "\n" not in str(info.value)

