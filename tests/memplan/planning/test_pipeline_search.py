"""Pipeline layouts in the search: all the devices of one machine as stages, tried when nothing
fits with data parallelism alone, named in the plan's table, and a plan the trainer runs."""

from __future__ import annotations

from helpers.lm import ATTENTION_LM_SOURCE

from estimators import Task, TrainConfig, load_task
from memplan import search
from memplan.planning._space import Layout, build_space, layout_key, layouts_for, pipeline_layouts


def _lm(ns: dict[str, object] | None = None, layers: int = 3):
    ns = {} if ns is None else ns
    exec(ATTENTION_LM_SOURCE.replace("layers=3", f"layers={layers}"), ns)
    return ns["AttentionLM"]()  # type: ignore[operator]  # 3 blocks


def _space(gpus: int, nodes: int = 1):
    return build_space(dataset_size=None, global_batch=16, precisions=("fp32",), max_segments=2,
                       layouts=layouts_for(gpus, nodes))


def test_the_pipeline_is_every_device_of_one_machine_and_the_blocks_allow_it() -> None:
    model = _lm()
    task = Task(name="lm", build_model=lambda: model)
    assert pipeline_layouts(_space(2), task, model) == ((Layout("single", 1, 1, pp=2),), None)
    assert pipeline_layouts(_space(1), task, model) == ((), None)
    assert pipeline_layouts(_space(2, 2), task, model) == ((), None)  # stages over machines: not yet
    layouts, why = pipeline_layouts(_space(4), task, model)
    assert layouts == () and why is not None and "3 blocks, fewer than the 4 stages" in why
    custom = Task(name="lm", build_model=lambda: model, loss_fn=lambda m, b: m(b[0]).mean())
    assert "own" in (pipeline_layouts(_space(2), custom, model)[1] or "")
    # The pipeline's micro-batches are the accumulation; too few for 1F1B run as GPipe.
    layout = Layout("single", 1, 1, pp=2)
    assert layout.key == "pp 2 1f1b" and layout.ranks == 2
    config = _space(2).config(4, "fp32", 0, layout)
    assert (config.pp, config.pp_schedule, config.pp_microbatches, config.grad_accum_steps) == (2, "1f1b", 4, 1)
    assert config.global_batch == 16 and layout_key(config) == "pp 2 1f1b"
    few = _space(2).config(16, "fp32", 0, layout)
    assert (few.pp_schedule, few.pp_microbatches) == ("gpipe", 1) and layout_key(few) == "pp 2 gpipe"


def test_a_stack_of_two_blocks_a_device_is_also_searched_interleaved() -> None:
    model = _lm(layers=4)
    task = Task(name="lm", build_model=lambda: model)
    looped = Layout("single", 1, 1, pp=2, pp_schedule="interleaved-1f1b")
    assert pipeline_layouts(_space(2), task, model) == ((Layout("single", 1, 1, pp=2), looped), None)
    assert pipeline_layouts(_space(4), task, model) == ((Layout("single", 1, 1, pp=4),), None)
    config = _space(2).config(4, "fp32", 0, looped)
    assert (config.pp_schedule, config.pp_microbatches) == ("interleaved-1f1b", 4)
    assert layout_key(config) == "pp 2 interleaved-1f1b" and config.global_batch == 16
    # Rounds of pp micro-batches: a window of 3 runs plain 1F1B, one of 1 GPipe.
    odd = build_space(dataset_size=None, global_batch=6, precisions=("fp32",), max_segments=2,
                      layouts=(*layouts_for(2, 1), looped)).config(2, "fp32", 0, looped)
    assert (odd.pp_schedule, odd.pp_microbatches) == ("1f1b", 3)
    assert _space(2).config(16, "fp32", 0, looped).pp_schedule == "gpipe"


def test_a_pipeline_is_planned_when_nothing_else_fits(write_model) -> None:
    # A vocabulary of 4096 on a 64-wide model: the embedding and the head are most of the
    # weights. Two devices: DDP holds all of them, FSDP2 gathers a whole unit on top of its
    # half and keeps the root's (embedding, head) whole; a pipeline's stage holds one of the two.
    path = write_model(ATTENTION_LM_SOURCE.replace("vocab=256", "vocab=4096").replace("0, 256", "0, 4096"))
    task = load_task(path)
    # FSDP2 x 2 needs 12.3 MB at its smallest (micro-batch 1), a pipeline's fuller stage 11.5 MB.
    budget = 13_200_000
    plan = search(task, vram=str(budget), device="cpu", gpus=2, global_batch=8, probe_top=0, trials=30,
                  precisions=["fp32"], checkpoint_segments=[0], micro_batch_sizes=[1, 2])
    assert plan.best.config.pp == 2, plan.table()
    assert plan.best.config.global_batch == 8
    assert plan.best.predicted.peak_bytes <= budget
    row = next(line for line in plan.table().splitlines() if " pp 2 " in line)
    assert row.split()[1:3] == [str(plan.best.config.micro_batch_size), str(plan.best.config.pp_microbatches)]
    assert any("searched again with" in n for n in plan.notes), plan.notes
    assert TrainConfig.from_dict(plan.best.config.to_dict()) == plan.best.config
