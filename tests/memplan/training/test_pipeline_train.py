"""Pipelines trained for real: 2 gloo processes, each holding a stage (two under interleaved
1F1B), match a single-process run of the same global batch step by step, evaluate alike,
write the whole model's weights, and resume from their sharded checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import ConfigError, TrainConfig, TrainingError, load_task
from memplan.training import LaunchSpec, TrainOptions, launch_training, train
from memplan.training._checkpoint_io import SHARDED_DIR, load_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

LM = ATTENTION_LM_SOURCE.replace("layers=3", "layers=4")


def opts(out: Path, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    kw.setdefault("schedule", "constant")
    kw.setdefault("ema_decay", 0.9)  # EMA weights of each stage, gathered into model.pt
    return TrainOptions(out_dir=out, **kw)


def records(out: Path, kind: str, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("type") == kind]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pp_train")
    path = root / "lm.py"
    path.write_text(LM)
    out = root / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), opts(out, max_steps=4, eval_every=2))
    return path, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_a_pipeline_matches_one_process(single: tuple[Path, Path], tmp_path: Path, schedule: str) -> None:
    path, reference = single
    # 4 micro-batches of 2: the single run's global batch of 8.
    config = TrainConfig(micro_batch_size=2, pp=2, pp_schedule=schedule, pp_microbatches=4)
    out = tmp_path / "run"
    spec = LaunchSpec(nproc_per_node=2, timeout_s=90)
    first = launch_training(path, config, opts(out, max_steps=2, eval_every=2), spec=spec)
    assert first is not None and first.steps == 2
    assert list((out / SHARDED_DIR).iterdir())  # each rank's stage in a torch.distributed.checkpoint folder
    result = launch_training(path, config, opts(out, max_steps=4, eval_every=2, resume=True), spec=spec)
    assert result is not None and result.steps == 4
    assert records(out, "step", "loss") == pytest.approx(records(reference, "step", "loss"), rel=1e-5)
    # 9 validation items in batches of 2: the last one is padded to the stages' shapes, and cut back.
    evals = records(out, "eval", "val_loss")
    assert len(evals) == 2 and evals == pytest.approx(records(reference, "eval", "val_loss"), rel=1e-5)
    got, want = load_checkpoint(out / "model.pt"), load_checkpoint(reference / "model.pt")
    assert got.keys() == want.keys()  # every stage's weights, under the model's own names
    for key in want:
        assert got[key].allclose(want[key], atol=1e-5, rtol=1e-4), key


def test_a_pipeline_runs_on_its_processes_only(single: tuple[Path, Path], tmp_path: Path) -> None:
    path, _ = single
    with pytest.raises(ConfigError, match="launch it with memplan train MODEL.py --plan plan.json --nproc 2"):
        train(load_task(path), TrainConfig(micro_batch_size=2, pp=2, pp_microbatches=2), opts(tmp_path / "one"))


@pytest.mark.timeout(120)
def test_dropout_is_refused_where_the_stages_would_evaluate_with_it(write_model, tmp_path: Path) -> None:
    # The stages are the forward exported in training mode: their dropout would stay on.
    path = write_model(LM.replace("        h = self.emb(x)", "        h = self.drop(self.emb(x))").replace(
        "        self.norm = nn.RMSNorm(d)", "        self.norm = nn.RMSNorm(d)\n        self.drop = nn.Dropout(0.1)"))
    with pytest.raises(TrainingError, match="has dropout, which a pipeline's stages keep on in evaluation"):
        launch_training(path, TrainConfig(micro_batch_size=2, pp=2, pp_microbatches=2),
                        opts(tmp_path / "run", max_steps=1), spec=LaunchSpec(nproc_per_node=2, timeout_s=60))
