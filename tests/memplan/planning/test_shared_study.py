"""A study shared by several ``memplan plan`` processes on a real PostgreSQL server
(``helpers.postgres``): each configuration estimated by one process, every process's plan the
one a single process makes, a process killed mid-trial retried by another; SQLite for one
process as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from estimators import ConfigError

# A small MLP whose forward sleeps when asked: NET_FORWARD_SLEEP makes each trace take long
# enough that concurrent processes share the work; with NET_HANG_MARKER, the process's
# NET_HANG_AFTER-th forward (inside a trial's trace: nothing else runs the model) touches that
# file and hangs, to be killed there.
NET_SOURCE = '''
import os
import time

import torch
import torch.nn as nn

FORWARDS = [0]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        FORWARDS[0] += 1
        started = os.environ.get("NET_STARTED_MARKER")
        if started:
            open(started, "w").close()
        marker = os.environ.get("NET_HANG_MARKER")
        if marker and FORWARDS[0] >= int(os.environ.get("NET_HANG_AFTER", "1")):
            open(marker, "w").close()
            time.sleep(600)
        time.sleep(float(os.environ.get("NET_FORWARD_SLEEP", "0")))
        return self.blocks(x)


def model():
    return Net()


def train_data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
'''

# 2 micro-batch sizes x 2 precisions x 2 checkpoint segments = 8 configurations, on a card
# that is absent (a static plan: no probes, no measured CPU rates to differ between processes).
PLAN_ARGS = ["--gpu", "A100-80GB", "--global-batch", "8", "--micro-batch", "2,4", "--checkpoint", "0,2",
             "--probe-top", "0"]
SEARCH_KWARGS: dict[str, Any] = {"gpu": "A100-80GB", "global_batch": 8, "micro_batch_sizes": [2, 4],
                                 "checkpoint_segments": [0, 2], "probe_top": 0}
CONFIGS = 8


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, worker_id) -> tuple[Path, dict[str, Any], str]:
    """The model file, the plan of one process over the space (on SQLite, as today) and its
    storage: made once for the session's test processes (pytest-xdist workers), by the first
    to need them, in a folder they share."""
    from filelock import FileLock

    from memplan import search

    root = tmp_path_factory.getbasetemp()
    folder = (root if worker_id == "master" else root.parent) / "shared-study"
    folder.mkdir(exist_ok=True)
    net, plan_file, storage = folder / "net.py", folder / "one.json", f"sqlite:///{folder / 'one.db'}"
    with FileLock(str(folder / "lock")):
        if not plan_file.exists():
            net.write_text(NET_SOURCE)
            search(str(net), storage=storage, **SEARCH_KWARGS).save(plan_file)
    return net, json.loads(plan_file.read_text()), storage


@pytest.fixture
def net_file(one_process) -> Path:
    return one_process[0]


def _worker(net_file: Path, url: str, out: Path, **env: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "memplan.cli", "plan", str(net_file), *PLAN_ARGS, "--storage", url,
               "--out", str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MEMPLAN_STUDY_GRACE_S": "3", **env}
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)


def _finish(process: subprocess.Popen[bytes], out: Path, timeout: float = 120) -> dict[str, Any]:
    rc = process.wait(timeout=timeout)
    log = out.with_suffix(".log").read_text()
    assert rc == 0, log
    plan = json.loads(out.read_text())
    plan["provenance"].pop("created")
    return plan


def _same_plan(shared: dict[str, Any], one: dict[str, Any]) -> None:
    """The same configurations, ranked alike, with the same figures. (Each shape of this space is
    asked at two micro-batch sizes and traced at both, never scaled: even each estimate's
    ``method``, which elsewhere depends on which process traced what, is one process's.)"""
    assert shared["entries"] == one["entries"]
    assert shared["failures"] == one["failures"]
    assert shared["trials"] == one["trials"] == CONFIGS


def _study(url: str) -> optuna.Study:
    (name,) = optuna.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url)


