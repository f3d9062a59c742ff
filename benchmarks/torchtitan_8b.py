"""torchtitan's Llama 3.1 8B recipe on 8 H100s, estimated with each checkpoint policy.

torchtitan's performance page (docs/performance.md, Table 1) reports Llama 3.1 8B trained by
FSDP2 on 8 H100s, local batch 2 of 8192 tokens, bf16, its selective "op" activation
checkpointing on every block: 82.4 GiB per GPU (96 GB HBM2e cards; the memory its monitor logs
is the caching allocator's peak reserved). This estimates that configuration with memplan's
``selective`` policy (every matmul output kept), ``op`` (torchtitan's: every other ``mm``) and
``full``, on ``H100-80GB`` (the card's size changes no estimate, only the budget a plan would
check), and prints a Markdown table with the ratio to the published figure.

    python benchmarks/torchtitan_8b.py [--out benchmarks/results/torchtitan_8b.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from models_large import llama3_task  # noqa: E402

from estimators import Estimator, TrainConfig  # noqa: E402

PUBLISHED_GIB = 82.4
COMMAND = "python benchmarks/torchtitan_8b.py --out benchmarks/results/torchtitan_8b.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the Markdown page here (default: print it)")
    args = ap.parse_args()
    task = llama3_task("8b", seq=8192)
    estimator = Estimator(task, gpu="H100-80GB")
    rows = []
    for policy in ("selective", "op", "full"):
        config = TrainConfig(micro_batch_size=2, precision="bf16-mixed", checkpoint_segments=32,
                             checkpoint_policy=policy, strategy="fsdp", world_size=8)  # type: ignore[arg-type]
        start = time.perf_counter()
        est = estimator.estimate(config)
        seconds = time.perf_counter() - start
        reserved = est.peak_reserved_bytes or est.peak_allocated_bytes
        rows.append((policy, est.peak_allocated_bytes / 2**30, reserved / 2**30, seconds,
                     est.samples_per_s or 0.0))
        print(f"{policy}: allocated {rows[-1][1]:.1f} GiB, reserved {rows[-1][2]:.1f} GiB ({seconds:.1f} s)",
              file=sys.stderr, flush=True)
    lines = [
        "# torchtitan's Llama 3.1 8B on 8 H100s: the estimate per checkpoint policy",
        "",
        f"Command: `{COMMAND}`",
        "",
        f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "- configuration: `TrainConfig(micro_batch_size=2, precision='bf16-mixed', checkpoint_segments=32, "
        "strategy='fsdp', world_size=8)`, sequence 8192, `benchmarks/models_large.py`'s Llama 3 8B "
        "(torchtitan's own model shapes: 32 blocks, width 4096, 8 KV heads, FFN 14336, vocabulary 128256)",
        f"- published: {PUBLISHED_GIB} GiB per GPU (torchtitan docs/performance.md, Table 1, FSDP without "
        "torch.compile, selective op checkpointing)",
        "",
        "| policy | predicted allocated (GiB) | predicted reserved (GiB) | reserved / published | tokens/s per GPU "
        "(predicted) | estimate (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy, allocated, reserved, seconds, samples in rows:
        lines.append(f"| `{policy}` | {allocated:.1f} | {reserved:.1f} | {reserved / PUBLISHED_GIB:.3f} | "
                     f"{samples * 8192 / 8:,.0f} | {seconds:.1f} |")
    page = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(page)
    print(page)


if __name__ == "__main__":
    main()
