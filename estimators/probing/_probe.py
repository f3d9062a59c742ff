"""Probes: a few real training steps of one configuration, in a separate process.

A probe answers what the static estimator can only predict: the configuration is built for
real on the target device and trained for a few optimizer steps, exactly as the trainer
steps (forward and loss under the precision's autocast, loss divided by the accumulation
steps, backward — scaled under fp16 —, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
all ``grad_accum_steps`` micro-batches of every optimizer step, real batches from the task).

What is measured:

* memory over the first two optimizer steps (the first creates the optimizer state, the
  second is the steady state). On cpu the reference is the CPU allocator's own accounting,
  as in ``estimators.probing._measure.measure_cpu_peak``: ``torch.profiler`` with
  ``profile_memory=True`` sees every allocation and free, tensors and kernel scratch alike;
  the peak is the parameters and buffers plus the highest running sum of those events. On
  cuda: ``max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``.
  The phase in which the peak falls (``"step 2 backward"``…) is reported too;
* time: the median wall time of one optimizer step (batch creation included, as in
  the trainer's loop without DataLoader workers) over ``steps`` un-profiled steps after
  ``warmup`` more, with ``torch.cuda.synchronize()`` around each on cuda. The child uses the
  caller's ``torch.get_num_threads()``, so a probe times what the calling process would see
  (on a busy 2-core machine, 2 threads instead of 1 made a small CNN's step 40x slower).

With ``budget_bytes`` the memory steps run under :class:`~estimators.runtime._guard.MemoryGuard`
(on cuda every step does: ``set_per_process_memory_fraction`` costs nothing); on cpu a
measured peak above the budget (kernel scratch the guard does not see) is an OOM as well.

Isolation. Every probe runs in a child process of its own, with its own process group. On
Linux the child is forked from a *probe server*: a clean interpreter (started with
``subprocess``, never forked from the caller) that has imported torch, ``torch._dynamo`` (which
the first optimizer pulls in) and estimators once, runs no tensor code and never touches
CUDA. Elsewhere, or with ``MEMPLAN_PROBE_START=spawn``, each child is a fresh interpreter.
``multiprocessing`` is not used: its spawned children re-import the caller's ``__main__``
script, which a user's script may not guard. The child reports plain dicts over a socket;
its stdout/stderr go to a temporary file whose tail explains crashes. Outcomes:

* ``ok``;
* ``oom``: ``torch.OutOfMemoryError`` (the guard's, CUDA's), the CPU allocator's "can't
  allocate memory", cuBLAS/cuDNN allocation failures (see :func:`is_oom_error`), a cpu peak
  over the budget, or a child killed by a SIGKILL the parent did not send (the kernel's OOM
  killer);
* ``error``: any other exception, as one line (with the model file's line number), or a
  child dying by another signal (a segfault: the log's last lines are quoted);
* ``timeout``: ``timeout_s`` exceeded (process start included): the child's whole process
  group is killed, grandchildren too.

The parent never holds the child's memory, and every child is killed if need be and reaped
before :func:`probe` returns; only the server outlives a probe (stopped at exit or by
:func:`shutdown`; it exits by itself when its parent does). The same children run races
(``estimators.probing._race``: two configurations timed step against step), with the same outcomes.

Cost (the ``overhead_s`` of a result: wall time less the steps themselves). Measured on this
2-core machine while other jobs kept the load average at 3.5-6.5 (``import torch`` took 5-8 s
instead of an idle machine's 1.5-2 s): the first probe of a process pays the server's start,
10.6-11 s there (``import torch`` and ``import torch._dynamo``, ~5 s each under that load);
every later probe 0.07-0.26 s (fork, task load, model build, result). A fresh interpreter
per probe (the spawn fallback) pays the whole start every time: 10-12.5 s under the same
load. So call :func:`prestart` (or :meth:`Prober.start`) when a search begins: the server
starts while the static estimates run, and each probe then stays far under the 3 s goal.
A probe runs 2 profiled steps, then ``warmup`` and ``steps`` un-profiled ones.

Example:
    >>> from estimators import TrainConfig
    >>> result = probe("examples/digits.py", TrainConfig(micro_batch_size=64))  # doctest: +SKIP
    >>> result.status, result.estimate.peak_allocated_bytes                    # doctest: +SKIP
    ('ok', 4340332)
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import pickle
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping

from .._config import TrainConfig
from .._errors import ConfigError, MemplanError, ProbeError
from .._estimate import Estimate
from .._task import Task

if TYPE_CHECKING:
    from ._race import RaceResult

__all__ = ["ProbeResult", "Prober", "probe", "prestart", "shutdown", "is_oom_error"]

ProbeStatus = Literal["ok", "oom", "error", "timeout"]

_MEMORY_STEPS = 2
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


# --------------------------------------------------------------------------- OOM detection

_OOM_PATTERNS = (
    "out of memory",                          # CUDA/HIP/MPS, "CUDA error: out of memory", the guard
    "can't allocate memory",                  # c10 DefaultCPUAllocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's OOM in disguise (as Lightning treats it)
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory.

    True for ``torch.OutOfMemoryError`` (CUDA's and the memory guard's), Python's
    ``MemoryError``, and errors whose message is an allocator failure: "out of memory",
    "DefaultCPUAllocator: can't allocate memory", ``CUBLAS_STATUS_ALLOC_FAILED``,
    ``CUDNN_STATUS_ALLOC_FAILED``, cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` (which cuDNN raises
    when its workspace cannot be allocated). An error raised *because of* an OOM (its
    ``__cause__``/``__context__`` chain holds one, e.g. a ``ModelFileError`` wrapping an OOM
    in ``model()``) counts too.

    Example:
        >>> import torch
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."))
        True
        >>> is_oom_error(ValueError("shapes do not match"))
        False
    """
    import torch

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or len(seen) > 16:
            continue
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, (RuntimeError, MemplanError)):
            text = str(e)
            if any(p in text for p in _OOM_PATTERNS) or "OutOfMemoryError" in text:
                return True
        todo.extend((e.__cause__, e.__context__))
    return False