def _estimated(study: optuna.Study) -> list[tuple[str, tuple[Any, ...]]]:
    """(process, configuration's parameters) of every trial that answered its configuration."""
    return [(t.user_attrs["worker"], tuple(sorted(t.params.items())))
            for t in study.get_trials(states=(TrialState.COMPLETE,)) if "worker" in t.user_attrs]


@pytest.mark.slow
def test_two_processes_estimate_each_configuration_once_and_make_one_plan(net_file, one_process, postgres_url,
                                                                          tmp_path):
    outs = [tmp_path / f"w{i}.json" for i in range(2)]
    workers = [_worker(net_file, postgres_url, out, NET_FORWARD_SLEEP="0.1") for out in outs]
    plans = [_finish(w, out) for w, out in zip(workers, outs)]
    assert plans[0] == plans[1]
    _same_plan(plans[0], one_process[1])

    estimated = _estimated(_study(postgres_url))
    configs = [c for _, c in estimated]
    assert len(configs) == len(set(configs)) == CONFIGS  # each once, all of them
    assert len({w for w, _ in estimated}) == 2, estimated  # the work was shared


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # retried_trial_number
def test_three_processes_one_killed_mid_trial_its_trial_retried(net_file, one_process, postgres_url, tmp_path):
    marker = tmp_path / "hung"
    outs = [tmp_path / f"w{i}.json" for i in range(3)]
    # This one hangs in its second trace (a trace runs the model twice): it has answered a
    # configuration or so, and holds the claim of the one it was tracing.
    started = tmp_path / "started"
    killed = _worker(net_file, postgres_url, outs[0], NET_FORWARD_SLEEP="0.1", NET_HANG_MARKER=str(marker),
                     NET_HANG_AFTER="3", NET_STARTED_MARKER=str(started))
    # The others start once it traces: started together on a busy machine, they could answer
    # every configuration before it reached its second trace.
    deadline = time.monotonic() + 120
    while not started.exists():
        assert killed.poll() is None, outs[0].with_suffix(".log").read_text()
        assert time.monotonic() < deadline, "the process to kill never reached a trace"
        time.sleep(0.05)
    workers = [_worker(net_file, postgres_url, out, NET_FORWARD_SLEEP="0.1") for out in outs[1:]]
    while not marker.exists():  # the process is inside a trial's trace
        assert killed.poll() is None, outs[0].with_suffix(".log").read_text()
        assert time.monotonic() < deadline, "the process to kill never reached a trace"
        time.sleep(0.05)
    killed.kill()  # SIGKILL: no handler runs, the trial stays RUNNING until its heartbeat is missed
    killed.wait()
    plans = [_finish(w, out) for w, out in zip(workers, outs[1:])]
    assert plans[0] == plans[1]
    _same_plan(plans[0], one_process[1])

    study = _study(postgres_url)
    trials = study.get_trials()
    (dead,) = [t for t in trials if t.state == TrialState.FAIL]
    retried = [t for t in trials if optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == dead.number]
    assert [t.state for t in retried] == [TrialState.COMPLETE]
    assert retried[0].params == dead.params
    estimated = _estimated(study)
    configs = [c for _, c in estimated]
    assert len(configs) == len(set(configs)) == CONFIGS
    # Answered by a process still alive, itself (not copied from another trial).
    assert retried[0].user_attrs["worker"].rsplit(":", 1)[1] in {str(w.pid) for w in workers}
    assert "same_as" not in retried[0].user_attrs


def test_one_process_on_sqlite_runs_in_memory_without_claims(one_process):
    """The default: a study of one process, mirrored into SQLite, no claims table."""
    _, plan, storage = one_process
    study = _study(storage)
    assert len({tuple(sorted(t.params.items())) for t in study.get_trials(states=(TrialState.COMPLETE,))}) == CONFIGS
    assert "memplan_claims" not in sa.inspect(sa.create_engine(storage)).get_table_names()
    assert plan["trials"] == CONFIGS


