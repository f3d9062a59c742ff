"""FSDP2's CPU offload: the configuration, the estimate (device and host memory, PCIe and CPU
time), the lower bound and the search that reaches for it when nothing else fits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.lm import LM_SOURCE

from estimators import ConfigError, Estimator, NoFeasiblePlanError, Task, TrainConfig, get_gpu
from estimators.probing._measure import measure_distributed_peaks
from estimators.timing._activation_offload_time import host_link_bytes_per_s
from estimators.timing._cpu_offload_time import HOST_BANDWIDTH
from memplan import search
from memplan.planning._objective import Objective
from memplan.planning._refusal import state_floor, techniques_used
from memplan.planning._space import CPU_OFFLOAD, build_space

OFFLOAD = TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=1, cpu_offload=True)
PLAIN = TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=1)


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("offload") / "lm.py"
    path.write_text(LM_SOURCE)
    return str(path)


@pytest.fixture(scope="module")
def lm(lm_path: str) -> Task:
    from estimators import load_task
    return load_task(lm_path)


def _state_bytes(task: Task) -> int:
    """fp32 weights, their gradients and AdamW's two moments: 16 bytes a parameter."""
    return 16 * sum(p.numel() for p in task.build_model().parameters())


def test_the_field_needs_fsdp_and_round_trips() -> None:
    with pytest.raises(ConfigError, match="cpu_offload is FSDP2's offload policy.*strategy='fsdp'"):
        TrainConfig(micro_batch_size=2, cpu_offload=True)
    with pytest.raises(ConfigError, match="cpu_offload"):
        TrainConfig(micro_batch_size=2, strategy="ddp", world_size=2, cpu_offload=True)
    assert TrainConfig.from_dict(OFFLOAD.to_dict()) == OFFLOAD
    assert "cpu_offload" not in PLAIN.to_dict()  # plans written before the field still load alike
    assert OFFLOAD.describe().endswith("fsdp x1, CPU offload")


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_cpu_estimate_matches_a_real_offloaded_run(lm_path: str, lm: Task) -> None:
    # On the CPU host and device are one memory: offloading moves nothing, and the estimate of
    # the offloaded step (FSDP2 with CPUOffloadPolicy, one gloo rank) must match its real peak.
    configs = [OFFLOAD, OFFLOAD.replace(precision="bf16-mixed", grad_accum_steps=2, checkpoint_segments=2)]
    measured = measure_distributed_peaks(lm_path, configs)
    estimator = Estimator(lm, device="cpu")
    for config, (rank0,) in zip(configs, measured, strict=True):
        est = estimator.estimate(config, exact=True)
        assert est.host_bytes == 0
        assert abs(est.peak_allocated_bytes - rank0.peak_bytes) <= 0.01 * rank0.peak_bytes, (
            config.describe(), est.peak_allocated_bytes, rank0.peak_bytes)


def test_gpu_estimate_moves_the_states_to_the_host(lm: Task) -> None:
    estimator = Estimator(lm, gpu="A100-80GB")
    plain = estimator.estimate(PLAIN, exact=True)
    offload = estimator.estimate(OFFLOAD, exact=True)
    states = _state_bytes(lm)
    # The host holds the sharded weights, gradients and AdamW's moments, plus what the
    # optimizer step allocates on the CPU (its temporaries: at most two fp32 copies).
    assert states <= offload.host_bytes <= states + 2 * states // 4, (offload.host_bytes, states)
    assert plain.host_bytes == 0
    # The device keeps no optimizer state and no gradient across the step.
    assert offload.breakdown["optimizer"] == 0 and offload.breakdown["gradients"] == 0
    assert plain.breakdown["optimizer"] > 0
    assert offload.peak_allocated_bytes < plain.peak_allocated_bytes
    assert any(n.startswith("CPU offload:") for n in offload.notes)


def test_offload_time_is_the_copies_compute_does_not_hide_and_the_cpu_step(lm: Task) -> None:
    estimator = Estimator(lm, gpu="RTX-4090")
    plain = estimator.estimate(PLAIN, exact=True)
    offload = estimator.estimate(OFFLOAD, exact=True)
    params = sum(p.numel() for p in lm.build_model().parameters())
    link = host_link_bytes_per_s(get_gpu("RTX-4090"))
    # At least the CPU's AdamW over its states (weights, grads, two moments read; three written).
    cpu_step = 7 * 4 * params / HOST_BANDWIDTH
    assert offload.step_time_s > plain.step_time_s + cpu_step * 0.9
    # A tiny model's compute hides nothing: the copies (weights twice in, gradients once out,
    # minus the overlap of the directions) show up whole, within the CPU step's margin.
    copies_lower = 2 * 4 * params / link
    assert offload.step_time_s - plain.step_time_s >= cpu_step * 0.9 + copies_lower * 0.5


def _wide(n: int = 6, d: int = 512) -> Task:
    """States dominate: 6 blocks of a 512x512 linear layer, a batch of 4 numbers per item."""
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, d), *[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)],
                             nn.Linear(d, 2))
    return Task(name="wide", build_model=build,
                sample_fn=lambda b: (torch.randn(b, 4), torch.randint(0, 2, (b,))),
                checkpoint_blocks=lambda m: [m[i] for i in range(1, n + 1)])


