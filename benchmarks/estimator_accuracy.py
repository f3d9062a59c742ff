"""Accuracy and speed of the static estimator against the CPU allocator's real peak.

For every model file (``benchmarks/models/*.py`` and ``examples/{digits,tiny_gpt}.py``) a
subprocess builds ONE ``Estimator(task, device="cpu")`` and estimates a grid of training
configurations with it — micro-batch sizes that are not the traced anchors (2, 3, 4), so
they are predicted by batch scaling — then measures each configuration for real with
``measure_cpu_peak`` (``torch.profiler``'s allocation events: the reference). One model per
process, so a crash (or a oneDNN refusal) in one model cannot take the benchmark down and
one model's memory does not leak into the next measurement.

A GPT-2-124M-sized model is then estimated for an A100-80GB (fake tensors only) to time a
first estimate and a further batch size, with the process's max RSS as proof that nothing
of the model's size was allocated.

    python benchmarks/estimator_accuracy.py [--quick | --full] [--models a,b] [--out FILE]
    python benchmarks/estimator_accuracy.py --shapes     # the variable-shape cases alone

Data of varying shape (padded text, images of several sizes, data-dependent routing) is
measured by ``benchmarks/variable_shapes.py``: the report's "Variable-shape data" section,
which ``--shapes`` rewrites in place, leaving the rest of the report as it is.

The default grid per model: micro-batch 5, 16, 48 (5, 16, 24 for the models whose real runs
are slow) over four (precision, accumulation, checkpointing) shapes — a half fraction of the
2x2x2 combinations in which every pair of axes shows all four of its combinations:
fp32/1/none and bf16/1/max at every batch size, fp32/2/max and bf16/2/none at the smallest.
``--full`` runs all eight shapes at every batch size; ``--quick`` fp32/1/none at every batch
size and bf16/2/max at the middle one. A config whose real run fails is reported as "not
runnable here" and left out of the statistics; a failed estimate is a counted failure.

Progress goes to stderr; the report (Markdown) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "benchmarks" / "models"
EXAMPLES = (ROOT / "examples" / "digits.py", ROOT / "examples" / "tiny_gpt.py")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "estimator.md"

BATCHES = (5, 16, 48)
"""Micro-batch sizes of the grid: none is an anchor (2, 3, 4) of batch scaling."""
HEAVY = {"cnn_bn", "encdec", "vit", "gpt_tied", "tiny_gpt"}
HEAVY_BATCHES = (5, 16, 24)
"""Models whose real runs at batch 48 (bf16 above all: no native bf16 GEMMs on most CPUs)
take tens of seconds each on 2 cores: their largest batch is 24, to keep the benchmark short."""
GOAL_MEDIAN_PCT = 1.0
GOAL_MAX_PCT = 3.0
GOAL_FIRST_S = 10.0
GOAL_FURTHER_S = 0.050
MODEL_TIMEOUT_S = 600
SPEED_TIMEOUT_S = 300


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    line = line.split(" Run workload with environment variable ONEDNN_VERBOSE")[0]  # oneDNN's boilerplate
    return line if len(line) <= 300 else line[:297] + "..."


# ---------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------

def grid(max_ck: int, batches: tuple[int, int, int], *, quick: bool, full: bool) -> list[tuple[str, int, int, int]]:
    """(precision, accumulation, checkpoint segments, micro-batch) of one model's grid.

    Each (precision, accumulation, checkpoint) *shape* costs the estimator its own anchor
    traces, and every configuration one real measured run, so the default grid is thinned:
    four shapes, a half fraction of the 2x2x2 combinations in which each pair of axes still
    shows all four of its combinations (fp32/1/none, bf16/1/max at every batch size;
    fp32/2/max, bf16/2/none at the smallest one: accumulation doubles a real run's time, and
    bf16 runs slowly on CPUs without bf16 GEMMs). ``full``: all eight shapes at every batch
    size; ``quick``: fp32/1/none at every batch size and bf16/2/max at the middle one.
    Without a block stack (max 0) the checkpoint axis is skipped."""
    lo, mid, hi = batches
    everyb = (lo, mid, hi)
    if quick:
        plan = [(("fp32", 1, 0), everyb), (("bf16-mixed", 2, max_ck), (mid,))]
    elif full:
        cks = (0, max_ck) if max_ck > 0 else (0,)
        plan = [((p, a, c), everyb) for p in ("fp32", "bf16-mixed") for a in (1, 2) for c in cks]
    else:
        plan = [(("fp32", 1, 0), everyb), (("bf16-mixed", 1, max_ck), everyb),
                (("fp32", 2, max_ck), (lo,)), (("bf16-mixed", 2, 0), (lo,))]
    return [(p, a, c, b) for (p, a, c), bs in plan for b in bs]


def _emit(obj: dict[str, Any]) -> None:
    """One JSON line of the child's result on stdout (the parent keeps what arrived if the
    child dies or times out later)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------------------