# --------------------------------------------------------------------------- results

@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """The outcome of one probe.

    ``estimate`` is an :class:`~estimators.Estimate` with ``method="measured"`` for status
    ``ok``, and for an ``oom`` found by measuring (a cpu peak over the budget: then it has no
    step time); else None. ``message`` explains any status but ``ok`` in one line.
    ``overhead_s`` is the probe's wall time less the training steps' own time (process
    start, imports, task load, model build, result transfer); ``wall_s`` the whole call.
    """

    status: ProbeStatus
    estimate: Estimate | None = None
    message: str = ""
    overhead_s: float = 0.0
    wall_s: float = 0.0
    raised: bool = False
    """Status ``error`` because the configuration's own step (or the task) raised, not because
    the probe's process died, hung or could not start: the configuration cannot run."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
            "message": self.message,
            "overhead_s": self.overhead_s,
            "wall_s": self.wall_s,
            "raised": self.raised,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        est = data.get("estimate")
        return cls(
            status=data["status"],
            estimate=Estimate.from_dict(est) if est is not None else None,
            message=data.get("message", ""),
            overhead_s=float(data.get("overhead_s", 0.0)),
            wall_s=float(data.get("wall_s", 0.0)),
            raised=bool(data.get("raised", False)),
        )


# --------------------------------------------------------------------------- the parent side

class _Timeout(Exception):
    pass


class _ChildGone(Exception):
    pass


def _task_payload(task_ref: Task | str | os.PathLike[str]) -> dict[str, Any]:
    """How the child gets the task: a model-file path, or the pickled in-memory Task."""
    if isinstance(task_ref, (str, os.PathLike)):
        path = Path(task_ref)
        if not path.is_file():
            raise ConfigError(
                f"model file {str(task_ref)!r} not found; pass the path of a .py file that defines model()")
        return {"path": str(path.resolve()), "settings": None, "name": path.name}
    if not isinstance(task_ref, Task):
        raise ConfigError(f"probe() needs a model-file path or a Task, got {type(task_ref).__name__}")
    if task_ref.source_path is not None:
        try:
            settings = pickle.loads(pickle.dumps(dict(task_ref.settings)))
        except Exception:  # noqa: BLE001 - unpicklable settings: the file's own are used
            settings = None
        # The item shapes found here travel along: the child does not scan the data again.
        return {"path": task_ref.source_path, "settings": settings, "name": task_ref.name,
                "shape_policy": task_ref.shape_policy, "shapes": task_ref._cache.get("shapes")}
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - cloudpickle comes with optuna
        raise ProbeError(
            f"{task_ref.name}: probing an in-memory Task needs cloudpickle (pip install cloudpickle), "
            "or write the model to a model file and probe that"
        ) from exc
    try:
        blob = cloudpickle.dumps(task_ref)
    except Exception as exc:  # noqa: BLE001
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise ProbeError(
            f"{task_ref.name}: the in-memory task cannot be sent to a probe process "
            f"({type(exc).__name__}: {text}); write the model to a model file "
            "(model(), train_data(), …) and probe that file"
        ) from None
    return {"blob": blob, "name": task_ref.name}


# -- framing: 8-byte length + pickle, over pipes or stream sockets ------------------------

def _wait_fd(fd: int, *, write: bool, timeout: float) -> bool:
    """Whether ``fd`` became readable (writable) within ``timeout`` seconds (poll, not
    select: descriptors above 1023 work too)."""
    poller = select.poll()
    poller.register(fd, (select.POLLOUT if write else select.POLLIN) | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("<Q", len(data)) + data


def _write_msg(fd: int, obj: Any, deadline: float | None) -> None:
    view = memoryview(_frame(obj))
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            if not _wait_fd(fd, write=True, timeout=remaining):
                raise _Timeout
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            continue
        except OSError as exc:  # EPIPE, ECONNRESET: the other side is gone
            raise _ChildGone from exc
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            if not _wait_fd(fd, write=False, timeout=remaining):
                raise _Timeout
        try:
            chunk = os.read(fd, min(n, 1 << 20))
        except BlockingIOError:
            continue
        except OSError as exc:
            raise _ChildGone from exc
        if not chunk:
            raise _ChildGone
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_msg(fd: int, deadline: float | None) -> Any:
    (size,) = struct.unpack("<Q", _read_exact(fd, 8, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def _log_tail(log: Any, lines: int = 3) -> str:
    """What a crashed process last said: faulthandler's "Fatal Python error" and the
    innermost frame when there is one, else its last lines."""
    try:
        log.flush()
        log.seek(0, os.SEEK_END)
        size = log.tell()
        log.seek(max(0, size - 16384))
        text = log.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""
    rows = [r.strip() for r in text.splitlines() if r.strip() and not r.startswith("USDT:")]
    fatal = [i for i, r in enumerate(rows) if r.startswith("Fatal Python error")]
    if fatal:
        i = fatal[-1]
        frame = next((r for r in rows[i + 1:] if r.startswith("File ")), "")
        return rows[i] + (f" at {frame}" if frame else "")
    return " | ".join(rows[-lines:])


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the probe child called setsid), or the
    process alone if it has not got that far."""
    try:
        os.killpg(pid, signal.SIGKILL)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a segfault leaves a traceback in the log
    # Asking whether CUDA is there must not initialise it in the fork server, or the
    # children it forks could not use the GPU.
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return env