def test_floor_and_pruning_follow_the_technique() -> None:
    task = _wide()
    with torch.device("meta"):
        floor = state_floor(task, task.build_model())
    params = sum(p.numel() for p in task.build_model().parameters())
    fp32 = TrainConfig(micro_batch_size=2)
    true = TrainConfig(micro_batch_size=2, precision="bf16-true")
    off = TrainConfig(micro_batch_size=2, strategy="fsdp", cpu_offload=True, precision="bf16-mixed")
    assert floor.device(fp32) == 16 * params and floor.host(fp32) == 0
    assert floor.device(true) == 8 * params
    assert floor.host(off) == 16 * params
    # The root (first and last layers) and a block gathered, each with its gradients, in bf16.
    root, block = 4 * 512 + 512 + 512 * 2 + 2, 512 * 512 + 512
    assert floor.device(off) == 2 * (2 * root + 2 * block) < 16 * params // 4
    estimator = Estimator(task, gpu="RTX-4090")
    space = build_space(dataset_size=None, global_batch=8, precisions=("fp32", "bf16-true"), max_segments=6)
    limit = 8 * params - 1
    objective = Objective(space, estimator, limit, floor=floor, host_limit=10 * params)
    assert "model states alone" in objective.prune(fp32)[1]
    assert objective.prune(true) is not None  # 8 bytes a parameter, one above the limit
    assert "host memory" in objective.prune(off)[1]  # 16 bytes a parameter on a 10-byte host
    assert Objective(space, estimator, limit, floor=floor, host_limit=None).prune(off) is None


def test_pruning_by_an_estimate_that_does_not_fit() -> None:
    task = _wide()
    estimator = Estimator(task, device="cpu")
    space = build_space(dataset_size=None, global_batch=8, precisions=("fp32",), max_segments=6)
    small = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint_segments=2)
    est = estimator.estimate(small)
    objective = Objective(space, estimator, est.peak_bytes - 1)
    objective.cache[small] = est
    assert "which does not fit" in objective.prune(small.replace(micro_batch_size=4, grad_accum_steps=2))[1]
    assert objective.prune(small.replace(checkpoint_segments=1)) is not None
    # More checkpointing, another precision or accumulation 1 (no gradients held across a
    # micro-batch) may need less: only an estimate can tell.
    assert objective.prune(small.replace(checkpoint_segments=4)) is None
    assert objective.prune(small.replace(precision="bf16-mixed")) is None
    assert objective.prune(small.replace(micro_batch_size=8, grad_accum_steps=1)) is None


def test_search_offloads_when_nothing_else_fits() -> None:
    task = _wide(n=8, d=1024)
    params = sum(p.numel() for p in task.build_model().parameters())
    spec = get_gpu("RTX-4090")
    # Room (the margin kept) for 5 bytes a parameter beside the CUDA context: not for
    # bf16-true's 8, but for what offload leaves on the device (a block gathered, the
    # activations and cuBLAS' workspace).
    vram = int((spec.context_bytes + 5 * params) / 0.9)
    plan = search(task, gpu="RTX-4090", vram=vram, global_batch=8, trials=40, probe_top=0, seed=0,
                  host_memory=str(64 * params))
    assert plan.config.cpu_offload and plan.config.strategy == "fsdp" and plan.config.world_size == 1
    assert plan.best.predicted.host_bytes >= 8 * params
    assert any("cpu-offload" in n for n in plan.notes)
    assert "states offloaded (" in plan.table().splitlines()[3]  # the first row says so, with its host memory
    # Without room on the host for the offloaded states, nothing fits, and the refusal says
    # how much host memory would let them be tried. (Another host limit is a study of its own:
    # the first search's offloaded estimates do not answer for this one.)
    with pytest.raises(NoFeasiblePlanError) as info:
        search(task, gpu="RTX-4090", vram=vram, global_batch=8, trials=40, probe_top=0, seed=0,
               host_memory=str(4 * params))
    assert "try --host-memory" in str(info.value) and "of host memory, more than the" in str(info.value)


def test_refusal_names_the_techniques() -> None:
    task = _wide(n=8, d=1024)
    spec = get_gpu("RTX-4090")
    with pytest.raises(NoFeasiblePlanError) as info:
        search(task, gpu="RTX-4090", vram=spec.context_bytes + 1_000_000, global_batch=8, trials=10, probe_top=0)
    message = str(info.value)
    assert "even with" in message and "CPU offload" in message, message
    assert techniques_used(TrainConfig(micro_batch_size=1, precision="bf16-true", checkpoint_segments=4,
                                       checkpoint_policy="full", strategy="fsdp", cpu_offload=True)) \
        == "bf16-true, full checkpointing and CPU offload"
    assert CPU_OFFLOAD.apply(TrainConfig(micro_batch_size=1, strategy="ddp", world_size=2)).strategy == "ddp"


