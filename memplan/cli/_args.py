"""The command line's arguments, shared by the commands: added to a parser, and read back.

Values stay strings until read here, so that a config file's keys (``_apply_config`` in
``cli``) fill them the way a flag does, and every count is checked by one parser.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypedDict

from estimators import (
    CHECKPOINT_POLICIES,
    ConfigError,
    Task,
    TrainConfig,
    load_source,
    normalize_precision,
    parse_count,
)

if TYPE_CHECKING:
    from ..training import LaunchSpec

__all__ = ["add_common_args", "add_hf_args", "task_from", "add_config_args", "config_from", "add_shape_policy", "add_search_args",
           "add_layout_args", "add_launch_args", "launch_spec", "layout_from", "search_kwargs", "add_train_args"]


def add_common_args(p: argparse.ArgumentParser) -> None:
    """What every command takes: the model file, the device, and quiet progress."""
    p.add_argument("model", help="model file (defines model(), train_data(), …), or hf:<repo id | directory | config.json>")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="target device type")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_hf_args(p: argparse.ArgumentParser) -> None:
    """How an ``hf:`` model is trained: what a model file's own functions say otherwise."""
    g = p.add_argument_group("Hugging Face models (hf:<repo id | directory | config.json>)")
    g.add_argument("--seq-len", default=None, help="tokens per sample (required for hf: models)")
    g.add_argument("--task", default=None, dest="hf_task",
                   help="the head trained: causal-lm (default), seq-cls (sequence classification) or masked-lm")
    g.add_argument("--num-labels", default=None, help="classes of the seq-cls head (default 2)")
    g.add_argument("--lora-rank", default=None, help="plan a PEFT LoRA fine-tune of this rank (the base frozen)")
    g.add_argument("--lora-targets", default=None,
                   help="modules given adapters, e.g. q_proj,v_proj (default: PEFT's for the architecture)")


def task_from(args: argparse.Namespace) -> Task:
    """The task of the command's model argument: a model file, or an ``hf:`` source with its flags."""
    def count(name: str, flag: str) -> int | None:
        value = getattr(args, name, None)
        return parse_count(value, what=flag) if value is not None else None

    return load_source(
        args.model,
        seq_len=count("seq_len", "--seq-len"),
        task=getattr(args, "hf_task", None),
        num_labels=count("num_labels", "--num-labels"),
        lora_rank=count("lora_rank", "--lora-rank"),
        lora_targets=_names(getattr(args, "lora_targets", None)),
    )


