"""The probe's child side: the fork server's loop, and one child running one request.

A request's ``kind`` names its handler in :data:`HANDLERS` (``module:function(task, msg)``),
imported by name in the child: this module imports neither the probe nor the race module,
which both reach the server through :mod:`estimators.probing._server`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import socket
import sys
import time
from pathlib import Path
from typing import cast

from .._errors import MemplanError
from ..runtime._oom import is_oom_error
from ..task._task import Task
from ._messages import ProbeStatus, Reply, Request, TaskPayload
from ._wire import kill_group, read_msg, write_msg

__all__ = ["HANDLERS"]

HANDLERS = {
    "probe": "estimators.probing._run:serve_probe",
    "race": "estimators.probing._race:serve_race",
}
"""What a child runs for a request's ``kind``: ``module:function(task, msg) -> reply``."""


_PRELOAD = ("torch._dynamo", "torch.profiler", "torch.utils.checkpoint", "torch.optim",
            "estimators.runtime._guard", "estimators.probing._measure", "estimators.probing._run",
            "estimators.runtime._checkpoint", "estimators.runtime._precision", "estimators.runtime._step")


def _zygote_main(ctl_fd: int) -> None:
    """The probe server: import once, then fork a child per request until the parent
    says exit or goes away (then the children go too)."""
    import importlib

    t0 = time.monotonic()
    import torch  # noqa: F401

    # (Each module's import runs the estimators package's first: the whole public API loads.)
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
                    _forked_child(sock, fds)
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
            kill_group(pid)
            _reap(pid, 5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: nothing of the server's needs it


def _forked_child(server_sock: socket.socket, fds: list[int]) -> None:
    """In a child just forked from the server: own process group, output to the log, run the
    request, then leave without cleanup (the server's state is not this process's to tear down)."""
    code = 1
    try:
        server_sock.close()
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
    msg = cast(Request, read_msg(sock_fd, None))  # as Prober.request made it
    reply = _serve(msg)
    write_msg(sock_fd, reply, None)


def _serve(msg: Request) -> Reply:
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
        module, _, function = HANDLERS[msg.get("kind", "probe")].partition(":")
        return getattr(importlib.import_module(module), function)(task, msg)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result
        status: ProbeStatus = "oom" if is_oom_error(exc) else "error"
        return {"status": status, "estimate": None, "message": _describe(exc, source), "steps_s": 0.0,
                "raised": status == "error"}


def _describe(exc: BaseException, source: str | None) -> str:
    from ..task._task import _user_frame

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, MemplanError):
        line = first or type(exc).__name__
    else:
        line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if source is not None:
            line += _user_frame(exc, Path(source))
    return line


def _load(spec: TaskPayload) -> Task:
    from ..task._task import load_task

    if "path" in spec:
        task = load_task(spec["path"])
        settings = spec.get("settings")
        if settings is not None:
            task = dataclasses.replace(task, settings=dict(settings))
        if spec.get("shapes") is not None:
            task._cache["shapes"] = spec["shapes"]
        if spec.get("step") is not None:
            task = task.with_step(spec["step"])
        return task.with_shape_policy(spec.get("shape_policy") or "max")
    return pickle.loads(spec["blob"])
