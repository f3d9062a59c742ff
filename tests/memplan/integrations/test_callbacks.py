"""memplan inside other trainers' loops, with the real packages, offline, on CPU.

* Hugging Face: a real ``Trainer`` with ``report_to=["tensorboard"]`` and ``MemplanCallback``
  writes the ``memplan/`` keys into the TensorBoard event file (read back), so they went the
  reporters' way; a global batch other than the plan's stops ``train`` with a one-line error.
* Lightning: a real ``Trainer`` gets the plan's batch size (the module's, the datamodule's)
  and accumulation, the steps see those batches, the loggers get the keys; 2 gloo ranks under
  ``torchrun`` each get the plan's micro-batch and accumulation for world size 2.
* accelerate: ``find_executable_batch_size`` with a function that runs out of memory above a
  batch size walks the plan's ladder and keeps the global batch; an exhausted ladder says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from estimators import ConfigError, TrainConfig, TrainingError
from helpers import plans
from helpers.plans import STEP_S, estimate
from memplan.planning import Plan, PlanEntry

pytestmark = pytest.mark.usefixtures("one_thread")

GLOBAL = 8


def plan_of(*configs: TrainConfig, global_batch: int = GLOBAL) -> Plan:
    """A plan of ``configs``, the first its choice."""
    return plans.plan_of(*configs, global_batch=global_batch)


def scalars(folder: Path) -> dict[str, list[float]]:
    """The scalars of every TensorBoard event file under ``folder``, by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[float]] = {}
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return out


# -- Hugging Face -------------------------------------------------------------------------------
import transformers  # noqa: E402 - CI installs the integrations extra: a missing one fails


def tiny_llama() -> Any:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tokens(n: int = 64, length: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_trainer(tmp_path: Path, plan: Plan | str, *, micro: int, accum: int, steps: int = 3) -> Any:
    from memplan.integrations.hf import MemplanCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=["tensorboard"], logging_steps=1,
        max_steps=steps, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-3)
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=tokens(),
                                callbacks=[MemplanCallback(plan)])


def test_hf_trainer_reports_the_memplan_keys_to_tensorboard(tmp_path: Path) -> None:
    from memplan.integrations.hf import MemplanCallback

    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    trainer = hf_trainer(tmp_path, plan, micro=2, accum=4)
    trainer.train()
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemplanCallback))
    assert len(callback.step_times) == 3

    # It ran first, before the TensorBoardCallback the Trainer put ahead of it.
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], MemplanCallback)
    assert any(type(cb).__name__ == "TensorBoardCallback" for cb in callbacks)
    found = scalars(tmp_path / "out")
    # The Trainer's reporters write training logs under train/: one a step, and the summary at the end.
    assert found["train/memplan/predicted_peak_bytes"] == [2_000_000.0] * 4
    assert found["train/memplan/predicted_step_s"] == [STEP_S] * 4
    measured = found["train/memplan/measured_step_s"]
    assert len(measured) == 4 and all(s > 0 for s in measured)
    assert measured[-1] == pytest.approx(sorted(callback.step_times)[1], rel=1e-6)  # the median of 3 steps
    if sys.platform.startswith("linux"):
        assert all(rss > 10 * 2**20 for rss in found["train/memplan/measured_max_rss_bytes"])
    # No CUDA here: no figure under the name of the allocator's peak.
    assert "train/memplan/measured_peak_bytes" not in found
    # The Trainer's own history has them too.
    assert all("memplan/measured_step_s" in h for h in trainer.state.log_history if "loss" in h)


def test_hf_trainer_with_another_global_batch_stops_with_the_fix(tmp_path: Path) -> None:
    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    path = plan.save(tmp_path / "plan.json")
    trainer = hf_trainer(tmp_path, str(path), micro=4, accum=4)
    with pytest.raises(ConfigError) as err:
        trainer.train()
    text = str(err.value)
    assert "\n" not in text
    assert "global batch is 16" in text and "global batch of 8" in text
    assert "memplan.integrations.hf.training_args(plan)" in text


def test_hf_same_global_batch_another_way_logs_no_predictions(tmp_path: Path) -> None:
    from memplan.integrations.hf import MemplanCallback

    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    callback = MemplanCallback(plan)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          per_device_train_batch_size=8, gradient_accumulation_steps=1)
    callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl())
    assert not any(k.startswith("memplan/predicted") for k in callback.figures())