def add_config_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--batch-size", "-b", required=True, help="micro-batch size")
    p.add_argument("--accum", default="1", help="gradient-accumulation steps (default 1)")
    p.add_argument(
        "--precision", default="fp32", help="fp32 | bf16-mixed (bf16) | fp16-mixed (fp16, 16) | bf16-true | fp16-true"
    )
    p.add_argument("--checkpoint", default="0", help="activation-checkpointed blocks (0 = none)")
    p.add_argument("--checkpoint-policy", default="full", choices=CHECKPOINT_POLICIES,
                   help="what a checkpointed block keeps: full (its inputs only, default), selective (also every "
                   "matmul and attention output), op (torchtitan's: attention outputs and every other mm's)")
    p.add_argument("--gpu", default=None, help="plan for this card (e.g. A100-80GB) without having it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    g = p.add_argument_group("layout and memory techniques (one configuration: every field of the plan's config)")
    g.add_argument("--strategy", default=None, choices=("single", "ddp", "fsdp"),
                   help="single (default on one device), ddp or fsdp (FSDP2); needed with more than one device")
    g.add_argument("--gpus", default="1", help="devices per machine (default 1); ranks = --gpus x --nodes")
    g.add_argument("--nodes", default="1", help="machines the ranks are spread over (default 1)")
    g.add_argument("--tp", default="1",
                   help="tensor-parallel degree: each block's attention and MLP split over this many devices of a "
                   "machine (default 1); data-parallel replicas = ranks / tp")
    g.add_argument("--pp", default="1",
                   help="pipeline-parallel degree: the block stack cut into this many stages, one a device "
                   "(default 1; alone for now: no --strategy, no --tp)")
    g.add_argument("--pp-schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b"),
                   help="the pipeline's schedule (default 1f1b; interleaved-1f1b: two stages a device)")
    g.add_argument("--pp-microbatches", default=None,
                   help="micro-batches of --batch-size one pipeline step runs and accumulates (default: --pp); "
                   "--accum stays 1")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: each of the tp devices holds 1/tp of the sequence between the split linears "
                   "(the norms, the residual stream, the inputs checkpointed blocks keep)")
    g.add_argument("--dp-replicate", default="1",
                   help="HSDP with --strategy fsdp: the ranks form this many groups, each sharding the model over "
                   "ranks / N of them, and all-reduce their gradient shards across the groups (default 1: FSDP2)")
    g.add_argument("--cpu-offload", action="store_true",
                   help="FSDP2's CPU offload: parameters, gradients and optimizer state in host memory "
                   "(the strategy defaults to fsdp)")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep the tensors saved for backward in host memory between forward and backward")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter in backward as soon as its gradient is ready (one device, no --accum)")
    g.add_argument("--length-grouped", action="store_true",
                   help="batch items of similar size together (items of varying shape only)")


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The one configuration the flags of ``add_config_args`` describe; a bad mix of them is a
    ``ConfigError`` naming the flags."""
    gpus = parse_count(args.gpus, what="--gpus")
    nodes = parse_count(args.nodes, what="--nodes")
    segments = parse_count(args.checkpoint, what="--checkpoint", minimum=0)
    tp = parse_count(getattr(args, "tp", "1"), what="--tp")
    if gpus % tp:
        raise ConfigError(f"--tp {tp} splits over the devices of one machine, but --gpus is {gpus}; "
                          f"use a --tp that divides --gpus")
    pp = parse_count(getattr(args, "pp", "1"), what="--pp")
    given = getattr(args, "pp_microbatches", None)
    microbatches = parse_count(given, what="--pp-microbatches") if given is not None else pp
    if pp > 1 and (gpus * nodes) % (tp * pp):
        raise ConfigError(f"--pp {pp} stages take a device each, but --gpus {gpus} x --nodes {nodes} is "
                          f"{gpus * nodes}; use --gpus {tp * pp}")
    if pp == 1 and given is not None:
        raise ConfigError("--pp-microbatches are a pipeline's; add --pp N (N >= 2), or use --accum")
    if pp > 1 and parse_count(args.accum, what="--accum") > 1:
        raise ConfigError(f"a pipeline accumulates its own micro-batches; use --pp-microbatches {args.accum} "
                          "instead of --accum")
    world = gpus * nodes // (tp * pp)
    strategy = args.strategy
    if strategy is None:
        if world > 1:
            raise ConfigError(f"{world} data-parallel replicas (--gpus {gpus} x --nodes {nodes}"
                              + (f" / --tp {tp}" if tp > 1 else "") + ") need a data-parallel strategy; "
                              "add --strategy ddp or --strategy fsdp")
        strategy = "fsdp" if args.cpu_offload else "single"
    if strategy == "single" and world > 1:
        raise ConfigError(f"--strategy single has no data parallelism, but --gpus {gpus} x --nodes {nodes}"
                          + (f" / --tp {tp}" if tp > 1 else "") + f" is {world} replicas; "
                          "use --strategy ddp or fsdp, or drop --gpus/--nodes")
    if args.cpu_offload and strategy != "fsdp":
        raise ConfigError(f"--cpu-offload is FSDP2's offload, but --strategy is {strategy}; use --strategy fsdp "
                          "(one device offloads too)")
    dp_replicate = parse_count(getattr(args, "dp_replicate", "1"), what="--dp-replicate")
    if dp_replicate > 1 and strategy != "fsdp":
        raise ConfigError(f"--dp-replicate {dp_replicate} is HSDP, FSDP2's replicated shard groups, but --strategy is "
                          f"{strategy}; add --strategy fsdp")
    if dp_replicate > 1 and (world % dp_replicate or world // dp_replicate < 2):
        raise ConfigError(f"--dp-replicate {dp_replicate} does not split the {world} ranks into groups of 2 or more; "
                          "use a --dp-replicate that divides --gpus x --nodes into such groups")
    sequence_parallel = bool(getattr(args, "sequence_parallel", False))
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel devices; add --tp N "
                          "(N >= 2) or drop --sequence-parallel")
    if args.checkpoint_policy != "full" and segments == 0:
        raise ConfigError(f"--checkpoint-policy {args.checkpoint_policy} applies to checkpointed blocks; "
                          "add --checkpoint N (N >= 1 blocks)")
    return TrainConfig(
        micro_batch_size=parse_count(args.batch_size, what="--batch-size"),
        grad_accum_steps=parse_count(args.accum, what="--accum"),
        precision=normalize_precision(args.precision),
        checkpoint_segments=segments,
        checkpoint_policy=args.checkpoint_policy,
        strategy=strategy,
        world_size=world,
        nodes=nodes,
        tp=tp,
        pp=pp,
        pp_schedule=getattr(args, "pp_schedule", "1f1b"),
        pp_microbatches=microbatches,
        sequence_parallel=sequence_parallel,
        dp_replicate=dp_replicate,
        cpu_offload=args.cpu_offload,
        offload_activations=args.offload_activations,
        optimizer_in_backward=args.optimizer_in_backward,
        length_grouped=args.length_grouped,
    )


def add_shape_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape-policy",
        choices=["max", "p99"],
        default="max",
        help="items of varying shape: plan for the worst batch the loader can form (max, default) "
        "or the 99th percentile of an epoch's batches (p99; rarer ones are left to OOM recovery)",
    )


def add_search_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--config", default=None, help="a TOML file of options (memplan init writes one); flags override it")
    p.add_argument(
        "--precision",
        default=None,
        help="precisions to search, e.g. bf16-mixed,fp32 or bf16-true (default: what the device runs well; bf16-true too when nothing else fits)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint segments to search, e.g. 0 or 0,2 (default: 0, powers of two, every block)",
    )
    p.add_argument(
        "--micro-batch",
        default=None,
        help="micro-batch sizes to search, e.g. 8,16 (default: all that fit the global batch)",
    )
    p.add_argument("--strategy", default=None, help="strategies to search with --gpus > 1: ddp, fsdp or ddp,fsdp")
    p.add_argument(
        "--vram",
        default=None,
        help="memory budget, e.g. 12GB or 12GiB (default: the device's free memory; on CPU half the available RAM)",
    )
    p.add_argument("--gpu", default=None, help="plan for this card (e.g. A100-80GB) without having it")
    p.add_argument(
        "--host-memory",
        default=None,
        help="host RAM a GPU plan may fill with CPU-offloaded states, e.g. 64GB (default: this machine's RAM)",
    )
    p.add_argument(
        "--global-batch",
        default=None,
        help="samples per optimizer step, micro x accumulation x ranks: a training hyper-parameter, "
        "only how it is reached is searched (default: settings['global_batch'] of the model file, else 32)",
    )
    p.add_argument("--trials", default=None,
                   help="configurations to estimate (default 60, and every one of a space of up to 200 that "
                   "the model states do not rule out; given, a larger space than this is sampled)")
    p.add_argument(
        "--probe-top", default="2", help="best configurations to measure with real steps (default 2; 0 = none)"
    )
    p.add_argument(
        "--compile-top",
        default="1",
        help="best configurations to probe compiled with torch.compile (default 1; 0 = none)",
    )
    p.add_argument("--search-effort", default="0.1",
                   help="share of the predicted training time the probes, races and compiled probes may take "
                   "(default 0.1, at least a few seconds)")
    p.add_argument("--seed", default="0", help="sampler seed: same inputs, same plan")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite in ~/.cache/memplan); "
                   "a postgresql:// or mysql:// study is shared by every process given it (docs/shared_studies.md)")
    p.add_argument("--study-name", default=None,
                   help="plan: name the study (default: a hash of the inputs); a named study refuses other inputs")
    p.add_argument("--shared", action=argparse.BooleanOptionalAction, default=None,
                   help="plan: share the study with the other processes given the same --storage, also in SQLite; "
                   "--no-shared: one process, also on a database server (it reuses the study's estimates, and probes)")
    add_shape_policy(p)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus", default=None, help="devices per machine to plan for (default 1; more searches DDP and FSDP2)"
    )
    p.add_argument("--nodes", default=None, help="machines to plan for (default 1)")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed training (torchrun's options)")
    g.add_argument("--nproc", default=None, help="processes (devices) on this machine (default: what the plan needs)")
    g.add_argument("--nnodes", default="1", help="machines (default 1); run the same command on each")
    g.add_argument("--node-rank", default="0", help="this machine's rank (static rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the machines meet (default: this machine)")
    g.add_argument("--rdzv-id", default=None, help="the job's id, the same on every machine")
    g.add_argument("--rdzv-backend", default="c10d", help="c10d (default) or static")


def launch_spec(args: argparse.Namespace, nproc: int | None = None) -> LaunchSpec | None:
    """The launch asked for on the command line; None: none (the plan decides)."""
    from ..training import LaunchSpec

    nproc = nproc if nproc is not None else (parse_count(args.nproc, what="--nproc") if args.nproc else None)
    nnodes = parse_count(args.nnodes, what="--nnodes")
    if nproc is None and nnodes == 1:
        return None
    return LaunchSpec(
        nproc_per_node=nproc if nproc is not None else 1,
        nnodes=nnodes,
        node_rank=parse_count(args.node_rank, what="--node-rank", minimum=0),
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_backend=args.rdzv_backend,
    )


def layout_from(args: argparse.Namespace) -> tuple[int | None, int | None]:
    gpus = parse_count(args.gpus, what="--gpus") if args.gpus else None
    nodes = parse_count(args.nodes, what="--nodes") if args.nodes else None
    return gpus, nodes


def _counts(text: str | None, what: str, minimum: int = 1) -> list[int] | None:
    if text is None:
        return None
    return [parse_count(v.strip(), what=what, minimum=minimum) for v in str(text).split(",") if v.strip()]


def _effort(text: str) -> float:
    from ..planning._effort import check_search_effort

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value:  # not a number: the same one line as any other bad value
        raise ConfigError(f"--search-effort must be a number > 0 (the share of the predicted training time the "
                          f"probes, races and compiled probes may take; default 0.1), got {text!r}")
    return check_search_effort(value)


def _names(text: str | None) -> list[str] | None:
    return [v.strip() for v in str(text).split(",") if v.strip()] if text is not None else None


class _SharedStudyKwargs(TypedDict, total=False):
    """A shared study's keywords, passed only when given (``fit`` takes neither)."""

    study_name: str
    shared: bool


