from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures of the shared-study tests

# The suite runs offline (CI reaches only the package registries): the Hugging Face libraries
# read their local cache and never wait on the Hub. Set before they are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers (pytest-xdist, one per core) each run one intra-op thread, and so do the
    # processes they start (probes, ranks, trace workers): several workers with a thread per
    # core each would fight over the cores, and OpenMP's spinning threads make that far slower
    # than the parallelism gains. Results do not depend on the thread count.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def write_model(tmp_path: Path):
    """Write a model file into tmp_path and return its path."""
    def write(source: str, name: str = "model_file.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return str(path)
    return write


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """One intra-op thread for a module: its models are tiny, and one thread is ~10x faster
    than several fighting over a busy 2-core machine (or over it with the ranks of a
    distributed test); results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memplan-cache")


@pytest.fixture(autouse=True)
def _cache_dir(_session_cache, monkeypatch):
    """No test writes into the user's ~/.cache/memplan: the cache folder (studies, measured CPU
    rates) is one of pytest's temporary folders, shared by the session so that the CPU rates
    are measured once; tests that need a study of their own set a folder of their own."""
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(_session_cache))


@pytest.fixture(scope="module", autouse=True)
def _no_trace_workers_left():
    """A module's estimators may leave their trace-worker processes to the garbage collector;
    the next module (the probe tests count child processes) starts without them."""
    yield
    from estimators.tracing._trace_worker import close_all
    close_all()
