"""The probe server, parent side: children forked from a warm interpreter, one per request.

:func:`prestart` starts a probe server -- a clean interpreter that has imported torch, never
forked from the caller -- and :class:`Child` has it fork a child per request (Linux; elsewhere,
or with ``MEMPLAN_PROBE_START=spawn``, each child is a fresh interpreter). What runs in the
child is :mod:`estimators.probing._child`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TypedDict, cast

from .._errors import ProbeError
from ._messages import Reply, Request
from ._wire import ChildGone, Timeout, kill_group, read_msg, wait_fd, write_msg

__all__ = ["Child", "ChildGone", "Timeout", "prestart", "shutdown", "log_tail", "server_log"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


# --------------------------------------------------------------------------- the parent side

def log_tail(log: IO[bytes], lines: int = 3) -> str:
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
    "from estimators.probing._child import _zygote_main; _zygote_main(int(sys.argv[1]))"
)
class _ServerReply(TypedDict, total=False):
    """What the fork server answers (``_child._zygote_main``): ``ready`` once it runs, then
    per request its ``id`` and a forked child's ``pid`` or a reaped child's exit ``code``."""

    kind: str
    id: int
    pid: int
    import_s: float
    code: int | None


_CHILD_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from estimators.probing._child import _child_entry; _child_entry(int(sys.argv[1]))"
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

    def _recv(self, deadline: float | None, want: int | None = None) -> _ServerReply:
        while True:
            if deadline is not None:
                if not wait_fd(self.sock.fileno(), write=False, timeout=deadline - time.monotonic()):
                    raise Timeout
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                raise ChildGone from exc
            if not data:
                raise ChildGone
            reply: _ServerReply = pickle.loads(data)
            # A reply to an earlier request that timed out is skipped (a child forked for it
            # finds its socket closed and exits; the server reaps it when it stops).
            if want is None or reply.get("id") == want:
                return reply

    def _call(self, msg: dict[str, object], fds: list[int], deadline: float | None) -> _ServerReply:
        self._wait_ready(deadline)
        self.serial += 1
        msg = {**msg, "id": self.serial}
        try:
            socket.send_fds(self.sock, [pickle.dumps(msg)], fds)
        except OSError as exc:
            raise ChildGone from exc
        return self._recv(deadline, want=self.serial)

    def _wait_ready(self, deadline: float | None) -> None:
        if self.ready_s is None:
            reply = self._recv(deadline)
            if reply.get("kind") != "ready":  # pragma: no cover - protocol error
                raise ChildGone
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
            except (Timeout, ChildGone):
                return None

    def close(self) -> None:
        if self.alive():
            with self.lock:
                try:
                    self.sock.send(pickle.dumps({"kind": "exit"}))
                    self.proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        kill_group(self.proc.pid)  # the server and anything left in its group
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

class Child:
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

    def request(self, msg: Request, deadline: float) -> Reply:
        write_msg(self.sock.fileno(), msg, deadline)
        return cast(Reply, read_msg(self.sock.fileno(), deadline))  # as the child's _serve made it

    def kill(self) -> None:
        self.killed = True
        kill_group(self.pid)

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


def server_log() -> IO[bytes] | None:
    """The running probe server's log file (None when none runs)."""
    return _ZYGOTE.log if _ZYGOTE is not None else None
