"""Distributed training on CPU: 2 gloo processes launched in-process, as ``memplan train --nproc 2``
does. DDP and FSDP2 runs match a single-process run with the same global batch step by step;
FSDP2 checkpoints resume at another world size; an OOM on one rank only is recovered by every
rank; any other failure on one rank stops the run with a one-line error, no hang."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from estimators import TrainConfig, TrainingError, load_task
from memplan.training._checkpoint_io import SHARDED_DIR, load_checkpoint
from memplan.training import LaunchSpec, launch_training
from memplan.training import TrainOptions, Trainer, epoch_items, epoch_permutation, train

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

# A model with a block stack (FSDP2 shards each block), no dropout (so that runs can match
# exactly), validation data that does not split evenly over 2 ranks (9 items: 5 and 4), and
# failures on cue from environment variables the ranks inherit:
#   OOM_RANK/OOM_ABOVE/OOM_FROM_CALL: that rank runs out of memory inside the second block's
#     forward (after FSDP2 has all-gathered the first: the other rank is left mid-collective)
#     whenever the micro-batch is larger than OOM_ABOVE, from the block's OOM_FROM_CALL-th call on;
#   FAIL_RANK/FAIL_AT_CALL: that rank's forward raises ValueError at that call;
#   TERM_RANK/TERM_AT_CALL: that rank sends itself SIGTERM at that forward call.
MODEL = '''
import os
import signal
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

settings = {"lr": 0.05}

_calls = [0]

class Block(nn.Module):
    def __init__(self, width, index):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        limit = os.environ.get("OOM_ABOVE")
        self.calls = getattr(self, "calls", 0) + 1
        if (self.index == 1 and limit and os.environ.get("RANK") == os.environ.get("OOM_RANK")
                and x.shape[0] > int(limit) and self.calls >= int(os.environ.get("OOM_FROM_CALL", "1"))):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return torch.tanh(self.fc(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([Block(16, i) for i in range(3)])
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        _calls[0] += 1
        if os.environ.get("RANK") == os.environ.get("FAIL_RANK") and _calls[0] == int(os.environ.get("FAIL_AT_CALL", "0")):
            raise ValueError("the model fell over (injected by the test)")
        if os.environ.get("RANK") == os.environ.get("TERM_RANK") and _calls[0] == int(os.environ.get("TERM_AT_CALL", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())

def model():
    return Net()

def train_data():
    return _data(48, 1)

def val_data():
    return _data(9, 2)

'''

FAST = LaunchSpec(nproc_per_node=2, timeout_s=60)
"""The default start method, ``forkserver``: the first launch of the session starts the server
(it imports torch once), later launches fork from it in well under a second. A collective
that waits a minute fails (a hang would be a bug, reported, not waited out)."""


def opts(out: Path, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    kw.setdefault("schedule", "constant")
    kw.setdefault("eval_every", 3)
    kw.setdefault("ema_decay", 0.9)  # evaluated and written: EMA weights sharded, gathered, checkpointed
    return TrainOptions(out_dir=out, **kw)


def records(out_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir, "step")]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, micro-batch 8: global batch 8, 6 steps (one epoch)."""
    root = tmp_path_factory.mktemp("reference")
    path = root / "model.py"
    path.write_text(MODEL)
    out = root / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), opts(out, epochs=1))
    return {"losses": losses(out), "evals": records(out, "eval"), "weights": load_checkpoint(out / "model.pt"),
            "out": out}


