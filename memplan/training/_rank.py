"""One rank of a distributed run: its entry point (module-level, so that it pickles), the
environment it adopts, and the failure report it leaves for the launcher
(:mod:`memplan.training._launch`).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from estimators import TrainConfig

from ._options import TrainOptions
from ._recovery import DistributedOOM
from ._state import TrainResult

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class _RankJob:
    """Everything a rank needs, picklable (the task is rebuilt from its file in each rank)."""

    model_path: str
    config: dict[str, Any]
    options: TrainOptions
    budget_bytes: int | None
    ladder: list[dict[str, Any]]
    recovery_state: dict[str, Any] | None
    threads: int
    timeout_s: float | None = None
    log_level: int = logging.WARNING
    env: dict[str, str] = field(default_factory=dict)
    """The launching process's environment now (a forkserver's ranks inherit the server's, from
    the first launch)."""


@dataclass(frozen=True, kw_only=True)
class _Failure:
    """A rank's non-OOM error, written as ``failure-rank<R>.json`` for the launcher's message."""

    rank: int
    error: str
    time: float
    secondary: bool
    """A collective that failed because another rank went away: not the cause."""
    traceback: str = ""


def _rank_main(job: _RankJob) -> TrainResult | None:
    """The entry point of every rank (torchrun has set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*)."""
    import torch.distributed as dist

    from estimators import MemoryGuard, load_task

    from ._trainer import Trainer

    _adopt_environment(job.env)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 <pid>` prints where a rank is (a rank that seems stuck, say) and goes on.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=job.log_level, format="%(levelname)s %(name)s: %(message)s")
    if rank != 0:
        # Rank 0 speaks for the run; the others would only repeat it.
        logging.getLogger("memplan").setLevel(logging.ERROR)
    options = job.options
    # None: the backend's default (init_process_group's own default since torch 2.2).
    timeout = datetime.timedelta(seconds=job.timeout_s) if job.timeout_s is not None else None
    if torch.device(options.device).type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        # The ranks share this machine's cores; oversubscribing them slows every rank down.
        torch.set_num_threads(job.threads)
        dist.init_process_group("gloo", timeout=timeout)
    options = replace(options, device=str(device))
    try:
        task = load_task(job.model_path)
        guard = (MemoryGuard(job.budget_bytes, device=device.type) if job.budget_bytes is not None else None)
        trainer = Trainer(task, TrainConfig.from_dict(job.config), options, memory_guard=guard,
                          ladder=job.ladder, recovery_state=job.recovery_state)
        _KEEP_ALIVE.append(trainer)
        result = trainer.run()
    except BaseException as exc:
        if not isinstance(exc, DistributedOOM):
            _write_failure(options.out_dir, rank, exc)
        raise
    # No destroy_process_group(), no freeing of the model: see _KEEP_ALIVE.
    return result if rank == 0 else None


_KEEP_ALIVE: list[Any] = []
"""What holds a rank's process group (the trainer: DDP's reducer, FSDP2's mesh) stays alive until
the process ends, which multiprocessing does with ``os._exit`` -- no destructor runs. Freeing it
can deadlock (seen here about once in ten gloo runs): ``~ProcessGroupGloo`` joins its worker
threads while the main thread holds the GIL, and a worker that is releasing a finished
collective's tensor waits for the GIL to drop the tensor's Python object. Then the rank never
hands its result back and torchrun's agent waits for it forever."""


_AGENT_VARIABLES = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_ASYNC_ERROR_HANDLING")


def _adopt_environment(parent: Mapping[str, str]) -> None:
    """Make this rank's environment the launching process's, as ``spawn`` would, keeping what
    the agent set for this rank (RANK, MASTER_PORT, ...). Variables that torch reads at import
    (``OMP_NUM_THREADS``) were read already by the forkserver; CUDA ones are read on first use."""
    if not parent:
        return

    def agents(key: str) -> bool:
        return key.startswith(_AGENT_VARIABLES)

    for key in [k for k in os.environ if k not in parent and not agents(k)]:
        del os.environ[key]
    for key, value in parent.items():
        if not agents(key):
            os.environ[key] = value


_SECONDARY_MARKERS = ("connection closed", "connection reset", "broken pipe", "peer", "timed out", "nccl",
                      "gloo", "socket", "transport")


def _write_failure(out_dir: str | os.PathLike[str], rank: int, exc: BaseException) -> None:
    import torch.distributed as dist

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    secondary = isinstance(exc, getattr(dist, "DistError", ())) or any(m in text.lower() for m in _SECONDARY_MARKERS)
    record = _Failure(rank=rank, error=f"{type(exc).__name__}: {text}" if text else type(exc).__name__,
                      time=time.time(), secondary=secondary,
                      traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        path = Path(out_dir) / f"failure-rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(record)))
    except OSError:
        pass  # the launcher falls back on torchrun's own record


def _clear_failures(out_dir: Path) -> None:
    for f in out_dir.glob("failure-rank*.json"):
        f.unlink(missing_ok=True)


def _read_failures(out_dir: Path) -> list[_Failure]:
    out = []
    for f in out_dir.glob("failure-rank*.json"):
        try:
            out.append(_Failure(**json.loads(f.read_text())))
        except (ValueError, TypeError):
            continue
    # The cause first: an error of its own before the collectives it broke, then the earliest.
    return sorted(out, key=lambda r: (r.secondary, r.time))


def _failure_message(exc: Any, out_dir: Path) -> str:
    failures = _read_failures(out_dir)
    if failures:
        cause = failures[0]
        others = sorted({f.rank for f in failures} - {cause.rank})
        tail = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped with it)" if others else ""
        where = out_dir / f"failure-rank{cause.rank}.json"
        return f"training failed on rank {cause.rank}: {cause.error}{tail}; traceback in {where}"
    # No record: the rank died without Python noticing (killed, segfault); torchrun knows how.
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, Mapping):
        message = message.get("message", "")
    detail = str(message).strip().splitlines()[0] if str(message).strip() else f"exit code {failure.exitcode}"
    return f"training failed on rank {rank}: {detail}"