# -- Lightning ---------------------------------------------------------------------------------
import lightning.pytorch as pl  # noqa: E402


class Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


class Net(pl.LightningModule):
    """A linear layer whose ``train_dataloader`` reads ``batch_size``; it records the batches."""

    def __init__(self, batch_size: int | None = 1) -> None:
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.shape[0])
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Items(), batch_size=self.batch_size)


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 1

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Items(), batch_size=self.batch_size)


class NetOfData(Net):
    """The same module, its data from a datamodule: no batch size of its own."""

    def __init__(self) -> None:
        super().__init__(batch_size=None)

    def train_dataloader(self) -> Any:
        raise AssertionError("the datamodule's loader is used")


def lightning_trainer(tmp_path: Path, callback: Any, steps: int = 2) -> Any:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1,
                      logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="tb"), callbacks=[callback],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))


@pytest.mark.parametrize("holder", ["module", "datamodule"])
def test_lightning_trainer_gets_the_plans_batch_and_accumulation(tmp_path: Path, holder: str) -> None:
    from memplan.integrations.lightning import MemplanCallback

    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    callback = MemplanCallback(plan)
    trainer = lightning_trainer(tmp_path, callback)
    if holder == "module":
        model, data = Net(batch_size=1), None
        trainer.fit(model)
        assert model.batch_size == 2
    else:
        model, data = NetOfData(), Data()
        trainer.fit(model, datamodule=data)
        assert data.batch_size == 2
    assert trainer.accumulate_grad_batches == 4
    assert model.seen == [2] * 8  # 2 optimizer steps of 4 micro-batches of 2
    assert trainer.global_step == 2
    assert len(callback.step_times) == 2
    found = scalars(tmp_path / "tb")
    assert found["memplan/predicted_peak_bytes"] == [2_000_000.0] * 2
    assert found["memplan/predicted_step_s"] == [STEP_S] * 2
    assert len(found["memplan/measured_step_s"]) == 2


def test_lightning_batch_size_it_cannot_set_stops_with_the_fix(tmp_path: Path) -> None:
    from memplan.integrations.lightning import MemplanCallback

    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    with pytest.raises(ConfigError, match=r"has no 'batch_size'.*batch_arg_name"):
        lightning_trainer(tmp_path, MemplanCallback(plan)).fit(Net(batch_size=None))
    # A DataLoader handed to fit is built already: the callback says so rather than train another batch.
    model = Net(batch_size=1)
    loader = torch.utils.data.DataLoader(Items(), batch_size=5)
    with pytest.raises(ConfigError, match=r"batch_size 5, not the plan's micro-batch of 2"):
        lightning_trainer(tmp_path, MemplanCallback(plan)).fit(model, train_dataloaders=loader)
    assert model.seen == []


def test_lightning_layout_for_another_world_size_keeps_the_global_batch() -> None:
    from memplan.integrations.lightning import MemplanCallback

    callback = MemplanCallback(plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=4)))
    assert callback.layout(1) == (2, 4)
    assert callback.layout(2) == (2, 2)
    assert callback.layout(4) == (2, 1)
    with pytest.raises(ConfigError, match=r"global batch of 8 .* 3 processes"):
        callback.layout(3)
    with pytest.raises(ConfigError, match="8 processes"):
        callback.layout(8)  # 2 x 8 is more than the global batch


