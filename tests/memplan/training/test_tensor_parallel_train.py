"""The 2-D layouts trained for real: 2 gloo processes (tp 2, and with sequence parallelism) and 4
(FSDP2 x 2 by tp 2; HSDP, 2 groups of 2) match a
single-process run of the same global batch step by step, write full weights, and resume from
their sharded checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import TrainConfig, load_task
from memplan.training import LaunchSpec, TrainOptions, launch_training, train
from memplan.training._checkpoint_io import SHARDED_DIR, load_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]


def opts(out: Path, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    kw.setdefault("schedule", "constant")
    kw.setdefault("ema_decay", 0.9)  # EMA weights of DTensor shards, gathered into model.pt
    return TrainOptions(out_dir=out, **kw)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r.get("type") == "step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp_train")
    path = root / "lm.py"
    path.write_text(ATTENTION_LM_SOURCE)
    out = root / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), opts(out, max_steps=4, eval_every=2))
    return path, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=8, tp=2),
    TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=2, tp=2),
    # The norms' weights get partial gradients from their part of the sequence, summed over
    # the tp ranks at each of the two micro-batches' accumulation.
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, tp=2, sequence_parallel=True),
    # HSDP: 2 groups of 2 FSDP2 ranks, 4 data-parallel replicas of 2 items each.
    TrainConfig(micro_batch_size=2, strategy="fsdp", world_size=4, dp_replicate=2),
], ids=["tp 2", "fsdp 2 x tp 2", "tp 2 sequence parallel", "hsdp 2 x 2"])
def test_tensor_parallel_matches_one_process(single: tuple[Path, Path], tmp_path: Path, config: TrainConfig) -> None:
    path, reference = single
    out = tmp_path / "run"
    # Stopped after 2 of 4 steps, then resumed from the sharded checkpoint by a new launch.
    spec = LaunchSpec(nproc_per_node=config.ranks, timeout_s=60)
    first = launch_training(path, config, opts(out, max_steps=2, eval_every=2), spec=spec)
    assert first is not None and first.steps == 2
    assert list((out / SHARDED_DIR).iterdir())  # the shards are in a torch.distributed.checkpoint folder
    result = launch_training(path, config, opts(out, max_steps=4, eval_every=2, resume=True), spec=spec)
    assert result is not None and result.steps == 4
    assert losses(out) == pytest.approx(losses(reference), rel=1e-5)
    got, want = load_checkpoint(out / "model.pt"), load_checkpoint(reference / "model.pt")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape, key  # full tensors, not a rank's shards
        assert got[key].allclose(want[key], atol=1e-5, rtol=1e-4), key
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("type") == "eval"]
    want_evals = [r for r in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())
                  if r.get("type") == "eval"]
    assert len(evals) == 2  # steps 2 and 4: 9 items sharded 5 + 4 over the replicas
    assert [e["val_loss"] for e in evals] == pytest.approx([e["val_loss"] for e in want_evals], rel=1e-5)
