"""The probe tests' helpers (tests/estimators/probing/test_probe.py, tests/estimators/probing/test_race.py): a 60 s bound per test,
one probe server per module, model files on disk, and the check that no probe child is left."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from estimators.probing._probe import shutdown
from estimators.probing._server import _zygote

__all__ = ["time_bound", "probe_server", "write_model", "descendants", "gone", "assert_no_probe_children"]


@pytest.fixture(autouse=True)
def time_bound():
    """Each test ends within 60 s (pytest-timeout is not a dependency)."""
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("test took more than 60 s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def write_model(tmp_path: Path, body: str, extra: str = "", name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body) + textwrap.dedent(extra))
    return path


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (zombies excluded), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parent[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting to be reaped by its parent)."""
    for _ in range(50):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2:].startswith("Z"):
            return True
        time.sleep(0.02)  # SIGKILL is delivered asynchronously
    return False


def _multiprocessing_helper(pid: int) -> bool:
    # multiprocessing's own long-lived helpers (the forkserver distributed training starts its
    # ranks from, its resource tracker) are not probe children.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True
    return b"multiprocessing.forkserver" in cmdline or b"multiprocessing.resource_tracker" in cmdline


def assert_no_probe_children() -> None:
    """Only the probe server may outlive a probe."""
    server = _zygote().proc.pid
    left = {pid for pid in descendants(os.getpid()) if not _multiprocessing_helper(pid)}
    assert left <= {server}, "a probe child outlived its probe"
    assert descendants(server) == set()


@pytest.fixture(scope="module", autouse=True)
def probe_server():
    # Start the server once and wait for it, so that timeouts below time the probe alone.
    _zygote().wait_ready(time.monotonic() + 120)
    yield
    shutdown()