def test_a_sampled_shared_study_closes_at_its_budget_and_is_resumed(net_file, postgres_url):
    """A space larger than ``trials`` is sampled (TPE) until the processes answered ``trials``
    configurations; the study is then closed, and a later process plans from it unchanged."""
    from memplan import search
    # trials=3, given, is the limit of enumeration: the process alone below samples this space too.

    first = search(str(net_file), storage=postgres_url, trials=3, **SEARCH_KWARGS)
    study = _study(postgres_url)
    assert study.user_attrs["closed_at_trials"] == 3
    assert len(_estimated(study)) == first.to_dict()["trials"] == 3
    asked = len(study.get_trials())
    again = search(str(net_file), storage=postgres_url, trials=3, **SEARCH_KWARGS)
    assert len(_estimated(_study(postgres_url))) == 3  # nothing estimated again
    assert again.to_dict()["entries"] == first.to_dict()["entries"]
    # One process on the same study (--no-shared, to probe on the machine that trains) reuses it too.
    alone = search(str(net_file), storage=postgres_url, trials=3, shared=False, **SEARCH_KWARGS)
    assert alone.to_dict()["entries"] == first.to_dict()["entries"]
    assert len(_study(postgres_url).get_trials()) == asked  # neither asked a trial


def test_claims_go_to_the_first_and_move_only_from_a_failed_owner(postgres_url):
    from memplan.planning._shared import SharedStudy

    def open_(key: str, check: bool = True) -> SharedStudy:
        return SharedStudy(name="claims", storage=postgres_url, sampler=optuna.samplers.RandomSampler(), key=key,
                           check_key=check)

    a, b = open_("k"), open_("k")
    assert a.claims.claim("config", 3) == 3
    assert b.claims.claim("config", 7) == 3  # the second process learns the owner
    assert not b.claims.take_over("config", 5, 7)  # only from the owner it saw fail
    assert b.claims.take_over("config", 3, 7) and not a.claims.take_over("config", 3, 9)
    assert a.claims.owner("config") == 7
    # A group is held by one process, renewed as it goes, and taken over once not renewed for
    # the grace period (as the taker's clock sees it).
    assert a.claims.hold("group", "a", grace=0.3) and a.claims.hold("group", "a", grace=0.3)
    assert not b.claims.hold("group", "b", grace=0.3)
    time.sleep(0.35)
    assert a.claims.hold("group", "a", grace=0.3)
    assert not b.claims.hold("group", "b", grace=0.3)  # renewed since b last looked: a is alive
    time.sleep(0.35)
    assert b.claims.hold("group", "b", grace=0.3)  # a renewed nothing for 0.35 s
    assert not a.claims.hold("group", "a", grace=10)
    with pytest.raises(ConfigError, match="holds another search"):
        open_("other")  # a named study refuses other inputs
    open_("other", check=False)  # a study named by its inputs' hash is those inputs


def test_shared_by_the_storage_unless_said():
    from memplan.planning._shared import shares_storage

    assert not shares_storage(None, None)
    assert not shares_storage("sqlite:///studies.db", None)
    assert shares_storage("sqlite:///studies.db", True)
    assert shares_storage("postgresql://user@host/db", None)
    assert shares_storage("mysql+pymysql://user@host/db", None)
    assert not shares_storage("postgresql://user@host/db", False)


def test_study_flags_are_plans_only():
    from memplan.cli._args import search_kwargs
    from memplan.cli._main import build_parser

    args = build_parser().parse_args(["plan", "model.py", "--study-name", "run1", "--shared"])
    kwargs = search_kwargs(args)
    assert kwargs["study_name"] == "run1" and kwargs["shared"] is True
    assert "study_name" not in search_kwargs(build_parser().parse_args(["plan", "model.py"]))
    assert search_kwargs(build_parser().parse_args(["plan", "model.py", "--no-shared"]))["shared"] is False
    with pytest.raises(ConfigError, match="memplan plan's"):
        search_kwargs(build_parser().parse_args(["fit", "model.py", "--study-name", "run1"]))