def descendants() -> set[int]:
    """Live (not zombie) descendants of this process that are not multiprocessing's own helpers
    (the forkserver, which outlives a launch by design, and its resource tracker), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
        if b"multiprocessing.forkserver" in cmdline or b"multiprocessing.resource_tracker" in cmdline:
            parents.pop(int(stat.parent.name), None)
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def test_rank_shares_are_distributed_sampler_order() -> None:
    from torch.utils.data import DistributedSampler

    n, seed, world, epoch = 23, 5, 2, 3
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        perm = epoch_permutation(n, seed, epoch)[:epoch_items(n, world)].tolist()
        assert list(sampler) == perm[rank::world]


def write_plan(path: Path, *configs: TrainConfig, budget: int = 10**9) -> Path:
    """A hand-made plan: the configurations in order (the first is trained, the rest its ladder)."""
    from estimators import Estimate
    from memplan.planning import Plan, PlanEntry

    entries = tuple(
        PlanEntry(config=c, predicted=Estimate(
            config=c, device="cpu", gpu=None, peak_allocated_bytes=10**6 // (k + 1), peak_reserved_bytes=None,
            breakdown={}, peak_phase="backward", context_bytes=0, workspace_bytes=0, method="static",
            modelled=False, params=0, trainable_params=0, samples_per_s=100.0 / (k + 1)))
        for k, c in enumerate(configs))
    Plan(entries=entries, budget_bytes=budget, margin=0.1, device="cpu", gpu=None,
         global_batch=configs[0].global_batch, trials=len(configs)).save(path)
    return path


@pytest.mark.timeout(90)
def test_ddp_matches_single_process_with_the_same_global_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memplan.cli import main

    path = model_file(tmp_path)
    out = tmp_path / "ddp"
    # micro 2 x accumulation 2 x 2 ranks = 8: accumulation skips the sync of the first micro-batch.
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2, strategy="ddp", world_size=2)
    plan = write_plan(tmp_path / "plan.json", config)
    t0 = time.perf_counter()
    # The way users run it: the CLI.
    code = main(["train", str(path), "--plan", str(plan), "--nproc", "2", "--epochs", "1", "--out", str(out),
                 "--no-progress"])
    seconds = time.perf_counter() - t0
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert printed.out.startswith("done: 6 steps")
    # The single-process run with the CLI's defaults (cosine schedule, evaluation per epoch).
    single = tmp_path / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), TrainOptions(out_dir=single, epochs=1, progress=False))
    got, want = losses(out), losses(single)
    print(f"ddp x2 (CLI) in {seconds:.1f} s; losses {got}; single {want}")
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-5, abs=1e-6)
    evals, want_evals = records(out, "eval"), records(single, "eval")
    # Validation: 9 items sharded 5 + 4 over the ranks, sums all-reduced.
    assert len(evals) == 1 and evals[0]["val_loss"] == pytest.approx(want_evals[0]["val_loss"], rel=1e-5)
    assert evals[0]["val_accuracy"] == want_evals[0]["val_accuracy"]
    assert_same_weights(load_checkpoint(out / "model.pt"), load_checkpoint(single / "model.pt"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples_seen"] == 48 and summary["peak_memory_bytes"] > 0
    assert (out / "plan.json").exists() and not list(out.glob("failure-rank*.json"))


@pytest.mark.timeout(90)
def test_fsdp_matches_single_process_and_resumes_at_another_world_size(reference: dict[str, Any], tmp_path: Path) -> None:
    path = model_file(tmp_path)
    out = tmp_path / "fsdp"
    t0 = time.perf_counter()
    # micro 4 x 2 ranks = 8; the run stops after 3 of the 6 steps, with an FSDP (DCP) checkpoint.
    config = TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=2)
    result = launch_training(path, config, opts(out, epochs=1, max_steps=3), spec=FAST)
    seconds = time.perf_counter() - t0
    assert result is not None and result.steps == 3
    first = losses(out)
    assert first == pytest.approx(reference["losses"][:3], rel=1e-5, abs=1e-6)
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["model"] is None and ckpt["dcp"].startswith(SHARDED_DIR) and ckpt["world_size"] == 2
    assert (out / ckpt["dcp"] / ".metadata").exists()
    assert len(list((out / SHARDED_DIR).iterdir())) == 1  # older sharded checkpoints removed

    # Resume in one plain process (world size 1, same global batch): DCP reshards on load.
    t1 = time.perf_counter()
    resumed = Trainer(load_task(path), TrainConfig(micro_batch_size=8), opts(out, epochs=1, resume=True)).run()
    print(f"fsdp x2 3 steps in {seconds:.1f} s, resumed at W=1 in {time.perf_counter() - t1:.1f} s; "
          f"losses {losses(out)}; single {reference['losses']}")
    assert resumed.steps == 6
    assert losses(out) == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert [e["val_loss"] for e in records(out, "eval")] == pytest.approx(
        [e["val_loss"] for e in reference["evals"]], rel=1e-5)
    assert [e["val_accuracy"] for e in records(out, "eval")] == [e["val_accuracy"] for e in reference["evals"]]
    assert_same_weights(load_checkpoint(out / "model.pt"), reference["weights"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_oom_on_one_rank_is_recovered_by_all_ranks(strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    reference: dict[str, Any]) -> None:
    path = model_file(tmp_path)
    out = tmp_path / strategy
    # Rank 1 runs out of memory with micro-batches above 2 from step 4 on (after a checkpoint at
    # step 2 and an evaluation at step 3: its 5th forward pass under DDP, 6th under FSDP, where it
    # evaluates its 4 validation items plus one padding pass to match rank 0's 5): the plan's
    # micro 4 fails there, the next rung (micro 2 x accumulation 2, same global batch) fits.
    monkeypatch.setenv("OOM_RANK", "1")
    monkeypatch.setenv("OOM_ABOVE", "2")
    monkeypatch.setenv("OOM_FROM_CALL", "5" if strategy == "ddp" else "6")
    big = TrainConfig(micro_batch_size=4, strategy=strategy, world_size=2)
    ladder = [TrainConfig(micro_batch_size=2, grad_accum_steps=2, strategy=strategy, world_size=2),
              TrainConfig(micro_batch_size=1, grad_accum_steps=4, strategy=strategy, world_size=2)]
    t0 = time.perf_counter()
    result = launch_training(path, big, opts(out, epochs=1, checkpoint_every=2), spec=FAST, ladder=ladder)
    seconds = time.perf_counter() - t0
    assert result is not None and result.steps == 6 and not result.interrupted
    (event,) = records(out, "oom_recovery")
    assert event["step"] == 4 and event["phase"] == "forward" and event["ranks"] == [1]
    assert event["from"] == big.to_dict() and event["to"] == ladder[0].to_dict()
    if strategy == "ddp":  # rank 1 wrote a checkpoint of the failed window's start: nothing is redone
        assert event["window_start_checkpoint"] and event["resume_step"] == 3
    else:  # FSDP ranks hold shards only: back to the last checkpoint, steps 3-4 are redone
        assert not event["window_start_checkpoint"] and event["resume_step"] == 2
    assert "injected by the test" in event["error"] and event["seconds"] > 0
    print(f"{strategy}: recovered in {event['seconds']:.1f} s (relaunch included); run {seconds:.1f} s")
    # Nothing lost, nothing counted twice: the same losses as the single-process run (a step
    # logged before the failure and redone after it counts once, as redone).
    logged = {r["step"]: r["loss"] for r in records(out, "step")}
    assert [logged[k] for k in range(1, 7)] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert_same_weights(load_checkpoint(out / "model.pt"), reference["weights"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"] == ladder[0].to_dict() and len(summary["recoveries"]) == 1
    assert load_checkpoint(out / "checkpoint.pt")["config"] == ladder[0].to_dict()
    assert not list(out.glob("oom-rank*.json"))


@pytest.mark.timeout(90)
def test_another_error_on_one_rank_stops_the_run_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_file(tmp_path)
    monkeypatch.setenv("FAIL_RANK", "1")
    monkeypatch.setenv("FAIL_AT_CALL", "3")
    children_before = descendants()
    config = TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=2)
    t0 = time.perf_counter()
    with pytest.raises(TrainingError) as info:
        launch_training(path, config, opts(tmp_path / "fail", epochs=1), spec=FAST)
    seconds = time.perf_counter() - t0
    message = str(info.value)
    print(f"failed in {seconds:.1f} s: {message}")
    assert message.startswith("training failed on rank 1: ValueError: the model fell over") and "\n" not in message
    # Rank 0 fails in the broken collective and says so — unless torchrun's agent stops it
    # first (timing): then the message names the cause alone.
    assert ("stopped with it" not in message or "rank 0 stopped with it" in message) and "Traceback" in json.loads((tmp_path / "fail" / "failure-rank1.json").read_text())["traceback"]
    assert not descendants() - children_before  # no rank left running


@pytest.mark.timeout(60)
def test_an_oom_below_the_last_rung_is_one_line_naming_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_file(tmp_path)
    monkeypatch.setenv("OOM_RANK", "1")
    monkeypatch.setenv("OOM_ABOVE", "0")  # every micro-batch
    config = TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2)
    with pytest.raises(TrainingError) as info:
        launch_training(path, config, opts(tmp_path / "out", epochs=1), spec=FAST,
                        ladder=[TrainConfig(micro_batch_size=2, grad_accum_steps=2, strategy="ddp", world_size=2)])
    message = str(info.value)
    assert message.startswith("ran out of memory at step 1 in forward on rank(s) 1 with micro-batch 2, x2 accumulation")
    assert "no smaller configuration with the same global batch of 8" in message and "\n" not in message
    assert "tried: micro-batch 4, fp32, ddp x2; micro-batch 2, x2 accumulation, fp32, ddp x2" in message


@pytest.mark.timeout(60)
def test_sigterm_on_one_rank_stops_all_at_one_step_and_resumes(reference: dict[str, Any], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_file(tmp_path)
    out = tmp_path / "term"
    monkeypatch.setenv("TERM_RANK", "1")
    monkeypatch.setenv("TERM_AT_CALL", "2")  # during step 2, on rank 1 only
    config = TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2)
    first = launch_training(path, config, opts(out, epochs=1), spec=FAST)
    assert first is not None and first.interrupted and first.steps == 2
    assert first.summary["stop_signal"] == "peer"  # rank 0 stopped because rank 1 was told to
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2
    monkeypatch.delenv("TERM_RANK")
    resumed = launch_training(path, config, opts(out, epochs=1, resume=True), spec=FAST)
    assert resumed is not None and resumed.steps == 6 and not resumed.interrupted
    assert losses(out) == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert_same_weights(load_checkpoint(out / "model.pt"), reference["weights"])


@pytest.mark.timeout(90)
def test_fsdp_clips_by_value_as_one_process_does(tmp_path: Path) -> None:
    # Clipping by value works on each rank's gradient shards; the logged norm is the global one.
    path = model_file(tmp_path)
    common = dict(max_steps=3, grad_clip=0.01, grad_clip_mode="value", ema_decay=None)
    single = tmp_path / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), opts(single, **common))
    out = tmp_path / "fsdp"
    result = launch_training(path, TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=2),
                             opts(out, **common), spec=FAST)
    assert result is not None and result.steps == 3
    assert losses(out) == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
    norms = [r["grad_norm"] for r in records(out, "step")]
    assert norms == pytest.approx([r["grad_norm"] for r in records(single, "step")], rel=1e-5)
    assert min(norms) > 0.01  # the threshold did clip
    assert_same_weights(load_checkpoint(out / "model.pt"), load_checkpoint(single / "model.pt"))


@pytest.mark.timeout(120)
def test_cpu_offload_trains_as_one_process_does(reference: dict[str, Any], tmp_path: Path) -> None:
    # FSDP2's CPU offload is exact: one offloaded rank (a single device offloaded) and two
    # reach the plain run's losses, evaluations and weights, clipping and EMA included.
    path = model_file(tmp_path)
    for world, micro in ((1, 8), (2, 4)):
        out = tmp_path / f"offload{world}"
        config = TrainConfig(micro_batch_size=micro, strategy="fsdp", world_size=world, cpu_offload=True)
        result = launch_training(path, config, opts(out, epochs=1),
                                 spec=LaunchSpec(nproc_per_node=world, timeout_s=60))
        assert result is not None and result.steps == 6
        assert losses(out) == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), world
        assert [e["val_loss"] for e in records(out, "eval")] == pytest.approx(
            [e["val_loss"] for e in reference["evals"]], rel=1e-5)
        assert_same_weights(load_checkpoint(out / "model.pt"), reference["weights"])