# -- the fork server -----------------------------------------------------------------------

_ZYGOTE_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from estimators.probing._probe import _zygote_main; _zygote_main(int(sys.argv[1]))"
)
_CHILD_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from estimators.probing._probe import _child_entry; _child_entry(int(sys.argv[1]))"
)


class _Zygote:
    """A process that has imported torch, ``torch._dynamo`` (which the first optimizer
    pulls in) and estimators once, and forks a fresh child for every probe.

    It is started with ``subprocess`` (a clean interpreter: never forked from the caller,
    whose threads and CUDA state a fork would copy), runs no tensor code itself and never
    touches CUDA, so its forks are safe to use either device. Requests travel over a
    ``SOCK_SEQPACKET`` socket pair, the child's socket and log file as passed descriptors.
    Children stay unreaped (zombies) until the parent asks for their exit status, so their
    process ids cannot be reused while the parent may still signal them.
    """

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile(prefix="memplan-probe-server-")
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE_BOOT.format(root=_PACKAGE_ROOT), str(child_sock.fileno())],
                stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                pass_fds=(child_sock.fileno(),), start_new_session=True, env=_child_env(),
            )
        except OSError as exc:
            parent_sock.close()
            self.log.close()
            raise ProbeError(f"cannot start the probe server ({exc}); check that {sys.executable} runs") from exc
        finally:
            child_sock.close()
        self.sock = parent_sock
        self.owner = os.getpid()  # a forked copy of the caller must not share the socket
        self.started = time.monotonic()
        self.ready_s: float | None = None
        self.serial = 0
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self, deadline: float | None, want: int | None = None) -> dict[str, Any]:
        while True:
            if deadline is not None:
                if not _wait_fd(self.sock.fileno(), write=False, timeout=deadline - time.monotonic()):
                    raise _Timeout
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                raise _ChildGone from exc
            if not data:
                raise _ChildGone
            reply = pickle.loads(data)
            # A reply to an earlier request that timed out is skipped (a child forked for it
            # finds its socket closed and exits; the server reaps it when it stops).
            if want is None or reply.get("id") == want:
                return reply

    def _call(self, msg: dict[str, Any], fds: list[int], deadline: float | None) -> dict[str, Any]:
        self._wait_ready(deadline)
        self.serial += 1
        msg = {**msg, "id": self.serial}
        try:
            socket.send_fds(self.sock, [pickle.dumps(msg)], fds)
        except OSError as exc:
            raise _ChildGone from exc
        return self._recv(deadline, want=self.serial)

    def _wait_ready(self, deadline: float | None) -> None:
        if self.ready_s is None:
            reply = self._recv(deadline)
            if reply.get("kind") != "ready":  # pragma: no cover - protocol error
                raise _ChildGone
            self.ready_s = time.monotonic() - self.started

    def wait_ready(self, deadline: float | None) -> None:
        with self.lock:
            self._wait_ready(deadline)

    def fork(self, sock_fd: int, log_fd: int, deadline: float) -> int:
        with self.lock:
            return int(self._call({"kind": "fork"}, [sock_fd, log_fd], deadline)["pid"])

    def reap(self, pid: int, timeout: float) -> int | None:
        """Wait up to ``timeout`` for child ``pid`` to end; its exit code as ``Popen``
        reports it (negative: killed by that signal), or None if it is still running."""
        with self.lock:
            try:
                reply = self._call({"kind": "reap", "pid": pid, "timeout": timeout}, [],
                                   time.monotonic() + timeout + 30)
                return reply["code"]
            except (_Timeout, _ChildGone):
                return None

    def close(self) -> None:
        if self.alive():
            with self.lock:
                try:
                    self.sock.send(pickle.dumps({"kind": "exit"}))
                    self.proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        _kill_group(self.proc.pid)  # the server and anything left in its group
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        self.sock.close()
        self.log.close()


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _use_fork_server() -> bool:
    method = os.environ.get("MEMPLAN_PROBE_START", "fork")
    return (method != "spawn" and hasattr(os, "fork") and hasattr(socket, "send_fds")
            and sys.platform.startswith("linux"))


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is not None and _ZYGOTE.owner != os.getpid():
            _ZYGOTE = None  # inherited through a fork: the original caller owns that server
        if _ZYGOTE is None or not _ZYGOTE.alive():
            if _ZYGOTE is not None:
                _ZYGOTE.close()
            _ZYGOTE = _Zygote()
        return _ZYGOTE