class SearchKwargs(_SharedStudyKwargs):
    """``search``'s keywords from the command line (``search_kwargs``)."""

    precisions: list[str] | None
    strategies: list[str] | None
    checkpoint_segments: list[int] | None
    micro_batch_sizes: list[int] | None
    vram: str | None
    gpu: str | None
    device: str | None
    global_batch: int | None
    trials: int | None
    probe_top: int
    compile_top: int
    seed: int
    storage: str | None
    shape_policy: str
    host_memory: str | None
    search_effort: float


def search_kwargs(args: argparse.Namespace) -> SearchKwargs:
    kwargs = SearchKwargs(
        precisions=_names(args.precision),
        strategies=_names(args.strategy),
        checkpoint_segments=_counts(args.checkpoint, "--checkpoint", minimum=0),
        micro_batch_sizes=_counts(args.micro_batch, "--micro-batch"),
        vram=args.vram,
        gpu=args.gpu,
        device=args.device,
        global_batch=parse_count(args.global_batch, what="--global-batch") if args.global_batch else None,
        trials=parse_count(args.trials, what="--trials") if args.trials is not None else None,
        probe_top=parse_count(args.probe_top, what="--probe-top", minimum=0),
        compile_top=parse_count(args.compile_top, what="--compile-top", minimum=0),
        seed=parse_count(args.seed, what="--seed", minimum=0),
        storage=args.storage,
        shape_policy=args.shape_policy,
        host_memory=args.host_memory,
        search_effort=_effort(args.search_effort),
    )
    # Only memplan plan passes them on (fit's search shares a study by its --storage alone).
    given = [f for f, v in (("--study-name", args.study_name), ("--shared", args.shared)) if v is not None]
    if given and getattr(args, "command", "plan") != "plan":
        raise ConfigError(f"{' and '.join(given)}: memplan plan's; memplan {args.command} shares a study through a "
                          "postgresql:// or mysql:// --storage, the study named by its inputs")
    if args.study_name is not None:
        kwargs["study_name"] = args.study_name
    if args.shared is not None:
        kwargs["shared"] = args.shared
    return kwargs


def add_train_args(p: argparse.ArgumentParser) -> None:
    from .._option_sources import add_option_flags

    p.add_argument("--out", default="memplan-run", help="output folder (default memplan-run)")
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT/checkpoint.pt (fit: with OUT/plan.json, no search)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh in an OUT that holds another run's results, deleting them"
    )
    add_option_flags(p)