# One model (runs in its own subprocess)
# ---------------------------------------------------------------------------------------

def run_one(path: str, *, quick: bool, full: bool) -> None:
    import torch

    from estimators import Estimator, TrainConfig, load_task
    from estimators.runtime._checkpoint import max_checkpoint_segments
    from estimators.probing._measure import measure_cpu_peak

    name = Path(path).stem
    t_start = time.perf_counter()
    task = load_task(path)
    max_ck = max_checkpoint_segments(task.build_model(), task.checkpoint_blocks)
    batches = HEAVY_BATCHES if name in HEAVY else BATCHES
    configs = [
        TrainConfig(micro_batch_size=b, grad_accum_steps=a, precision=p, checkpoint_segments=c)
        for (p, a, c, b) in grid(max_ck, batches, quick=quick, full=full)
    ]
    _emit({"kind": "header", "model": name, "path": str(Path(path).resolve().relative_to(ROOT)),
           "max_checkpoint": max_ck, "batches": list(batches), "threads": torch.get_num_threads()})
    log(f"[{name}] {len(configs)} configs, checkpoint max {max_ck}, batch sizes {batches}, "
        f"torch threads {torch.get_num_threads()}")

    # Estimates first, all with one Estimator (anchor traces are shared per shape).
    est = Estimator(task, device="cpu")
    rows: list[dict[str, Any]] = []
    seen_shapes: set[tuple[Any, ...]] = set()
    for i, cfg in enumerate(configs):
        shape = (cfg.precision, cfg.grad_accum_steps, cfg.checkpoint_segments)
        row: dict[str, Any] = {
            "batch": cfg.micro_batch_size, "precision": cfg.precision,
            "accum": cfg.grad_accum_steps, "checkpoint": cfg.checkpoint_segments,
            "new_shape": shape not in seen_shapes, "call_index": i,
        }
        seen_shapes.add(shape)
        t0 = time.perf_counter()
        try:
            e = est.estimate(cfg)
            row["estimate_s"] = time.perf_counter() - t0
            row["predicted"] = int(e.peak_allocated_bytes)
            row["method"] = e.method
            row["peak_phase"] = e.peak_phase
            row["breakdown"] = dict(e.breakdown)
            row["notes"] = list(e.notes)
        except Exception as exc:  # noqa: BLE001 - a failed estimate is a failure row
            row["estimate_s"] = time.perf_counter() - t0
            row["estimate_error"] = _first_line(exc)
        log(f"[{name}] estimate {cfg.describe()}: "
            + (f"{row['predicted']:,} B ({row['method']})" if "predicted" in row else row["estimate_error"])
            + f" in {row['estimate_s']:.3f}s")
        rows.append(row)
    _emit({"kind": "estimates", "rows": rows})

    # The reference: real steps, the allocator's peak.
    for i, (cfg, row) in enumerate(zip(configs, rows)):
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        try:
            out["measured"] = int(measure_cpu_peak(task, cfg).peak_bytes)
        except Exception as exc:  # noqa: BLE001 - e.g. oneDNN without a bf16 LSTM kernel
            out["measure_error"] = _first_line(exc)
        out["measure_s"] = time.perf_counter() - t0
        if "measured" in out and "predicted" in row:
            out["error_pct"] = 100.0 * (row["predicted"] - out["measured"]) / out["measured"]
        _emit({"kind": "measured", "index": i, **out})
        log(f"[{name}] measure {cfg.describe()}: "
            + (f"{out['measured']:,} B" if "measured" in out else out["measure_error"])
            + (f", error {out['error_pct']:+.2f}%" if "error_pct" in out else "")
            + f" in {out['measure_s']:.1f}s")
    _emit({"kind": "done", "wall_s": time.perf_counter() - t_start, "cpu_s": _cpu_s()})