def prestart() -> None:
    """Start the probe server now, in the background, so that the first probe does not pay
    for importing torch (seconds). A no-op where probes start fresh interpreters."""
    if _use_fork_server():
        _zygote()


@atexit.register
def shutdown() -> None:
    """Stop the probe server (a later probe starts a new one)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        z, _ZYGOTE = _ZYGOTE, None
    if z is not None and z.owner == os.getpid():  # not a server inherited through a fork
        z.close()


# -- one probe child -------------------------------------------------------------------------

class _Child:
    """A probe child: forked by the server, or (elsewhere) a fresh interpreter."""

    def __init__(self, deadline: float) -> None:
        self.log = tempfile.TemporaryFile(prefix="memplan-probe-")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = mine
        self.killed = False
        self.code: int | None = None
        self.server: _Zygote | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            if _use_fork_server():
                self.server = _zygote()
                self.pid = self.server.fork(theirs.fileno(), self.log.fileno(), deadline)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD_BOOT.format(root=_PACKAGE_ROOT), str(theirs.fileno())],
                    stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                    pass_fds=(theirs.fileno(),), start_new_session=True, env=_child_env(),
                )
                self.pid = self.proc.pid
        except BaseException:
            mine.close()
            self.log.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)

    def request(self, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        _write_msg(self.sock.fileno(), msg, deadline)
        return _read_msg(self.sock.fileno(), deadline)

    def kill(self) -> None:
        self.killed = True
        _kill_group(self.pid)

    def wait(self, timeout: float) -> int | None:
        """The child's exit code (reaping it), or None if it runs on after ``timeout``."""
        if self.code is None:
            if self.proc is not None:
                try:
                    self.code = self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    return None
            elif self.server is not None:
                self.code = self.server.reap(self.pid, timeout)
        return self.code

    def close(self) -> None:
        """Make sure the child and its process group are gone and reaped."""
        if self.wait(2.0) is None:
            self.kill()
            self.wait(10.0)
        # Stragglers the child left in its group (it is unreaped until now, so the group id
        # was still its own when signalled above).
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.sock.close()
        self.log.close()


