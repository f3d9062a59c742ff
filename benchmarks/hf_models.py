"""Five Hugging Face architectures (Llama, Qwen2, Mistral, Gemma 2, Phi-3) planned from their
published configs for a 24 GB and an 80 GB card, and their CPU-sized versions against real CPU runs.

    python benchmarks/hf_models.py --out benchmarks/results/hf_models.md
    python benchmarks/hf_models.py --models gemma2 --no-gpu --out /tmp/hf.md      # one CPU row pair

Part 1 (no GPU needed): each published config in ``benchmarks/hf_configs/`` is made an ``hf:``
task (``estimators.hf_task``: the model built on the meta device, its own causal-LM loss) at
2048 tokens a sequence, a global batch of 16 sequences, for a full fine-tune (AdamW on every
parameter) and a LoRA fine-tune (rank 16, alpha 32, on the attention projections), and planned
for an RTX-4090 and an A100-80GB. Each cell estimates a small enumerated set of configurations
with one ``Estimator(task, gpu=...)`` (not ``memplan.search``: its study traces many more
structures, more than the ~15 minutes this part is given on two cores), in the order memplan's
search widens:

1. bf16-mixed, every block checkpointed, then no checkpointing;
2. only when nothing in 1 fits: bf16-true (weights, gradients and AdamW state in bf16), the same two;
3. only when nothing in 2 fits: FSDP2 on one device with CPU offload, bf16-true, every block
   checkpointed (4. bf16-mixed so, only when that does not fit either);

each at micro-batch 1, 2, 4, 8, 16 (accumulation making up 16) until one does not fit. A
configuration whose model states alone exceed the budget (memplan's ``state_floor``, the bound
its search refuses by) is counted as pruned, not estimated; a structure that does not fit at
micro-batch 1 checkpointed skips its no-checkpoint twin. The budget is the card's memory less
memplan's default 10% margin, against the predicted peak plus the CUDA context; offloaded
states must fit 128 GB of host memory. The best plan is the fastest predicted (samples/s).

Part 2 (on this CPU): per architecture a config of the same ``model_type`` scaled down (2
layers, hidden 96-144, vocabulary 1024, the head ratios, head-size quirks, soft-capping,
rope settings and bias flags of the published one) is estimated on the CPU target and measured
by ``estimators.probe`` (a real training run in a child process, the CPU allocator's peak),
full and LoRA, fp32 and bf16-mixed, at 128 tokens and micro-batch 4.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "benchmarks" / "hf_configs"

# key: (config file, the repo it is published in, LoRA targets)
MODELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama": ("llama-3.1-8b.json", "meta-llama/Llama-3.1-8B", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "qwen2": ("qwen2.5-7b.json", "Qwen/Qwen2.5-7B", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mistral": ("mistral-7b-v0.3.json", "mistralai/Mistral-7B-v0.3", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "gemma2": ("gemma-2-2b.json", "google/gemma-2-2b", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "phi3": ("phi-3-mini-4k-instruct.json", "microsoft/Phi-3-mini-4k-instruct", ("qkv_proj", "o_proj")),
}
TARGETS = ("RTX-4090", "A100-80GB")
SEQ = 2048
GLOBAL_BATCH = 16
LORA_RANK = 16
MARGIN = 0.10
HOST_MEMORY = 128 * 10**9
MICRO_BATCHES = (1, 2, 4, 8, 16)

# The CPU-sized versions: the published config with these fields replaced. Head counts keep the
# published query : key/value ratio (Llama, Mistral 4:1, Qwen2 7:1, Gemma 2 2:1, Phi-3 1:1), Gemma's
# head size stays apart from hidden / heads (256 x 8 = 2048 != 2304 published; 32 x 4 = 128 != 144
# here) with query_pre_attn_scalar = head size as published, and a sliding window shorter than the
# sequence where the architecture has one (Gemma 2's alternate layers, Phi-3's every layer), so the
# masks that matter at full length matter here. Token ids within the small vocabulary.
CPU_SEQ = 128
CPU_BATCH = 4
CPU_VOCAB = 1024
SMALL: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=128, intermediate_size=448, num_attention_heads=8, num_key_value_heads=2),
    "qwen2": dict(hidden_size=112, intermediate_size=592, num_attention_heads=7, num_key_value_heads=1,
                  max_window_layers=2),
    "mistral": dict(hidden_size=128, intermediate_size=448, num_attention_heads=8, num_key_value_heads=2),
    "gemma2": dict(hidden_size=144, intermediate_size=576, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, query_pre_attn_scalar=32, sliding_window=64),
    "phi3": dict(hidden_size=96, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8,
                 sliding_window=63),
}
SMALL_COMMON = dict(num_hidden_layers=2, vocab_size=CPU_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CPU_PRECISIONS = ("fp32", "bf16-mixed")


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _machine() -> list[str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:  # lscpu's model name, family and model (a VM may name only the vendor and line)
        fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                    timeout=30).stdout.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu = fields.get("Model name", cpu)
        if "CPU family" in fields:
            cpu += f" (lscpu: family {fields['CPU family']}, model {fields.get('Model', '?')}"
            cpu += f", {fields['Hypervisor vendor']} guest)" if "Hypervisor vendor" in fields else ")"
    except (OSError, subprocess.SubprocessError):
        pass
    isa = "unknown"
    # oneDNN names the ISA it dispatches to when its verbose mode is on (a convolution runs it).
    code = ("import torch; torch.ops.aten.mkldnn_convolution(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), None,"
            " [0, 0], [1, 1], [1, 1], 1)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
        isa = next((line.split("isa:", 1)[1] for line in out.splitlines() if ",isa:" in line), isa)
    except (OSError, subprocess.SubprocessError):
        pass
    import peft
    import transformers

    return [f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
            f"CPU: {cpu}, {os.cpu_count()} cores (shared with other jobs: wall times are noisy), "
            f"oneDNN ISA: {isa}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}",
            f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
            f"Python {platform.python_version()}; load average at start {os.getloadavg()[0]:.2f}"]


# -- part 1: published sizes on GPU targets ------------------------------------------------

def _structures(n_layers: int) -> list[list[dict[str, Any]]]:
    """The stages of structures (a TrainConfig without its batch), each tried only when nothing
    in the stages before fits."""
    offload = dict(strategy="fsdp", world_size=1, cpu_offload=True, checkpoint_segments=n_layers)
    return [
        [dict(precision="bf16-mixed", checkpoint_segments=n_layers), dict(precision="bf16-mixed")],
        [dict(precision="bf16-true", checkpoint_segments=n_layers), dict(precision="bf16-true")],
        [dict(precision="bf16-true", **offload)],
        [dict(precision="bf16-mixed", **offload)],
    ]


def plan_cell(task: Any, floor: Any, n_layers: int, target: str) -> dict[str, Any]:
    from estimators import Estimator, TrainConfig, get_gpu
    from memplan.planning._plan import excess_bytes, needed_bytes

    budget = get_gpu(target).memory_bytes
    limit = int(budget * (1 - MARGIN))
    est = Estimator(task, gpu=target)
    cell: dict[str, Any] = {"target": target, "budget": budget, "limit": limit, "estimated": 0, "pruned": 0}
    feasible: list[Any] = []
    smallest: tuple[int, str] | None = None  # the least memory an estimated configuration needs
    floor_least: tuple[int, str] | None = None  # else the least model-state bound of a pruned one
    notes: set[str] = set()
    t0 = time.perf_counter()
    for stage in _structures(n_layers):
        for i, structure in enumerate(stage):
            fit_at_1 = False
            for mb in MICRO_BATCHES:
                config = TrainConfig(micro_batch_size=mb, grad_accum_steps=GLOBAL_BATCH // mb, **structure)
                bound = floor.device(config)
                if bound > limit or floor.host(config) > HOST_MEMORY:
                    cell["pruned"] += 1  # the same bound at every micro-batch
                    if floor_least is None or bound < floor_least[0]:
                        floor_least = (bound, f"{config.describe()}, model states alone")
                    break
                t = time.perf_counter()
                e = est.estimate(config)
                cell["estimated"] += 1
                notes.update(n for n in e.notes if n.startswith("block stack"))
                need = needed_bytes(e)
                _log(f"    {target} {config.describe()}: peak {_gb(e.peak_bytes)}, {e.samples_per_s:.2f} samples/s "
                     f"({time.perf_counter() - t:.1f} s)")
                if smallest is None or need < smallest[0]:
                    smallest = (need, config.describe())
                if excess_bytes(e, limit, HOST_MEMORY) > 0:
                    break
                fit_at_1 = fit_at_1 or mb == 1
                feasible.append(e)
            if i == 0 and not fit_at_1:
                break  # its no-checkpoint twin needs more
        if feasible:
            break
    cell["wall_s"] = time.perf_counter() - t0
    cell["notes"] = sorted(notes)
    if feasible:
        best = max(feasible, key=lambda e: e.samples_per_s or 0.0)
        cell.update(status="plan", config=best.config.describe(), peak_bytes=best.peak_bytes,
                    needed_bytes=needed_bytes(best), host_bytes=best.host_bytes, step_time_s=best.step_time_s,
                    samples_per_s=best.samples_per_s, feasible=len(feasible))
    else:
        least = smallest or floor_least
        cell.update(status="none", smallest_bytes=least[0] if least else None,
                    smallest_config=least[1] if least else None)
    est.close()
    return cell


def gpu_part(models: list[str], modes: list[str], save: Any = None) -> list[dict[str, Any]]:
    import torch

    from estimators import hf_task
    from memplan.planning._refusal import state_floor

    rows = []
    for key in models:
        file, repo, targets = MODELS[key]
        for mode in modes:
            lora = mode == "lora"
            t0 = time.perf_counter()
            task = hf_task(str(CONFIGS / file), seq_len=SEQ, lora_rank=LORA_RANK if lora else None,
                           lora_targets=list(targets) if lora else None, name=f"{repo} ({mode})")
            with torch.device("meta"):
                model = task.build_model()
            floor = state_floor(task, model)
            n_layers = int(model.config.num_hidden_layers)
            params = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            del model
            build_s = time.perf_counter() - t0
            for target in TARGETS:
                _log(f"{repo} {mode} on {target} ...")
                cell = plan_cell(task, floor, n_layers, target)
                cell.update(model=key, repo=repo, mode=mode, params=params, trainable=trainable, layers=n_layers,
                            build_s=build_s if target == TARGETS[0] else 0.0)
                _log(f"  -> {cell.get('config', 'does not fit')} in {cell['wall_s']:.1f} s")
                rows.append(cell)
                if save is not None:
                    save(rows)
                gc.collect()
            del task
            gc.collect()
    return rows


# -- part 2: CPU-sized versions against real CPU runs --------------------------------------

def small_config(key: str, folder: Path) -> Path:
    data = json.loads((CONFIGS / MODELS[key][0]).read_text())
    data.update(SMALL_COMMON, **SMALL[key])
    if "head_dim" in data and "head_dim" not in SMALL[key]:
        data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}-small.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def cpu_part(models: list[str], modes: list[str], folder: Path) -> list[dict[str, Any]]:
    from estimators import Estimator, TrainConfig, hf_task, probe

    rows = []
    for key in models:
        path = small_config(key, folder)
        targets = MODELS[key][2]
        for mode in modes:
            lora = mode == "lora"
            task = hf_task(str(path), seq_len=CPU_SEQ, lora_rank=LORA_RANK if lora else None,
                           lora_targets=list(targets) if lora else None)
            est = Estimator(task, device="cpu")
            for precision in CPU_PRECISIONS:
                config = TrainConfig(micro_batch_size=CPU_BATCH, precision=precision)
                t0 = time.perf_counter()
                e = est.estimate(config)
                est_s = time.perf_counter() - t0
                m = probe(task, config, device="cpu", steps=3, warmup=2, timeout_s=300)
                row: dict[str, Any] = {"model": key, "mode": mode, "precision": precision, "params": e.params,
                                       "trainable": e.trainable_params, "predicted": e.peak_bytes,
                                       "predicted_step_s": e.step_time_s, "estimate_s": est_s,
                                       "status": m.status, "message": m.message}
                if m.status == "ok" and m.estimate is not None:
                    row.update(measured=m.estimate.peak_bytes, measured_step_s=m.estimate.step_time_s,
                               error_pct=100.0 * (e.peak_bytes - m.estimate.peak_bytes) / m.estimate.peak_bytes)
                _log(f"cpu {key} {mode} {precision}: predicted {_mb(e.peak_bytes)}, measured "
                     f"{_mb(row['measured']) if 'measured' in row else m.status}"
                     + (f" ({row['error_pct']:+.3f}%)" if "error_pct" in row else ""))
                rows.append(row)
            est.close()
    return rows


# -- the page ----------------------------------------------------------------------------

def render(command: str, machine: list[str], gpu_rows: list[dict], cpu_rows: list[dict], wall_s: float,
           cpu_wall_s: float | None, rendered: str = "") -> str:
    split = f"; the CPU part {cpu_wall_s / 60:.1f} min, the GPU targets the rest" if cpu_wall_s else ""
    lines = ["# Five Hugging Face architectures from their published configs", "",
             f"Command: `{command}` ({wall_s / 60:.1f} min wall{split})", ""]
    if rendered:
        lines += [f"Page rendered from its rows (`--save-json`) by `{rendered}`", ""]
    lines += [f"- {m}" for m in machine]
    lines += ["", "Published configs (`benchmarks/hf_configs/`, read offline as `hf:<file>`):", "",
              "| architecture | config file | published in | layers | hidden | heads / kv heads | head dim | "
              "intermediate | vocab | tied embeddings |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for key, (file, repo, _) in MODELS.items():
        d = json.loads((CONFIGS / file).read_text())
        head = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        tied = d.get("tie_word_embeddings", "default (" + ("yes" if key == "gemma2" else "no") + ")")
        lines.append(f"| {key} ({d['model_type']}) | `{file}` | [{repo}](https://huggingface.co/{repo}) | "
                     f"{d['num_hidden_layers']} | {d['hidden_size']} | {d['num_attention_heads']} / "
                     f"{d.get('num_key_value_heads', d['num_attention_heads'])} | {head} | {d['intermediate_size']} | "
                     f"{d['vocab_size']} | {tied} |")
    lines += ["", "## Published sizes on a 24 GB and an 80 GB card (predicted; no GPU here)", "",
              f"{SEQ} tokens a sequence, global batch {GLOBAL_BATCH} sequences ({SEQ * GLOBAL_BATCH:,} tokens a step), "
              "AdamW. Full: every parameter trained. LoRA: rank 16, alpha 32, no dropout, PEFT adapters on the "
              "attention projections (q/k/v/o_proj; Phi-3's fused qkv_proj and o_proj), the MLP frozen. "
              "Budget: the card's memory (RTX-4090 24 GiB = 25.8 GB, A100-80GB 80 GiB = 85.9 GB) less a 10% "
              "margin, against the predicted peak plus the CUDA context (0.4 GB); CPU offload's states against "
              "128 GB of host memory. GB = 1e9 bytes.", "",
              "Each cell is a small enumerated set of configurations estimated with `Estimator(task, gpu=...)` "
              "(see the script's docstring for the order): bf16-mixed with every block checkpointed or none; "
              "bf16-true only when nothing in bf16-mixed fits; FSDP2 CPU offload on one device only when "
              "nothing without it fits; micro-batch 1-16 with accumulation making up 16. *est.* counts the "
              "configurations estimated, *pruned* the structures refused by memplan's model-state bound "
              "(`state_floor`) without a trace (one count for all its micro-batches). *bf16-mixed* keeps "
              "fp32 weights (the frozen ones too, under LoRA) with bf16 autocast; *bf16-true* keeps "
              "weights, gradients and AdamW state in bf16. *planning*: the cell's wall time on this CPU, "
              "tracing included. Not tried: partial checkpointing, selective checkpointing, activation offload, the "
              "optimizer step in backward, fp32, several GPUs (memplan's search would).", "",
              "| model | fine-tune | card | best plan | peak (+ host) | step | samples/s | est. / pruned | planning |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in gpu_rows:
        name = f"{c['repo'].split('/')[-1]} ({c['params'] / 1e9:.2f}B)"
        mode = "full" if c["mode"] == "full" else f"LoRA r{LORA_RANK} ({c['trainable'] / 1e6:.1f}M trained)"
        if c["status"] == "plan":
            host = f" (+ {_gb(c['host_bytes'])} host)" if c.get("host_bytes", 0) > 1e8 else ""
            row = [c["config"], _gb(c["peak_bytes"]) + host, f"{c['step_time_s']:.2f} s", f"{c['samples_per_s']:.2f}"]
        else:
            smallest = (f"smallest seen {_gb(c['smallest_bytes'])} ({c['smallest_config']})"
                        if c.get("smallest_bytes") else "nothing estimated")
            row = [f"**does not fit** in {_gb(c['limit'])}: {smallest}", "—", "—", "—"]
        lines.append("| " + " | ".join([name, mode, c["target"], *row, f"{c['estimated']} / {c['pruned']}",
                                        f"{c['wall_s']:.0f} s"]) + " |")
    met: dict[str, list[str]] = {}  # memplan's trace notes (shortened) -> the cells that met them
    for c in gpu_rows:
        for n in c.get("notes", []):
            short = n if len(n) <= 110 else n[:n.index(" (") if " (" in n[:110] else 110] + " (…)"
            cell = f"{c['model']} {c['mode']}"
            if cell not in met.setdefault(short, []):
                met[short].append(cell)
    if met:
        lines += ["", "How memplan traced the block stacks (its own notes, shortened):", ""]
        lines += [f"- *{n}*: {', '.join(cells)}" for n, cells in sorted(met.items())]
    lines += ["", "## CPU-sized versions against real CPU runs", "",
              f"Each architecture's published config with {SMALL_COMMON['num_hidden_layers']} layers, vocabulary "
              f"{CPU_VOCAB} and the sizes below (everything else as published: rope settings and scaling, "
              "activation, norms, biases, Gemma 2's soft-capping and alternating sliding/global layers); "
              f"{CPU_SEQ} tokens, micro-batch {CPU_BATCH}, AdamW. *Predicted*: "
              "`Estimator(task, device='cpu').estimate`, the peak of a training step; *measured*: "
              "`estimators.probe(task, config, device='cpu', steps=3, warmup=2)`, real training steps in a "
              "child process, the peak of the CPU allocator's running total (profiler memory events). "
              "MB = 1e6 bytes. Error = (predicted - measured) / measured, and the difference in bytes. "
              "Step times are informational "
              "(2 shared cores, 1 intra-op thread). The scaled configs are written by `small_config` in the "
              "script, not kept.", "",
              "| architecture | replaced fields (besides 2 layers, vocabulary 1024) |", "|---|---|"]
    for key in dict.fromkeys(r["model"] for r in cpu_rows):
        lines.append(f"| {key} | " + ", ".join(f"{k} {v}" for k, v in SMALL[key].items()) + " |")
    lines += ["", "| architecture | fine-tune | precision | params (trained) | predicted peak | measured peak "
              "| error | "
              "predicted step | measured step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in cpu_rows:
        trained = f"{r['params'] / 1e3:.0f}k ({r['trainable'] / 1e3:.0f}k)"
        if "measured" in r:
            meas = [_mb(r["measured"]), f"{r['error_pct']:+.4f}% ({r['predicted'] - r['measured']:+,} B)",
                    f"{r['predicted_step_s'] * 1e3:.1f} ms",
                    f"{r['measured_step_s'] * 1e3:.1f} ms"]
        else:
            meas = [f"probe {r['status']}: {r['message'][:80]}", "—",
                    f"{(r['predicted_step_s'] or 0) * 1e3:.1f} ms", "—"]
        lines.append("| " + " | ".join([r["model"], r["mode"], r["precision"], trained, _mb(r["predicted"]),
                                        *meas]) + " |")
    errors = [abs(r["error_pct"]) for r in cpu_rows if "error_pct" in r]
    if errors:
        within = sum(e <= 1.0 for e in errors)
        lines += ["", f"Peak error: worst {max(errors):.4f}%, median {sorted(errors)[len(errors) // 2]:.4f}%; "
                      f"{within} of {len(errors)} within 1%."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the markdown page to write")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--no-gpu", action="store_true", help="skip part 1 (the published sizes on GPU targets)")
    ap.add_argument("--no-cpu", action="store_true", help="skip part 2 (the CPU-sized versions against real runs)")
    ap.add_argument("--summary", default="", help="a paragraph on what the figures say, put under the page's "
                    "header (a text or @file)")
    ap.add_argument("--notes", default="", help="notes put at the end of the page (a text or @file)")
    ap.add_argument("--save-json", help="keep the measured rows here as well (written after every GPU cell)")
    ap.add_argument("--from-json", help="render the page from rows kept by --save-json, running nothing")
    args = ap.parse_args()

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data["rendered"] = "python benchmarks/hf_models.py " + " ".join(sys.argv[1:])
        write_page(args.out, data, args.summary, args.notes)
        return

    import torch

    torch.set_num_threads(1)  # the cores are shared: one intra-op thread keeps the timings steadier
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data: dict[str, Any] = {"command": "python benchmarks/hf_models.py " + " ".join(sys.argv[1:]),
                            "machine": _machine(), "cpu_rows": [], "gpu_rows": [], "wall_s": 0.0}
    t0 = time.perf_counter()

    def save(gpu_rows: list[dict[str, Any]] | None = None) -> None:
        if gpu_rows is not None:
            data["gpu_rows"] = gpu_rows
        data["wall_s"] = time.perf_counter() - t0
        if args.save_json:
            Path(args.save_json).write_text(json.dumps(data, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        # An empty cache: every trace (and the CPU's measured rates) made by this run.
        os.environ["MEMPLAN_CACHE_DIR"] = str(Path(tmp) / "cache")
        if not args.no_cpu:
            data["cpu_rows"] = cpu_part(args.models, args.modes, Path(tmp) / "small")
            data["cpu_wall_s"] = time.perf_counter() - t0
            save()
        if not args.no_gpu:
            save(gpu_part(args.models, args.modes, save))
    save()
    print(write_page(args.out, data, args.summary, args.notes))


def write_page(out: str, data: dict[str, Any], summary: str, notes: str = "") -> str:
    """The page: its header (command, date, versions, CPU), then ``summary``, the tables, ``notes``
    (each a text or ``@file``)."""
    summary, notes = (Path(t[1:]).read_text().strip() if t.startswith("@") else t.strip() for t in (summary, notes))
    text = render(data["command"], data["machine"], data["gpu_rows"], data["cpu_rows"], data["wall_s"],
                  data.get("cpu_wall_s"), data.get("rendered", ""))
    if summary:
        head, rest = text.split("\n\nPublished configs (", 1)
        text = f"{head}\n\n{summary}\n\nPublished configs ({rest}"
    if notes:
        text += f"\n{notes}\n"
    Path(out).write_text(text)
    return text

if __name__ == "__main__":
    main()