@pytest.mark.parametrize("config", [
    OFFLOAD.replace(precision="bf16-mixed", grad_accum_steps=2),
    TrainConfig(micro_batch_size=4, strategy="fsdp", world_size=4, precision="bf16-true", grad_accum_steps=3,
                checkpoint_segments=4, checkpoint_policy="selective"),
], ids=["offload", "fsdp x4"])
def test_fsdp_second_step_is_derived_as_traced(lm: Task, config: TrainConfig) -> None:
    # FSDP2 traces one step and derives the second (as one device does): the same peaks as
    # tracing both, on the device and on the host.
    from estimators.memory._prepare import prepare
    from estimators.memory._replay import replay
    from estimators.tracing._trace import trace_step

    def peak(synthesize: bool):
        trace = trace_step(lm, config, steps=2, target="cuda", capability=(8, 0), synthesize=synthesize)
        return trace, replay(prepare(trace, workspaces=None, cublas_workspace_bytes=None, notes=(), model=None), "cuda")

    derived, a = peak(True)
    traced, b = peak(False)
    assert (a.allocated, a.reserved, a.host) == (b.allocated, b.reserved, b.host)
    def priced(trace):  # step 2's kernels as the time model sees them
        ops = [o for o in trace.ops if o.moves_data and trace.phase_labels[o.phase].startswith("step 2")]
        return len(ops), sum(o.flops for o in ops), sum(o.bytes_moved for o in ops)

    # Not repeated: the ops that first made the storages FSDP2 re-allocates by resizing.
    assert priced(derived) == priced(traced)


def test_the_lower_bound_names_the_host_when_only_the_host_is_short() -> None:
    # 8 blocks of 1024x1024: bf16-true's states (8 bytes a parameter) do not fit a 40 MB room on
    # the card; offloaded they would, but the host may hold only 4 bytes a parameter.
    from memplan.planning._refusal import refuse_from_lower_bound
    from memplan.planning._space import frugal_space
    task = _wide(n=8, d=1024)
    with torch.device("meta"):
        model = task.build_model()
    floor = state_floor(task, model)
    params = floor.params
    estimator = Estimator(task, gpu="RTX-4090")
    space = build_space(dataset_size=None, global_batch=8, precisions=("bf16-mixed",), max_segments=8)
    wide = frugal_space(space, estimator, precisions_pinned=False)
    assert wide is not None and CPU_OFFLOAD in wide.techniques
    limit = 5 * params
    with pytest.raises(NoFeasiblePlanError) as info:
        refuse_from_lower_bound(task, floor, wide, int(limit / 0.9), limit, estimator, host_limit=4 * params)
    message = str(info.value)
    assert "even in bf16-true" in message and "--host-memory" in message and "of host memory" in message, message
    # With room on the host it is left to the search (nothing raised).
    refuse_from_lower_bound(task, floor, wide, int(limit / 0.9), limit, estimator, host_limit=64 * params)


def test_search_offloads_activations_when_only_that_fits() -> None:
    # Eight layers' saved activations at a large batch, small weights, checkpointing pinned
    # off: on a card, only moving the saved activations to the host makes room (backward's
    # own working set is a layer or two).
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 512), *[m for _ in range(8) for m in (nn.GELU(), nn.Linear(512, 512))],
                             nn.Linear(512, 2))
    task = Task(name="act", build_model=build, sample_fn=lambda b: (torch.randn(b, 64), torch.randint(0, 2, (b,))))
    estimator = Estimator(task, gpu="RTX-4090")
    plain = estimator.estimate(TrainConfig(micro_batch_size=4096))
    offloaded = estimator.estimate(TrainConfig(micro_batch_size=4096, offload_activations=True))
    assert offloaded.peak_bytes < plain.peak_bytes
    room = (offloaded.peak_bytes + plain.peak_bytes) // 2 + get_gpu("RTX-4090").context_bytes
    plan = search(task, gpu="RTX-4090", vram=int(room / 0.9), global_batch=4096, micro_batch_sizes=[4096],
                  checkpoint_segments=[0], trials=20, probe_top=0, precisions=["fp32"])
    assert plan.config.offload_activations and any("activation-offload" in n for n in plan.notes)


def test_a_probe_that_measured_the_offload_time_refits_only_the_rest(lm: Task) -> None:
    # A measured step includes what is priced apart (the copies, the CPU's optimizer step): a
    # probe that measured exactly the prediction leaves the prediction where it was.
    estimator = Estimator(lm, gpu="RTX-4090")
    before = estimator.estimate(OFFLOAD)
    assert before.time_parts is not None and before.time_parts["fixed"] > 0
    estimator.calibrate(OFFLOAD, before.step_time_s, predicted=before)
    assert estimator.estimate(OFFLOAD).step_time_s == pytest.approx(before.step_time_s, rel=1e-6)
    fresh = Estimator(lm, gpu="RTX-4090")
    fresh.calibrate(OFFLOAD, before.step_time_s)  # without the prediction: priced again
    assert fresh.estimate(OFFLOAD).step_time_s == pytest.approx(before.step_time_s, rel=1e-6)