class Prober:
    """Probes of one task on one device.

    Every probe runs in a fresh child process — forked from a warm probe server that has
    imported torch already (Linux), or a fresh interpreter elsewhere — so probes cannot
    influence each other, and an OOM or a crash costs nothing but that child. :meth:`start`
    starts the server in the background; the first probe waits for it if needed.

    Example:
        >>> prober = Prober("examples/digits.py")                  # doctest: +SKIP
        >>> prober.start()       # the server imports torch meanwhile  # doctest: +SKIP
        >>> [prober.probe(TrainConfig(micro_batch_size=b)).status for b in (32, 64)]  # doctest: +SKIP
        ['ok', 'ok']
    """

    def __init__(self, task: Task | str | os.PathLike[str], *, device: str = "cpu") -> None:
        import torch

        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"probes run on cpu or cuda, not {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("probe on cuda but no GPU is visible here; probe on cpu or plan with --gpu NAME")
        self.device = str(dev)
        self._payload = _task_payload(task)

    def start(self) -> None:
        """Start the probe server now (returns at once)."""
        prestart()

    def close(self) -> None:
        """Nothing to release per prober: children end with their probe and the shared
        server with the process (or :func:`shutdown`)."""

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def probe(self, config: TrainConfig, *, steps: int = 5, warmup: int = 2,
              budget_bytes: int | None = None, timeout_s: float = 120) -> ProbeResult:
        """Run ``config`` for real in a child process; see :func:`probe`."""
        _check_args(config, steps, warmup, budget_bytes, timeout_s)
        request = self._request(kind="probe", config=config.to_dict(), steps=steps, warmup=warmup,
                                budget_bytes=budget_bytes)
        status, message, reply, wall = self._exchange(request, timeout_s, config.describe())
        est = reply.get("estimate") if reply else None
        steps_s = float(reply.get("steps_s", 0.0)) if reply else 0.0
        return ProbeResult(status=status, estimate=Estimate.from_dict(est) if est else None,
                           message=message, overhead_s=max(0.0, wall - steps_s), wall_s=wall,
                           raised=bool(reply.get("raised")) if reply and status == "error" else False)

    def race(self, configs: tuple[TrainConfig, TrainConfig] | list[TrainConfig], *, rounds: int = 8,
             warmup: int = 2, timeout_s: float = 120) -> RaceResult:
        """Time two configurations step against step in one child process; see
        :func:`estimators.probing._race.race`."""
        from ._race import RaceResult, check_race_args

        pair = check_race_args(configs, rounds, warmup, timeout_s)
        request = self._request(kind="race", configs=[c.to_dict() for c in pair], rounds=rounds, warmup=warmup)
        what = f"{pair[0].describe()} against {pair[1].describe()}"
        status, message, reply, wall = self._exchange(request, timeout_s, what)
        times = tuple(tuple(float(t) for t in ts) for ts in reply.get("step_times", ())) if reply else ()
        return RaceResult(status=status, configs=pair, step_times=times if status == "ok" else (),
                          message=message, wall_s=wall)

    def _request(self, **fields: Any) -> dict[str, Any]:
        import torch

        return {
            "task": self._payload, "device": self.device, "sys_path": list(sys.path),
            # The caller's intra-op threads: a probe times what this process would see.
            "num_threads": torch.get_num_threads(),
            # The server forks children with the environment and directory it started with;
            # the child takes the caller's current ones.
            "env": dict(os.environ), "cwd": os.getcwd(), **fields,
        }

    def _exchange(self, request: dict[str, Any], timeout_s: float,
                  what: str) -> tuple[ProbeStatus, str, dict[str, Any] | None, float]:
        """Send ``request`` to a fresh child; its status, message, reply (None when the child
        failed to answer) and the call's wall time."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s

        def out(status: ProbeStatus, message: str,
                reply: dict[str, Any] | None = None) -> tuple[ProbeStatus, str, dict[str, Any] | None, float]:
            return status, message, reply, time.monotonic() - t0

        timeout_message = f"the probe of {what} did not finish within {timeout_s:g} s; the probe process was killed"
        try:
            child = _Child(deadline)
        except _Timeout:  # the probe server is still starting
            return out("timeout", timeout_message)
        except _ChildGone:
            server = _ZYGOTE
            tail = _log_tail(server.log) if server is not None else ""
            shutdown()
            return out("error", "the probe server died" + (f"; its last output: {tail}" if tail else ""))
        failed: tuple[ProbeStatus, str] | None = None
        reply: dict[str, Any] | None = None
        try:
            reply = child.request(request, deadline)
        except _Timeout:
            child.kill()
            failed = ("timeout", timeout_message)
        except _ChildGone:
            failed = self._crashed(child, what)
        finally:
            child.close()  # counted in the probe's time: the caller waits for it too
        if failed is not None:
            return out(*failed)
        assert reply is not None
        return out(reply["status"], reply.get("message", ""), reply)

    @staticmethod
    def _crashed(child: _Child, what: str) -> tuple[ProbeStatus, str]:
        code = child.wait(5.0)
        tail = _log_tail(child.log)
        if code is not None and code < 0:
            signum = -code
            name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
            if signum == signal.SIGKILL and not child.killed:
                return "oom", (f"the probe process of {what} was killed (SIGKILL), most likely by the "
                               "kernel's OOM killer: the machine ran out of memory")
            message = f"the probe process of {what} died by {name}"
        else:
            message = f"the probe process of {what} exited unexpectedly (exit code {code})"
        return "error", message + (f"; its last output: {tail}" if tail else "")


def _check_args(config: TrainConfig, steps: int, warmup: int, budget_bytes: int | None, timeout_s: float) -> None:
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"probe() needs a TrainConfig, got {type(config).__name__}")
    if config.strategy != "single":
        raise ConfigError(f"probes run one process (strategy single); got strategy {config.strategy!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a whole number >= 1, got {steps!r}")
    if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ConfigError(f"budget_bytes must be a whole number of bytes, got {budget_bytes!r}")
    check_warmup_and_timeout(warmup, timeout_s)


def check_warmup_and_timeout(warmup: int, timeout_s: float) -> None:
    """The arguments probes and races share."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")


