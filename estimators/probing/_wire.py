"""Length-prefixed pickled messages over a socket, with deadlines: how a probe's parent and
child talk (the child may die at any moment; the parent never blocks past its deadline), and
how a child's process group is ended."""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time

__all__ = ["Timeout", "ChildGone", "wait_fd", "write_msg", "read_msg", "kill_group"]


class Timeout(Exception):
    pass


class ChildGone(Exception):
    pass


def wait_fd(fd: int, *, write: bool, timeout: float) -> bool:
    """Whether ``fd`` became readable (writable) within ``timeout`` seconds (poll, not
    select: descriptors above 1023 work too)."""
    poller = select.poll()
    poller.register(fd, (select.POLLOUT if write else select.POLLIN) | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("<Q", len(data)) + data


def write_msg(fd: int, obj: object, deadline: float | None) -> None:
    view = memoryview(_frame(obj))
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout
            if not wait_fd(fd, write=True, timeout=remaining):
                raise Timeout
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            continue
        except OSError as exc:  # EPIPE, ECONNRESET: the other side is gone
            raise ChildGone from exc
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout
            if not wait_fd(fd, write=False, timeout=remaining):
                raise Timeout
        try:
            chunk = os.read(fd, min(n, 1 << 20))
        except BlockingIOError:
            continue
        except OSError as exc:
            raise ChildGone from exc
        if not chunk:
            raise ChildGone
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_msg(fd: int, deadline: float | None) -> object:
    (size,) = struct.unpack("<Q", _read_exact(fd, 8, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def kill_group(pid: int) -> None:
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
