"""Estimates of a block stack composed from cut traces against estimates of the whole model's trace.

    python benchmarks/compose_check.py --out benchmarks/results/compose_check.md
    python benchmarks/compose_check.py --models gpt_tied llama3-8b --targets cuda   # a few rows

For every benchmark and example model with a stack of three or more blocks (``benchmarks/models``,
``examples``, ``benchmarks/models_large.py``'s Llama sizes, Hugging Face decoders built from their
configs on the meta device: five architectures at a small size with 8 layers, and the published
configs in ``benchmarks/hf_configs/`` where that folder is there), each configuration is estimated
twice, by ``Estimator(task, ..., compose_blocks=True)`` and ``compose_blocks=False``, with
``exact=True`` (its own micro-batch traced), on the CPU (small models only: a CPU estimate runs the
model's kernels for their workspaces, so the benchmark and example models only, and five of the
layouts) and on an A100-80GB; the table gives the largest relative
difference of the peak allocated and peak reserved bytes (and the host bytes, and the step time)
over a model's configurations.

Configurations (n blocks): fp32 and bf16-mixed; n/3, n/2 (selective) and n blocks checkpointed;
activations offloaded to the host; FSDP2 on one device with CPU offload; FSDP2 on 2, 4 and 8 ranks
(the fake process group: one rank traced), checkpointed, one of them offloaded; DDP on 2 ranks.

The estimator composes only where the two cuts hold fewer blocks than the stack (a stack of 16 or
more, say); a shallower stack is traced whole whatever the setting. So that the shallow stacks'
compositions are checked too, the composed side here composes every stack the cuts can be made
for (``trace_composed(..., gain=False)``, as the tests do): column "default" says whether the
estimator itself composes that model. A stack whose blocks differ (Gemma 2's alternating
attention) or that cannot be cut is traced whole on both sides; its row says why.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
os.environ.pop("MEMPLAN_FULL_TRACE", None)

TOLERANCE = 1e-3  # the requirement: composed within 0.1% of whole

SMALL_HF: dict[str, tuple[str, dict[str, Any]]] = {
    # Small versions of the published architectures (head ratios, head-size quirks, windows kept).
    "hf-llama-small": ("LlamaConfig", dict(hidden_size=128, intermediate_size=448, num_attention_heads=8,
                                           num_key_value_heads=2)),
    "hf-qwen2-small": ("Qwen2Config", dict(hidden_size=112, intermediate_size=592, num_attention_heads=7,
                                           num_key_value_heads=1)),
    "hf-mistral-small": ("MistralConfig", dict(hidden_size=128, intermediate_size=448, num_attention_heads=8,
                                               num_key_value_heads=2, sliding_window=None)),
    "hf-phi3-small": ("Phi3Config", dict(hidden_size=96, intermediate_size=256, num_attention_heads=8,
                                         num_key_value_heads=8, sliding_window=63, pad_token_id=0)),
    "hf-gemma2-small": ("Gemma2Config", dict(hidden_size=144, intermediate_size=576, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                                             sliding_window=64)),
}
SMALL_COMMON = dict(num_hidden_layers=8, vocab_size=1024, bos_token_id=1, eos_token_id=2,
                    max_position_embeddings=512)


@dataclass
class Model:
    name: str
    make: Callable[[], Any]
    targets: tuple[str, ...]
    batch: int
    note: str = ""


@dataclass
class Row:
    model: str
    target: str
    blocks: int
    default: str
    configs: list[str] = field(default_factory=list)
    diffs: dict[str, float] = field(default_factory=lambda: {"allocated": 0.0, "reserved": 0.0, "host": 0.0,
                                                              "step": 0.0})
    worst: dict[str, str] = field(default_factory=dict)
    composed_s: float = 0.0
    whole_s: float = 0.0
    whole_only: str = ""
    failures: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def _load(path: str) -> Any:
    from estimators import load_task

    return load_task(str(ROOT / path))


def _large(kind: str, size: str) -> Any:
    import models_large

    return models_large.llama_task(size) if kind == "llama" else models_large.llama3_task(size, 2048)


def _small_hf(name: str, folder: Path) -> Any:
    import transformers

    from estimators import hf_task

    cls, values = SMALL_HF[name]
    path = folder / name
    getattr(transformers, cls)(**{**SMALL_COMMON, **values}).save_pretrained(path)
    return hf_task(str(path), seq_len=128)


def _published_hf(path: Path) -> Any:
    from estimators import hf_task

    return hf_task(str(path), seq_len=2048)


def models(folder: Path) -> list[Model]:
    out = [Model(Path(p).stem, functools.partial(_load, p), ("cpu", "cuda"), 4)
           for p in [*sorted(str(p.relative_to(ROOT)) for p in (HERE / "models").glob("*.py")),
                     "examples/digits.py", "examples/tiny_gpt.py"]]
    for name in ("bert_large", "bert_large_adafactor"):  # 335M parameters: CPU runs too slow here
        next(m for m in out if m.name == name).targets = ("cuda",)
    out += [Model(f"llama-{s}", functools.partial(_large, "llama", s), ("cuda",), 1) for s in ("1b", "7b")]
    out += [Model(f"llama3-{s}", functools.partial(_large, "llama3", s), ("cuda",), 1) for s in ("1b", "3b", "8b")]
    out += [Model(n, functools.partial(_small_hf, n, folder), ("cuda",), 4) for n in SMALL_HF]
    configs = ROOT / "benchmarks" / "hf_configs"
    if configs.is_dir():
        out += [Model(f"hf:{p.stem}", functools.partial(_published_hf, p), ("cuda",), 1)
                for p in sorted(configs.glob("*.json"))]
    return out


def configurations(n: int, batch: int, target: str) -> list[tuple[str, Any]]:
    from estimators import TrainConfig
    from estimators.tracing._compose import cut_patterns, stack_pattern

    def some(k: int) -> int:
        # k of n blocks checkpointed where cuts can be made for them (not 2 of 4: C P C P), else 1.
        k = max(1, k)
        return k if cut_patterns(stack_pattern(n, k), gain=False) is not None else 1

    b = dict(micro_batch_size=batch)
    third, half = some(n // 3), some(n // 2)
    out = [
        ("fp32", TrainConfig(**b)),
        ("bf16-mixed", TrainConfig(**b, precision="bf16-mixed")),
        (f"ckpt {third}/{n}", TrainConfig(**b, precision="bf16-mixed", checkpoint_segments=third)),
        (f"ckpt {half}/{n} selective", TrainConfig(**b, precision="bf16-mixed", checkpoint_segments=half,
                                                   checkpoint_policy="selective")),
        (f"ckpt {n}/{n} fp32", TrainConfig(**b, checkpoint_segments=n)),
        (f"activations offloaded, ckpt {half}/{n}", TrainConfig(**b, precision="bf16-mixed", checkpoint_segments=half,
                                                                 offload_activations=True)),
        ("fsdp2 x1 cpu-offload", TrainConfig(**b, precision="bf16-mixed", strategy="fsdp", world_size=1,
                                             cpu_offload=True, checkpoint_segments=n)),
    ]
    for w in (2, 4, 8):
        out.append((f"fsdp2 x{w}, ckpt {half}/{n}", TrainConfig(**b, precision="bf16-mixed", checkpoint_segments=half,
                                                               strategy="fsdp", world_size=w)))
    out.append((f"fsdp2 x4 cpu-offload, ckpt {half}/{n}",
                TrainConfig(**b, precision="bf16-mixed", checkpoint_segments=half, strategy="fsdp", world_size=4,
                            cpu_offload=True)))
    out.append(("ddp x2", TrainConfig(**b, precision="bf16-mixed", strategy="ddp", world_size=2)))
    if target == "cpu":
        # A CPU estimate runs the model's kernels for their workspaces (tens of seconds a
        # configuration here): a few layouts, activation offload (nothing moves on a CPU) left out.
        keep = ("fp32", "bf16-mixed", f"ckpt {third}/{n}", "fsdp2 x1 cpu-offload", f"fsdp2 x2, ckpt {half}/{n}")
        out = [(label, c) for label, c in out if label in keep]
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b if b else (0.0 if a == b else float("inf"))


@functools.cache
def _forced() -> None:
    """Compose every stack the cuts can be made for (gain=False), in this process."""
    from estimators.estimator import _traces
    from estimators.tracing._compose import trace_composed

    _traces.trace_composed = functools.partial(trace_composed, gain=False)


def check(model: Model, target: str, only: list[str] | None) -> Row:
    from estimators import Estimator
    from estimators.tracing._compose import cut_patterns, stack_facts, stack_pattern

    task = model.make()
    facts = stack_facts(task)
    n = facts.blocks
    row = Row(model.name, "CPU" if target == "cpu" else "A100-80GB", n, "")
    if n < 3:
        row.whole_only = f"no repeated block stack ({n} blocks): traced whole, not checked"
    elif facts.differs is not None:
        row.whole_only = f"traced whole ({facts.differs}), not checked"
    if row.whole_only:
        return row
    defaults = set()
    kw = {"device": "cpu"} if target == "cpu" else {"gpu": "A100-80GB"}
    composed = Estimator(task, compose_blocks=True, **kw)
    whole = Estimator(task, compose_blocks=False, **kw)
    for label, config in configurations(n, model.batch, target):
        if only and label not in only:
            continue
        defaults.add(cut_patterns(stack_pattern(n, config.checkpoint_segments)) is not None)
        try:
            t0 = time.perf_counter()
            c = composed.estimate(config, exact=True)
            t1 = time.perf_counter()
            w = whole.estimate(config, exact=True)
            t2 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a configuration the model cannot take: said in the row
            row.failures.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        row.composed_s += t1 - t0
        row.whole_s += t2 - t1
        notes = [x for x in c.notes if x.startswith("block stack")]
        if not any("composed" in x and "traced whole" not in x for x in notes):
            row.failures.append(f"{label}: not composed ({'; '.join(notes) or 'no note'})")
        row.configs.append(label)
        pairs = {"allocated": (c.peak_allocated_bytes, w.peak_allocated_bytes),
                 "reserved": (c.peak_reserved_bytes, w.peak_reserved_bytes),
                 "host": (c.host_bytes, w.host_bytes), "step": (c.step_time_s, w.step_time_s)}
        for key, (a, b) in pairs.items():
            d = _rel(a, b)
            if d > row.diffs[key] or key not in row.worst:
                row.diffs[key] = max(row.diffs[key], d)
                if d > 0:
                    row.worst[key] = label
            if key in ("allocated", "reserved") and d > TOLERANCE:
                row.mismatches.append(f"{label}: peak {key} composed {a} B, whole {b} B ({100 * d:+.4f}%)")
        _log(f"  {model.name} {target} {label}: allocated {c.peak_allocated_bytes} / {w.peak_allocated_bytes}, "
             f"reserved {c.peak_reserved_bytes} / {w.peak_reserved_bytes}, {t1 - t0:.1f} s / {t2 - t1:.1f} s"
             + (f" [{notes[0]}]" if notes else ""))
    composed.close()
    whole.close()
    row.default = {frozenset({True}): "yes", frozenset({False}): "no"}.get(frozenset(defaults), "some")
    return row


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.2g}%"


def render(command: str, rows: list[Row], wall_s: float) -> str:
    import torch
    import transformers

    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = ["# A block stack's estimate composed from cut traces against the whole model's trace", "",
             f"Command: `{command}` ({wall_s / 60:.1f} min wall)", "",
             f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu}, {os.cpu_count()} cores; "
             f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
             "- each cell: the largest relative difference, over the model's configurations, between "
             "`Estimator(compose_blocks=True)` (composing every stack the cuts can be made for) and "
             "`compose_blocks=False`, `exact=True`; requirement: peaks within 0.1%",
             "- configs: the configurations estimated both ways; composed: those of them the composed side "
             "composed (the others its composer refused, after checking the cuts, and traced whole: see below)",
             "- default: whether the estimator composes the model's stack by itself in these configurations "
             "(the cuts hold fewer blocks than the stack; some: in some of them)",
             ""]
    lines += ["| model | target | blocks | default | configs | composed | peak allocated | peak reserved | host | "
              "step time | composed s / whole s | within 0.1% |", "|---" * 12 + "|"]
    for r in (r for r in rows if not r.whole_only):
        ok = "yes" if not r.mismatches else "**no**"
        refused = sum("not composed" in f for f in r.failures)
        cells = [r.model, r.target, str(r.blocks), r.default,
                 str(len(r.configs)), f"{len(r.configs) - refused}", _pct(r.diffs["allocated"]), _pct(r.diffs["reserved"]), _pct(r.diffs["host"]),
                 _pct(r.diffs["step"]), f"{r.composed_s:.1f} / {r.whole_s:.1f}", ok]
        lines.append("| " + " | ".join(cells) + " |")
    worst = max((max(r.diffs["allocated"], r.diffs["reserved"]) for r in rows if r.configs), default=0.0)
    lines += ["", f"Largest difference of a peak (allocated or reserved) over every model, target and "
                  f"configuration: **{_pct(worst)}**."]
    whole_only = [r for r in rows if r.whole_only]
    if whole_only:
        lines += ["", "Not checked (no stack of three or more identical blocks: the estimator traces these whole "
                  "whatever the setting):", ""]
        lines += sorted({f"- {r.model}: {r.whole_only}" for r in whole_only})
    notes = [(r, x) for r in rows for x in r.mismatches + r.failures]
    if notes:
        lines += ["", "Mismatches, configurations not composed, and configurations a model cannot take:", ""]
        lines += [f"- {r.model} ({r.target}) {x}" for r, x in notes]
    lines += ["", "Configurations (n blocks; micro-batch 4 for the small models, 1 for the large): fp32; "
              "bf16-mixed; n/3 blocks checkpointed; n/2 selective; n of n fp32; activations offloaded (A100 "
              "only) with n/2 checkpointed; (a count of checkpointed blocks that no cuts can be made for, 2 of "
              "4, is 1 instead); FSDP2 on one device with CPU offload, every block checkpointed; "
              "FSDP2 on 2, 4 and 8 ranks (fake process group), n/2 checkpointed, and on 4 ranks with CPU "
              "offload; DDP on 2 ranks, bf16-mixed."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="model names (default: all)")
    ap.add_argument("--targets", nargs="*", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    ap.add_argument("--configs", nargs="*", help="configuration labels (default: all)")
    ap.add_argument("--out", help="write the results as markdown here")
    args = ap.parse_args()
    _forced()
    start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        for model in models(Path(folder)):
            if args.models and model.name not in args.models:
                continue
            for target in model.targets:
                if target not in args.targets:
                    continue
                _log(f"{model.name} on {target}")
                rows.append(check(model, target, args.configs))
    command = "python benchmarks/compose_check.py " + " ".join(sys.argv[1:])
    text = render(command.strip(), rows, time.perf_counter() - start)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