def probe(
    task_ref: Task | str | os.PathLike[str],
    config: TrainConfig,
    *,
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    budget_bytes: int | None = None,
    timeout_s: float = 120,
) -> ProbeResult:
    """Train ``config`` for a few real steps in a child process and measure it.

    Args:
        task_ref: A model-file path, a :class:`~estimators.Task` loaded from one (its
            ``source_path`` is used, with the task's ``settings``), or an in-memory Task
            (sent with cloudpickle; :class:`~estimators.ProbeError` if it cannot be).
        config: The configuration (strategy ``single``).
        device: ``cpu`` or ``cuda`` (``cuda:1`` …).
        steps: Timed optimizer steps (the median is reported).
        warmup: Un-timed steps between the two memory steps and the timed ones.
        budget_bytes: Enforce this budget (:class:`~estimators.runtime._guard.MemoryGuard`).
        timeout_s: Wall-clock limit of the whole probe, process start included.

    Returns:
        A :class:`ProbeResult`; what happens in the child never raises here.

    Example:
        >>> r = probe("examples/digits.py", TrainConfig(micro_batch_size=64), steps=3)  # doctest: +SKIP
        >>> r.status, r.estimate.step_time_s > 0                                        # doctest: +SKIP
        ('ok', True)
    """
    return Prober(task_ref, device=device).probe(
        config, steps=steps, warmup=warmup, budget_bytes=budget_bytes, timeout_s=timeout_s)


# --------------------------------------------------------------------------- the child side

_PRELOAD = ("torch._dynamo", "torch.profiler", "torch.utils.checkpoint", "torch.optim",
            "estimators.runtime._guard", "estimators.probing._measure", "estimators.runtime._checkpoint", "estimators.runtime._precision")