DDP_SCRIPT = '''
import json, os, sys
import torch
import lightning.pytorch as pl
from memplan.integrations.lightning import MemplanCallback

torch.set_num_threads(1)

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.batch_size = 1
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.shape[0])
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=self.batch_size)

out = sys.argv[2]
model = Net()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                     callbacks=[MemplanCallback(sys.argv[1])], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
trainer.fit(model)
with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump({"world": trainer.world_size, "batch_size": model.batch_size, "seen": model.seen,
               "accumulate": trainer.accumulate_grad_batches, "steps": trainer.global_step}, f)
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_lightning_ddp_ranks_get_the_plans_batch_and_accumulation(tmp_path: Path) -> None:
    plan = plan_of(TrainConfig(micro_batch_size=2, grad_accum_steps=2, strategy="ddp", world_size=2),
                   TrainConfig(micro_batch_size=1, grad_accum_steps=4, strategy="ddp", world_size=2))
    path = plan.save(tmp_path / "plan.json")
    script = tmp_path / "ddp_fit.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torchrun starts the ranks: Lightning sees its environment and spawns nothing itself.
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(path), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"world": 2, "batch_size": 2, "seen": [2] * 4, "accumulate": 2, "steps": 2}


# -- accelerate --------------------------------------------------------------------------------
import accelerate.utils.memory as accelerate_memory  # noqa: E402

LADDER = (TrainConfig(micro_batch_size=8, grad_accum_steps=1), TrainConfig(micro_batch_size=4, grad_accum_steps=2),
          TrainConfig(micro_batch_size=2, grad_accum_steps=4), TrainConfig(micro_batch_size=1, grad_accum_steps=8))


def oom_above(limit: int, reduce: Any, calls: list[tuple[int, int]]) -> Any:
    """A training function that runs out of memory, as CUDA says it, above ``limit`` samples."""
    def train(batch_size: int) -> int:
        calls.append((batch_size, reduce.grad_accum_steps))
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 8.00 GiB total "
                                         "capacity; 6.50 GiB already allocated)")
        return batch_size * reduce.grad_accum_steps
    return train


def test_find_executable_batch_size_walks_the_ladder_keeping_the_global_batch() -> None:
    from memplan.integrations.accelerate import reduce_batch_size_fn
    from memplan.integrations.accelerate._batch import accumulation_for

    plan = plan_of(*LADDER)
    reduce = reduce_batch_size_fn(plan)
    assert reduce.starting_batch_size == plan.config.micro_batch_size == 8
    calls: list[tuple[int, int]] = []
    run = accelerate_memory.find_executable_batch_size(
        oom_above(2, reduce, calls), starting_batch_size=reduce.starting_batch_size, reduce_batch_size_fn=reduce)
    assert run() == GLOBAL
    assert calls == [(8, 1), (4, 2), (2, 4)]
    assert reduce.config == LADDER[2]
    assert [accumulation_for(plan, m) for m in (8, 4, 2, 1)] == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="does not divide the plan's global batch of 8"):
        accumulation_for(plan, 3)


def test_an_exhausted_ladder_says_so() -> None:
    from memplan.integrations.accelerate import reduce_batch_size_fn

    plan = plan_of(*LADDER)
    reduce = reduce_batch_size_fn(plan)
    calls: list[tuple[int, int]] = []
    run = accelerate_memory.find_executable_batch_size(
        oom_above(0, reduce, calls), starting_batch_size=8, reduce_batch_size_fn=reduce)
    with pytest.raises(TrainingError) as err:
        run()
    assert calls == [(8, 1), (4, 2), (2, 4), (1, 8)]
    text = str(err.value)
    assert "\n" not in text and "global batch of 8" in text and "--global-batch" in text
    assert isinstance(err.value.__context__, torch.OutOfMemoryError)


def test_rungs_a_batch_size_cannot_carry_are_skipped_unless_asked() -> None:
    from memplan.integrations.accelerate import reduce_batch_size_fn

    # Between micro-batch 8 and 4: micro-batch 8 recomputing a block, which a batch size cannot say.
    recompute = TrainConfig(micro_batch_size=8, grad_accum_steps=1, checkpoint_segments=1)
    entries = [PlanEntry(config=c, predicted=estimate(c)) for c in LADDER]
    entries.insert(1, PlanEntry(config=recompute, predicted=estimate(recompute, peak=6_000_000, speed=700.0)))
    plan = Plan(entries=tuple(entries), budget_bytes=10**9, margin=0.1, device="cpu", gpu=None,
                global_batch=GLOBAL, trials=len(entries))
    assert [e.config for e in plan.ladder()][:2] == [recompute, LADDER[1]]
    batch_only = reduce_batch_size_fn(plan)
    assert [batch_only(), batch_only(), batch_only()] == [4, 2, 1]
    whole = reduce_batch_size_fn(plan, batch_only=False)
    assert whole() == 8 and whole.config == recompute
    assert whole() == 4 and whole.grad_accum_steps == 2