# ---------------------------------------------------------------------------------------
# The GPT-2-124M speed check (runs in its own subprocess)
# ---------------------------------------------------------------------------------------

def _gpt2_task():
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from estimators import Task

    n_layer, n_head, n_embd, vocab, block = 12, 12, 768, 50257, 1024

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            shape = (B, T, n_head, C // n_head)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(n_embd)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(n_embd)
            self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, n_embd)
            self.wpe = nn.Embedding(block, n_embd)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
            for b in self.blocks:
                nn.init.normal_(b.attn.proj.weight, std=0.02 / math.sqrt(2 * n_layer))

        def forward(self, idx):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for b in self.blocks:
                x = b(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied lm head

    def train_data():
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, vocab, (4, block + 1), generator=g)
        return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    return Task(name="gpt2_124m", build_model=GPT2, train_data=train_data,
                checkpoint_blocks=lambda m: list(m.blocks))


def _max_rss_bytes() -> int:
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) * (1 if sys.platform == "darwin" else 1024)


def run_speed() -> dict[str, Any]:
    rss_start = _max_rss_bytes()
    import torch  # noqa: F401 - imported before the clock starts, as any caller would

    from estimators import Estimator, TrainConfig

    rss_import = _max_rss_bytes()
    task = _gpt2_task()
    out: dict[str, Any] = {"rss_start": rss_start, "rss_after_import": rss_import, "runs": []}
    for prec in ("fp32", "bf16-mixed"):
        est = Estimator(task, gpu="A100-80GB")  # a fresh estimator: the first call traces
        run: dict[str, Any] = {"precision": prec}
        for key, batch in (("first", 8), ("further", 16), ("further2", 12)):
            cfg = TrainConfig(micro_batch_size=batch, precision=prec)
            t0 = time.perf_counter()
            try:
                e = est.estimate(cfg)
                run[key] = {
                    "batch": batch, "s": time.perf_counter() - t0, "method": e.method,
                    "allocated": e.peak_allocated_bytes, "reserved": e.peak_reserved_bytes,
                    "params": e.params,
                }
            except Exception as exc:  # noqa: BLE001
                run[key] = {"batch": batch, "s": time.perf_counter() - t0, "error": _first_line(exc)}
            log(f"[gpt2_124m] {prec} batch {batch}: {run[key]}")
        out["runs"].append(run)
    # The one-shot path (``estimators.estimate``): a single trace at the batch itself, no anchors.
    for prec in ("fp32", "bf16-mixed"):
        est = Estimator(task, gpu="A100-80GB")
        cfg = TrainConfig(micro_batch_size=8, precision=prec)
        t0 = time.perf_counter()
        try:
            e = est.estimate(cfg, exact=True)
            c = {"batch": 8, "s": time.perf_counter() - t0, "method": e.method,
                 "allocated": e.peak_allocated_bytes, "reserved": e.peak_reserved_bytes}
        except Exception as exc:  # noqa: BLE001
            c = {"batch": 8, "s": time.perf_counter() - t0, "error": _first_line(exc)}
        log(f"[gpt2_124m] {prec} batch 8 exact=True: {c}")
        out.setdefault("exact", []).append({"precision": prec, **c})
    out["max_rss"] = _max_rss_bytes()
    return out


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