def _zygote_main(ctl_fd: int) -> None:
    """The probe server: import once, then fork a child per request until the parent
    says exit or goes away (then the children go too)."""
    import importlib

    t0 = time.monotonic()
    import torch  # noqa: F401

    import estimators  # noqa: F401

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing extra only costs the child time
            pass
    sock = socket.socket(fileno=ctl_fd)
    sock.send(pickle.dumps({"kind": "ready", "pid": os.getpid(), "import_s": time.monotonic() - t0}))
    children: set[int] = set()
    try:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
            except OSError:
                break
            if not data:
                break  # the parent is gone
            msg = pickle.loads(data)
            if msg["kind"] == "fork":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the probe child
                    code = 1
                    try:
                        sock.close()
                        os.setsid()
                        sock_fd, log_fd = fds
                        os.dup2(log_fd, 1)
                        os.dup2(log_fd, 2)
                        os.close(log_fd)
                        _child_main(sock_fd)
                        code = 0
                    except BaseException:  # noqa: BLE001 - report, then leave without cleanup
                        import traceback
                        traceback.print_exc()
                    finally:
                        try:
                            sys.stdout.flush()
                            sys.stderr.flush()
                        finally:
                            os._exit(code)
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                sock.send(pickle.dumps({"id": msg["id"], "pid": pid}))
            elif msg["kind"] == "reap":
                code = _reap(msg["pid"], float(msg["timeout"]))
                if code is not None:
                    children.discard(msg["pid"])
                sock.send(pickle.dumps({"id": msg["id"], "code": code}))
            else:
                break
    finally:
        for pid in children:
            _kill_group(pid)
            _reap(pid, 5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: nothing of the server's needs it


def _reap(pid: int, timeout: float) -> int | None:
    end = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= end:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _child_entry(sock_fd: int) -> None:
    """A fresh interpreter's probe: run it, then leave without interpreter teardown."""
    code = 1
    try:
        _child_main(sock_fd)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _child_main(sock_fd: int) -> None:
    """One probe: read the request, run it, send the reply."""
    import faulthandler

    faulthandler.enable()
    msg = _read_msg(sock_fd, None)
    reply = _serve(msg)
    _write_msg(sock_fd, reply, None)


def _serve(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("env") is not None:
        os.environ.clear()
        os.environ.update(msg["env"])
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if msg.get("cwd"):
        try:
            os.chdir(msg["cwd"])
        except OSError:
            pass
    for entry in reversed(msg.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    source: str | None = msg["task"].get("path")
    try:
        if msg.get("num_threads"):
            import torch
            torch.set_num_threads(int(msg["num_threads"]))
        task = _load(msg["task"])
        if msg.get("kind") == "race":
            from ._race import run_race
            return run_race(task, [TrainConfig.from_dict(c) for c in msg["configs"]], device=msg["device"],
                            rounds=msg["rounds"], warmup=msg["warmup"])
        return _run_probe(task, TrainConfig.from_dict(msg["config"]), device=msg["device"],
                          steps=msg["steps"], warmup=msg["warmup"], budget_bytes=msg["budget_bytes"])
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result
        status = "oom" if is_oom_error(exc) else "error"
        return {"status": status, "estimate": None, "message": _describe(exc, source), "steps_s": 0.0,
                "raised": status == "error"}


def _describe(exc: BaseException, source: str | None) -> str:
    from .._task import _user_frame

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, MemplanError):
        line = first or type(exc).__name__
    else:
        line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if source is not None:
            line += _user_frame(exc, Path(source))
    return line


def _load(spec: dict[str, Any]) -> Task:
    from .._task import load_task

    if "path" in spec:
        task = load_task(spec["path"])
        if spec.get("settings") is not None:
            task = dataclasses.replace(task, settings=dict(spec["settings"]))
        if spec.get("shapes") is not None:
            task._cache["shapes"] = spec["shapes"]
        return task.with_shape_policy(spec.get("shape_policy") or "max")
    return pickle.loads(spec["blob"])


def build_for_training(task: Task, config: TrainConfig, dev: Any) -> Any:
    """The task's model on ``dev``, in train mode, checkpointed as ``config`` says."""
    from ..runtime import _checkpoint

    model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
    model.train()
    model.to(dev)
    _checkpoint.apply_checkpointing(model, config.checkpoint_segments, task.checkpoint_blocks)
    return model


def _run_probe(task: Task, config: TrainConfig, *, device: str, steps: int, warmup: int,
               budget_bytes: int | None) -> dict[str, Any]:
    import contextlib

    import torch

    from ..runtime import _precision
    from ..runtime._guard import MemoryGuard
    from ._measure import storage_bytes

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        if dev.index is not None:
            torch.cuda.set_device(dev)
        torch.cuda.empty_cache()
    model = build_for_training(task, config, dev)
    seen: set[int] = set()
    n_params = n_trainable = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n_params += p.numel()
            n_trainable += p.numel() if p.requires_grad else 0
    param_bytes = storage_bytes(model.parameters())
    buffer_bytes = storage_bytes(model.buffers())
    baseline = storage_bytes([*model.parameters(), *model.buffers()])
    optimizer = task.make_optimizer(model)
    scaler = _precision.make_grad_scaler(config.precision, dev.type)
    task.batch_template()  # the dataset is built outside the measured steps
    guard = MemoryGuard(budget_bytes, device=dev.type) if budget_bytes is not None else None
    if guard is not None:
        guard.track(model)
    step = Stepper(task, config, model, optimizer, scaler, dev)

    # -- memory: the first two optimizer steps -------------------------------------------
    t_steps = time.monotonic()
    peak_phase = ""
    reserved: int | None = None
    whole_run = guard if (guard is not None and cuda) else contextlib.nullcontext()
    with whole_run:
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            tracker = _CudaPeakPhase(dev)
            for i in range(1, _MEMORY_STEPS + 1):
                step(i, phase=tracker)
            torch.cuda.synchronize(dev)
            peak = int(torch.cuda.max_memory_allocated(dev))
            reserved = int(torch.cuda.max_memory_reserved(dev))
            peak_phase = tracker.peak_phase
        else:
            from torch.profiler import record_function

            from ..tracing._profiler import memory_profile

            def label(name: str) -> Any:
                return record_function(_PHASE_PREFIX + name)

            with memory_profile() as prof:
                with guard if guard is not None else contextlib.nullcontext():
                    for i in range(1, _MEMORY_STEPS + 1):
                        step(i, phase=label)
            above, peak_phase = _cpu_peak(prof)
            peak = baseline + above
            del prof
        optimizer_bytes = storage_bytes(
            [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )
        gpu = _gpu_name(dev) if cuda else None
        breakdown = {"params": param_bytes, "buffers": buffer_bytes}
        if peak_phase and not peak_phase.startswith("step 1 "):
            breakdown["optimizer"] = optimizer_bytes  # alive all through steps >= 2
        notes = [
            f"probe: memory over optimizer steps 1-{_MEMORY_STEPS}"
            + (" (max_memory_allocated/reserved)" if cuda else " (torch.profiler, CPU allocator)"),
            "breakdown: parameters, buffers and optimizer state only; the rest of the peak is "
            "activations, gradients, batch and temporaries",
        ]
        if budget_bytes is not None:
            notes.append(f"ran under a memory budget of {budget_bytes} bytes")

        def measured(step_time: float | None, more_notes: list[str]) -> Estimate:
            return Estimate(
                config=config, device=dev.type, gpu=gpu, peak_allocated_bytes=int(peak),
                peak_reserved_bytes=reserved, breakdown=breakdown, peak_phase=peak_phase,
                context_bytes=0, workspace_bytes=0, method="measured", modelled=False,
                params=n_params, trainable_params=n_trainable, step_time_s=step_time,
                samples_per_s=config.global_batch / step_time if step_time else None,
                notes=tuple(notes + more_notes),
            )

        if budget_bytes is not None and not cuda and peak > budget_bytes:
            from .._units import format_size
            return {
                "status": "oom", "steps_s": time.monotonic() - t_steps,
                "estimate": measured(None, ["not timed: over the budget"]).to_dict(),
                "message": f"out of memory: the measured peak {format_size(peak)} (in {peak_phase}) exceeds "
                           f"the budget {format_size(budget_bytes)}; the excess is memory the guard does "
                           "not count (kernel scratch)",
            }

        # -- time: warmup, then timed steps ---------------------------------------------------
        index = _MEMORY_STEPS
        for _ in range(warmup):
            index += 1
            step(index)
        times: list[float] = []
        for _ in range(steps):
            index += 1
            if cuda:
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            step(index)
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
    steps_s = time.monotonic() - t_steps
    estimate = measured(statistics.median(times), [
        f"time: median of {steps} steps after {warmup} warmup steps ({min(times):.4g}-{max(times):.4g} s)"])
    return {"status": "ok", "estimate": estimate.to_dict(), "message": "", "steps_s": steps_s}


_PHASE_PREFIX = "memplan_phase::"


class Stepper:
    """One optimizer step of the trainer: every micro-batch, then the optimizer."""

    def __init__(self, task: Task, config: TrainConfig, model: Any, optimizer: Any, scaler: Any,
                 device: Any) -> None:
        self.task, self.config, self.model = task, config, model
        self.optimizer, self.scaler, self.device = optimizer, scaler, device

    def __call__(self, step: int, phase: Callable[[str], Any] | None = None) -> None:
        import contextlib

        import torch
        from torch.utils._pytree import tree_map

        from ..runtime import _precision

        cfg, task, dev = self.config, self.task, self.device
        n, b = cfg.grad_accum_steps, cfg.micro_batch_size
        label = phase or (lambda _name: contextlib.nullcontext())
        for micro in range(1, n + 1):
            tag = f"step {step}" + (f" micro {micro}" if n > 1 else "")
            with label(f"{tag} forward"):
                batch = task.real_batch(b, offset=(step * n + micro) * b)
                if dev.type != "cpu":
                    batch = tree_map(
                        lambda t: t.to(dev, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)
                with _precision.forward_context(cfg.precision, dev.type):
                    loss = task.compute_loss(self.model, batch)
                    loss = loss / n
            with label(f"{tag} backward"):
                _precision.backward(loss, self.scaler)
                del loss, batch
        with label(f"step {step} optimizer"):
            _precision.optimizer_step(self.optimizer, self.scaler)
        with label(f"step {step} zero_grad"):
            # Flush the gradients: their memory is not needed until the next backward.
            self.optimizer.zero_grad(set_to_none=True)


class _CudaPeakPhase:
    """A phase labeller for cuda: after each phase, did ``max_memory_allocated`` grow?"""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.best = -1
        self.peak_phase = ""

    def __call__(self, name: str) -> Any:
        import contextlib

        import torch

        @contextlib.contextmanager
        def phase() -> Iterator[None]:
            yield
            now = int(torch.cuda.max_memory_allocated(self.device))
            if now > self.best:
                self.best, self.peak_phase = now, name
        return phase()


def _cpu_peak(prof: Any) -> tuple[int, str]:
    """Highest running sum of the profiler's allocation events, and the phase it falls in."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, str]] = []
    stack: list[tuple[Any, str]] = [(n, "") for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, phase = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, phase))
        elif node.name.startswith(_PHASE_PREFIX):
            phase = node.name[len(_PHASE_PREFIX):]
        stack.extend((child, phase) for child in node.children)
    events.sort(key=lambda e: e[0])
    running = peak = 0
    peak_phase = ""
    for _, size, phase in events:
        running += size
        if running > peak:
            peak, peak_phase = running, phase
    return peak, peak_phase


def _gpu_name(dev: Any) -> str:
    import torch

    try:
        from .._gpus import detect_local_gpu
        spec = detect_local_gpu()
        if spec is not None:
            return spec.name
    except Exception:  # noqa: BLE001 - the raw name will do
        pass
    return torch.cuda.get_device_name(dev)
