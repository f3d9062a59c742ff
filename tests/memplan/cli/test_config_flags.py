"""Every field of a configuration is a flag of ``memplan estimate`` and ``memplan probe``: the
flags build the configuration the Python API would, the estimate is that configuration's, and
a bad mix of them is one line naming the flags, exit code 2."""

from __future__ import annotations

import json

import pytest

from estimators import Estimator, TrainConfig, load_task
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
"""


def _estimate(capsys: pytest.CaptureFixture[str], path: str, *argv: str) -> tuple[int, dict, str]:
    code = main(["estimate", path, "--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else {}), err


@pytest.mark.parametrize("argv, config", [
    (["-b", "4", "--gpus", "2", "--nodes", "2", "--strategy", "fsdp", "--checkpoint", "2",
      "--checkpoint-policy", "op", "--precision", "bf16", "--offload-activations"],
     TrainConfig(micro_batch_size=4, precision="bf16-mixed", strategy="fsdp", world_size=4, nodes=2,
                 checkpoint_segments=2, checkpoint_policy="op", offload_activations=True)),
    (["-b", "4", "--cpu-offload"], TrainConfig(micro_batch_size=4, strategy="fsdp", cpu_offload=True)),
    (["-b", "2", "--accum", "3", "--gpus", "2", "--strategy", "ddp", "--checkpoint", "1", "--checkpoint-policy",
      "selective"],
     TrainConfig(micro_batch_size=2, grad_accum_steps=3, strategy="ddp", world_size=2, checkpoint_segments=1,
                 checkpoint_policy="selective")),
    (["-b", "4", "--length-grouped"], TrainConfig(micro_batch_size=4, length_grouped=True)),
    (["-b", "4", "--gpus", "2", "--nodes", "2", "--strategy", "fsdp", "--dp-replicate", "2"],
     TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=4, nodes=2, dp_replicate=2)),
], ids=["fsdp-over-nodes-op-policy", "cpu-offload", "ddp-selective", "length-grouped", "hsdp"])
def test_the_flags_build_the_configuration_and_estimate_it(argv, config, write_model, capsys) -> None:
    path = write_model(MODEL)
    code, data, err = _estimate(capsys, path, "--gpu", "A100-80GB", *argv)
    assert code == 0, err
    assert TrainConfig.from_dict(data["config"]) == config
    # The same estimate as the Python API's for that configuration.
    expected = Estimator(load_task(path), gpu="A100-80GB").shape_distribution(config, exact=True)
    assert data["peak_allocated_bytes"] == expected.peak_allocated_bytes


@pytest.mark.parametrize("argv, expected", [
    (["--gpus", "2"], "add --strategy ddp or --strategy fsdp"),
    (["--gpus", "2", "--strategy", "single"], "--strategy single has no data parallelism"),
    (["--cpu-offload", "--strategy", "ddp"], "--cpu-offload is FSDP2's offload"),
    (["--checkpoint-policy", "op"], "add --checkpoint N"),
    (["--nodes", "0"], "--nodes must be a whole number"),
    (["--optimizer-in-backward", "--accum", "2"], "cannot accumulate"),
    (["--tp", "3", "--gpus", "2"], "--tp 3 splits over the devices of one machine"),
    (["--tp", "2", "--gpus", "4"], "2 data-parallel replicas (--gpus 4 x --nodes 1 / --tp 2) need a data-parallel"),
    # The split is the model's: this one has no attention or MLP linears to split.
    (["--tp", "2", "--gpus", "2"], "tensor parallelism found nothing to split"),
    (["--sequence-parallel"], "--sequence-parallel splits the sequence over the tensor-parallel devices; add --tp"),
    (["--dp-replicate", "2", "--gpus", "4", "--strategy", "ddp"], "--dp-replicate 2 is HSDP"),
    (["--dp-replicate", "3", "--gpus", "4", "--strategy", "fsdp"], "--dp-replicate 3 does not split the 4 ranks"),
    (["--pp", "2"], "--pp 2 stages take a device each, but --gpus 1 x --nodes 1 is 1; use --gpus 2"),
    (["--pp-microbatches", "4"], "--pp-microbatches are a pipeline's; add --pp N"),
    (["--pp", "2", "--gpus", "2", "--accum", "4"], "use --pp-microbatches 4 instead of --accum"),
    (["--pp", "2", "--gpus", "2", "--pp-microbatches", "1"], "1f1b schedule needs at least as many micro-batches"),
    (["--pp", "2", "--gpus", "4", "--strategy", "fsdp"], "pp 2 is not combined with data parallelism"),
    # The flag reaches the step's checks: the default step clips by the global norm.
    (["--optimizer-in-backward"], "optimizer_in_backward cannot clip by the global gradient norm"),
])
def test_a_bad_mix_of_flags_is_one_line_naming_them(argv, expected, write_model, capsys) -> None:
    path = write_model(MODEL)
    code, _, err = _estimate(capsys, path, "-b", "4", *argv)
    assert code == 2
    assert err.count("\n") == 1 and expected in err, err


def test_tensor_parallel_flags_estimate_a_rank_of_the_split_model(write_model, capsys) -> None:
    from helpers.lm import ATTENTION_LM_SOURCE

    path = write_model(ATTENTION_LM_SOURCE)
    code, data, err = _estimate(capsys, path, "-b", "16", "--gpus", "4", "--tp", "2", "--strategy", "fsdp")
    assert code == 0, err
    config = TrainConfig(micro_batch_size=16, strategy="fsdp", world_size=2, tp=2)
    assert TrainConfig.from_dict(data["config"]) == config
    expected = Estimator(load_task(path)).shape_distribution(config, exact=True)
    assert data["peak_allocated_bytes"] == expected.peak_allocated_bytes
    code, whole, err = _estimate(capsys, path, "-b", "16", "--gpus", "2", "--strategy", "fsdp")
    assert code == 0, err
    assert data["peak_allocated_bytes"] < whole["peak_allocated_bytes"]
    # Sequence parallel: the same split, the stream between the pairs a half on each rank.
    code, sp, err = _estimate(capsys, path, "-b", "16", "--gpus", "4", "--tp", "2", "--strategy", "fsdp",
                              "--sequence-parallel")
    assert code == 0, err
    assert TrainConfig.from_dict(sp["config"]) == config.replace(sequence_parallel=True)
    assert sp["peak_allocated_bytes"] < data["peak_allocated_bytes"]


def test_pipeline_flags_estimate_the_fullest_stage(write_model, capsys) -> None:
    from helpers.lm import ATTENTION_LM_SOURCE

    path = write_model(ATTENTION_LM_SOURCE.replace("layers=3", "layers=4"))
    # For a card: the flags are what is tested, and a card's estimate measures no CPU kernels.
    card = ("--gpu", "H100-80GB")
    code, data, err = _estimate(capsys, path, "-b", "4", "--gpus", "2", "--pp", "2", "--pp-schedule", "gpipe",
                                "--pp-microbatches", "4", *card)
    assert code == 0, err
    config = TrainConfig(micro_batch_size=4, pp=2, pp_schedule="gpipe", pp_microbatches=4)
    assert TrainConfig.from_dict(data["config"]) == config
    expected = Estimator(load_task(path), gpu=card[1]).shape_distribution(config, exact=True)
    assert data["peak_allocated_bytes"] == expected.peak_allocated_bytes
    assert any("pipeline: traced stages' peaks rank 0" in n for n in data["notes"])
    # 1F1B holds fewer micro-batches' activations than GPipe; the default is one a stage.
    code, f1b, err = _estimate(capsys, path, "-b", "4", "--gpus", "2", "--pp", "2", *card)
    assert code == 0, err
    assert TrainConfig.from_dict(f1b["config"]) == config.replace(pp_schedule="1f1b", pp_microbatches=2)
    code, f1b4, err = _estimate(capsys, path, "-b", "4", "--gpus", "2", "--pp", "2", "--pp-microbatches", "4", *card)
    assert code == 0, err
    assert f1b4["peak_allocated_bytes"] < data["peak_allocated_bytes"]


def test_a_probe_of_several_ranks_is_refused_in_one_line(write_model, capsys) -> None:
    path = write_model(MODEL)
    code = main(["probe", path, "-b", "4", "--gpus", "2", "--strategy", "ddp"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "probes run one process" in err, err
    code = main(["probe", path, "-b", "4", "--gpus", "2", "--pp", "2"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "pp 2 needs 2" in err, err