def _child(args: list[str], timeout: float, script: Path | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run this file (or ``script``) with ``args``; relay its progress (stderr, less kineto's
    chatter) and collect the JSON lines it prints on stdout. Returns (objects, why it failed or "")."""
    cmd = [sys.executable, str(script or Path(__file__).resolve()), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    tail: list[str] = []
    objs: list[dict[str, Any]] = []

    def relay() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("USDT:"):  # kineto's profiler start/stop lines
                continue
            tail.append(line.rstrip())
            del tail[:-20]
            sys.stderr.write("    " + line)
            sys.stderr.flush()

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    objs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a model file's own print

    threads = [threading.Thread(target=relay, daemon=True), threading.Thread(target=read_stdout, daemon=True)]
    for t in threads:
        t.start()
    why = ""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        why = f"timed out after {timeout:.0f}s"
    for t in threads:
        t.join(30)
    if not why and proc.returncode != 0:
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        why = f"subprocess exited with {proc.returncode}: {last[:240]}"
    return objs, why


def assemble(objs: list[dict[str, Any]], why: str, wall_s: float) -> dict[str, Any] | None:
    """One model's result from its child's JSON lines; None when not even the estimates
    arrived. Rows a dead or timed-out child did not measure are marked ``incomplete``."""
    header = next((o for o in objs if o.get("kind") == "header"), None)
    estimates = next((o for o in objs if o.get("kind") == "estimates"), None)
    if header is None or estimates is None:
        return None
    rows = estimates["rows"]
    for o in objs:
        if o.get("kind") == "measured":
            rows[o["index"]].update({k: v for k, v in o.items() if k not in ("kind", "index")})
    for r in rows:
        if "measured" not in r and "measure_error" not in r:
            r["incomplete"] = f"not measured: model {why or 'stopped'}"
    done = next((o for o in objs if o.get("kind") == "done"), None)
    return {**{k: v for k, v in header.items() if k != "kind"}, "rows": rows,
            "wall_s": done["wall_s"] if done else wall_s, "cpu_s": done["cpu_s"] if done else None,
            "problem": why or None}


def model_paths() -> list[Path]:
    from variable_shapes import case_paths
    shaped = set(case_paths()) - {"moe_dynamic"}  # measured in the variable-shape section only
    return [*(p for p in sorted(MODEL_DIR.glob("*.py")) if p.stem not in shaped), *EXAMPLES]


def run_shape_cases(command: str) -> str:
    """The variable-shape section: each model of ``variable_shapes.CASES`` in its own subprocess."""
    from variable_shapes import CASE_TIMEOUT_S, case_paths, render as render_shapes
    script = ROOT / "benchmarks" / "variable_shapes.py"
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for name in case_paths():
        log(f"== variable shapes: {name}")
        objs, why = _child([name], CASE_TIMEOUT_S, script=script)
        rows.extend(objs)
        if why:
            failures.append(f"{name}: {why}")
    return render_shapes(rows, failures, command=command)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def fmt_s(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def describe(row: dict[str, Any]) -> str:
    ck = f", ckpt {row['checkpoint']}" if row["checkpoint"] else ""
    return f"b{row['batch']}, {row['precision']}, accum {row['accum']}{ck}"


def _kind(r: dict[str, Any]) -> str:
    """compared | estimate-failure | not-runnable | incomplete."""
    if "estimate_error" in r:
        return "estimate-failure"
    if "incomplete" in r:
        return "incomplete"
    if "measure_error" in r:
        return "not-runnable"
    return "compared"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def render(results: list[dict[str, Any]], failures: list[tuple[str, str]], speed: dict[str, Any] | None,
           speed_error: str, *, command: str, wall_s: float, grid_name: str,
           load: tuple[float, float]) -> str:
    import torch

    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    L: list[str] = []
    L.append("# Estimator accuracy: static CPU estimate vs. the CPU allocator's real peak\n")
    L.append(f"- Command: `{command}` (grid: {grid_name})")
    L.append(f"- Date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    L.append(f"- Machine: {os.cpu_count()} cores ({cpu_model}), torch {torch.__version__}, "
             f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    cores = os.cpu_count() or 1
    busy = max(load) > cores + 0.5
    L.append(f"- Benchmark wall time: {wall_s / 60:.1f} min; 1-minute load average {load[0]:.1f} at the start, "
             f"{load[1]:.1f} at the end on {cores} cores"
             + (" — other processes were competing for the CPUs, so every wall time below is inflated"
                if busy else " (the benchmark's own processes use up to 2 threads)"))
    L.append("- Predicted: `Estimator(task, device=\"cpu\").estimate(config).peak_allocated_bytes`, ONE Estimator "
             "per model for all its configs; no batch size of the grid is an anchor (2, 3, 4), so every one "
             "is scaled from the anchor traces (method `scaled`) unless the estimator falls back to real runs "
             "(`measured-cpu`). Measured (the reference): `measure_cpu_peak(task, config).peak_bytes` "
             "(the profiler's allocation events over 2 real optimizer steps, plus parameters and buffers), in "
             "the same subprocess after all estimates. One subprocess per model. "
             "Error = (predicted − measured) / measured.")
    L.append(f"- Grid per model: micro-batch {BATCHES} ({HEAVY_BATCHES} for {', '.join(sorted(HEAVY))}); "
             + {"default": "fp32 / accum 1 / no checkpointing and bf16-mixed / accum 1 / all blocks "
                           "checkpointed at every batch size, fp32 / accum 2 / all blocks and bf16-mixed / "
                           "accum 2 / none at the smallest batch size (a half fraction of precision × "
                           "accumulation × checkpointing in which each pair of axes shows all four of its "
                           "combinations)",
                "full": "every precision × accumulation × checkpointing combination at every batch size",
                "quick": "fp32 / accum 1 / none at every batch size, bf16-mixed / accum 2 / all blocks "
                         "at the middle one"}[grid_name]
             + "; the checkpoint axis is dropped for models without a block stack.")
    L.append("")

    all_errors: list[float] = []
    rows_by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = {
        "compared": [], "estimate-failure": [], "not-runnable": [], "incomplete": []}
    for res in results:
        for r in res["rows"]:
            rows_by_kind[_kind(r)].append((res["model"], r))
            if "error_pct" in r:
                all_errors.append(abs(r["error_pct"]))
    n_rows = sum(len(r["rows"]) for r in results)
    med = _median(all_errors)
    mx = max(all_errors) if all_errors else None

    def verdict(ok: bool) -> str:
        return "yes" if ok else "**NO**"

    L.append("## Overall\n")
    L.append("| | value | goal | met |")
    L.append("|---|---:|---:|:---:|")
    if med is not None and mx is not None:
        L.append(f"| median \\|error\\| | {med:.2f}% | ≤ {GOAL_MEDIAN_PCT:g}% | {verdict(med <= GOAL_MEDIAN_PCT)} |")
        L.append(f"| max \\|error\\| | {mx:.2f}% | ≤ {GOAL_MAX_PCT:g}% | {verdict(mx <= GOAL_MAX_PCT)} |")
    n_fail = len(rows_by_kind["estimate-failure"])
    n_fail_both = sum(1 for _, r in rows_by_kind["estimate-failure"] if "measure_error" in r)
    L.append(f"| configs compared | {len(all_errors)} of {n_rows} | | |")
    L.append(f"| estimate failures (counted) | {n_fail}"
             + (f" ({n_fail_both} of them configs whose real run fails too)" if n_fail_both else "")
             + f" | 0 | {verdict(n_fail == 0)} |")
    L.append(f"| not runnable here (real run failed; excluded) | {len(rows_by_kind['not-runnable'])} | | |")
    L.append(f"| models whose subprocess crashed / timed out | {len(failures)} | 0 | {verdict(not failures)} |")
    if rows_by_kind["incomplete"]:
        L.append(f"| configs left unmeasured by those | {len(rows_by_kind['incomplete'])} | 0 | **NO** |")
    within = sum(1 for e in all_errors if e <= GOAL_MAX_PCT)
    L.append(f"| configs within ±{GOAL_MAX_PCT:g}% | {within} of {len(all_errors)} | | |")
    L.append("")

    L.append("## Summary per model\n")
    L.append("| model | compared | median \\|error\\| | max \\|error\\| | worst config | method | not runnable | "
             "failures | first estimate | later new-shape estimates (median) | same-shape estimates (median) | "
             "model wall / CPU time |")
    L.append("|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for res in results:
        rows = res["rows"]
        errs = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
        first = rows[0]["estimate_s"] if rows else None
        new_shape = [r["estimate_s"] for r in rows[1:] if r["new_shape"]]
        same = [r["estimate_s"] for r in rows if not r["new_shape"]]
        worst = max((r for r in rows if "error_pct" in r), key=lambda r: abs(r["error_pct"]), default=None)
        methods = ", ".join(sorted({r["method"] for r in rows if "method" in r})) or "—"
        n_nr = sum(1 for r in rows if _kind(r) == "not-runnable")
        n_f = sum(1 for r in rows if _kind(r) in ("estimate-failure", "incomplete"))
        cpu = f" / {res['cpu_s']:.0f} s" if res.get("cpu_s") is not None else ""
        L.append(
            f"| {res['model']} | {len(errs)} of {len(rows)} | "
            + (f"{statistics.median(errs):.2f}% | {max(errs):.2f}% | " if errs else "— | — | ")
            + (f"{describe(worst)} ({worst['error_pct']:+.2f}%) | " if worst else "— | ")
            + f"{methods} | {n_nr} | {n_f} | {fmt_s(first)} | {fmt_s(_median(new_shape))} | "
            f"{fmt_s(_median(same))} | {res['wall_s']:.0f} s{cpu} |"
        )
    reported = {r["model"] for r in results}
    for name, why in failures:
        if name not in reported:
            L.append(f"| {name} | 0 | — | — | — | — | — | FAILED: {why} | — | — | — | — |")
    L.append("")
    L.append("*First estimate*: the model's first call (traces the anchors 2, 3, 4 and runs the small "
             "profiled CPU steps that measure kernel workspaces). *Later new-shape*: the first call of each "
             "further (precision, accumulation, checkpointing) shape, which traces its own anchors. "
             "*Same-shape*: calls whose shape was already traced — pure batch scaling, no trace (except "
             "for `measured-cpu` models, which run every batch size for real).")
    L.append("")

    L.append("## Failures and configurations not runnable here\n")
    if not (failures or rows_by_kind["estimate-failure"] or rows_by_kind["not-runnable"]
            or rows_by_kind["incomplete"]):
        L.append("None.\n")
    else:
        L.append("| model | config | kind | reason |")
        L.append("|---|---|---|---|")
        for name, why in failures:
            L.append(f"| {name} | (whole model) | FAILURE: subprocess | {why} |")
        for name, r in rows_by_kind["estimate-failure"]:
            also = ((" — the real run fails with the same error" if r["measure_error"].split(": ")[-1]
                     in r["estimate_error"] else f" — the real run fails too: {r['measure_error']}")
                    if "measure_error" in r else
                    f" — the real run works: {r['measured']:,} B" if "measured" in r else "")
            L.append(f"| {name} | {describe(r)} | FAILURE: estimate | {r['estimate_error']}{also} |")
        for name, r in rows_by_kind["incomplete"]:
            L.append(f"| {name} | {describe(r)} | FAILURE: not measured | {r['incomplete']} |")
        for name, r in rows_by_kind["not-runnable"]:
            L.append(f"| {name} | {describe(r)} | not runnable here (the real run failed; excluded from the "
                     f"statistics; the estimate was {r['predicted']:,} B) | {r['measure_error']} |")
        L.append("")

    L.append("## GPT-2-124M speed check (`gpu=\"A100-80GB\"`, fake tensors)\n")
    if speed is None:
        L.append(f"FAILURE: {speed_error}\n")
    else:
        L.append("n_layer 12, n_head 12, n_embd 768, vocab 50257, block 1024, tied embeddings, SDPA causal "
                 "attention, tiny synthetic token-window dataset; defined in this script, built on the meta "
                 f"device by the estimator. Goals: first estimate ≤ {GOAL_FIRST_S:g} s, a further batch size "
                 f"≤ {GOAL_FURTHER_S * 1000:g} ms.\n")
        L.append("| precision | call | batch | wall time | goal met | method | peak allocated | peak reserved |")
        L.append("|---|---|---:|---:|:---:|---|---:|---:|")

        def speed_row(prec: str, label: str, c: dict[str, Any], goal: float) -> str:
            if "error" in c:
                return f"| {prec} | {label} | {c['batch']} | {fmt_s(c['s'])} | **NO** | FAILED: {c['error']} | — | — |"
            return (f"| {prec} | {label} | {c['batch']} | {fmt_s(c['s'])} | {verdict(c['s'] <= goal)} | "
                    f"{c['method']} | {fmt_bytes(c['allocated'])} | {fmt_bytes(c['reserved'])} |")

        for run in speed["runs"]:
            L.append(speed_row(run["precision"], "first", run["first"], GOAL_FIRST_S))
            L.append(speed_row(run["precision"], "further", run["further"], GOAL_FURTHER_S))
            L.append(speed_row(run["precision"], "further", run["further2"], GOAL_FURTHER_S))
        for c in speed.get("exact", []):
            L.append(speed_row(c["precision"], "first, `exact=True`", c, GOAL_FIRST_S))
        L.append("")
        L.append("*first*: `Estimator(task, gpu=\"A100-80GB\").estimate(config)` on a fresh Estimator (traces "
                 "the anchors 2, 3, 4, then scales to 8); *further*: the same Estimator at another batch size "
                 "(pure scaling); *first, `exact=True`*: a fresh Estimator tracing batch 8 itself, once (what "
                 "`estimators.estimate()` does). The fp32 first call also pays the process's one-time "
                 "fake-tensor warm-up.")
        params = next((r["first"].get("params") for r in speed["runs"] if "params" in r["first"]), None)
        L.append("")
        if params:
            L.append(f"Parameters: {params:,} ({fmt_bytes(params * 4)} in fp32).")
        L.append(f"Process max RSS (`resource.getrusage`): {fmt_bytes(speed['max_rss'])} at the end, "
                 f"{fmt_bytes(speed['rss_after_import'])} after importing torch and estimators — below the "
                 "model's own fp32 weights, let alone the predicted peaks: nothing of the model's size was "
                 "really allocated.\n")

    L.append("## Per-model results\n")
    for res in results:
        L.append(f"### {res['model']} (`{res['path']}`, checkpoint max {res['max_checkpoint']})\n")
        if res.get("problem"):
            L.append(f"**Incomplete: {res['problem']}.**\n")
        L.append("| config | method | predicted | measured | predicted − measured | error | peak phase | "
                 "estimate time | note |")
        L.append("|---|---|---:|---:|---:|---:|---|---:|---|")
        for r in res["rows"]:
            pred = f"{r['predicted']:,}" if "predicted" in r else "—"
            meas = f"{r['measured']:,}" if "measured" in r else "—"
            err = f"{r['error_pct']:+.2f}%" if "error_pct" in r else "—"
            diff = f"{r['predicted'] - r['measured']:+,}" if "predicted" in r and "measured" in r else "—"
            kind = _kind(r)
            if kind == "estimate-failure":
                note = f"FAILURE (estimate): {r['estimate_error']}"
            elif kind == "incomplete":
                note = f"FAILURE: {r['incomplete']}"
            elif kind == "not-runnable":
                note = f"not runnable here: {r['measure_error']}"
            else:
                note = "; ".join(r.get("notes", []))
            L.append(f"| {describe(r)} | {r.get('method', '—')} | {pred} | {meas} | {diff} | {err} | "
                     f"{r.get('peak_phase', '—')} | {fmt_s(r['estimate_s'])} | {note} |")
        L.append("")
    L.append("Sizes are bytes unless a unit is given.")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="two (precision, accumulation, checkpoint) shapes per model instead of four")
    mode.add_argument("--full", action="store_true",
                    help="every precision x accumulation x checkpoint combination (twice the time)")
    ap.add_argument("--models", help="comma-separated model names (file stems), e.g. mlp,lstm,gpt2_124m")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown report to write")
    ap.add_argument("--model-timeout", type=float, default=MODEL_TIMEOUT_S,
                    help=f"seconds one model's subprocess may run (default {MODEL_TIMEOUT_S})")
    ap.add_argument("--shapes", action="store_true",
                    help="run the variable-shape cases alone and replace their section of --out")
    ap.add_argument("--one", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--speed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.one:
        run_one(args.one, quick=args.quick, full=args.full)
        return 0
    if args.speed:
        print(json.dumps(run_speed()))
        return 0

    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    if args.shapes:
        from variable_shapes import replace_section
        out = Path(args.out)
        section = run_shape_cases(command)
        out.write_text(replace_section(out.read_text() if out.exists() else "", section))
        log(f"== wrote the variable-shape section of {out}")
        return 0
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    paths = model_paths()
    wanted = {m.strip() for m in args.models.split(",")} if args.models else None
    if wanted is not None:
        known = {p.stem for p in paths} | {"gpt2_124m"}
        unknown = wanted - known
        if unknown:
            ap.error(f"unknown models {sorted(unknown)}; known: {sorted(known)}")
        paths = [p for p in paths if p.stem in wanted]
    results: list[dict[str, Any]] = []
    failures: list[tuple[str, str]] = []
    for p in paths:
        log(f"== {p.stem} ({time.perf_counter() - t0:.0f}s elapsed)")
        child_args = ["--one", str(p)] + (["--quick"] if args.quick else []) + (["--full"] if args.full else [])
        t_model = time.perf_counter()
        objs, why = _child(child_args, args.model_timeout)
        res = assemble(objs, why, time.perf_counter() - t_model)
        if why:
            log(f"== {p.stem}: FAILED: {why}")
        if res is None:
            failures.append((p.stem, why or "no result"))
        else:
            results.append(res)
            if why:
                failures.append((p.stem, why + " (results so far are kept)"))
    speed, speed_error = None, "not run (--models without gpt2_124m)"
    if wanted is None or "gpt2_124m" in wanted:
        log(f"== gpt2_124m speed check ({time.perf_counter() - t0:.0f}s elapsed)")
        objs, speed_error = _child(["--speed"], SPEED_TIMEOUT_S)
        speed = objs[-1] if objs and not speed_error else None
    wall = time.perf_counter() - t0
    grid_name = "quick" if args.quick else "full" if args.full else "default"
    text = render(results, failures, speed, speed_error, command=command, wall_s=wall, grid_name=grid_name,
                  load=(load_start, os.getloadavg()[0]))
    if wanted is None:
        text = text.rstrip("\n") + "\n\n" + run_shape_cases(command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"== done in {wall / 60:.1f} min; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
