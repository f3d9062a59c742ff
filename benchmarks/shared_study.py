"""One study, several processes: ``memplan plan`` processes sharing a PostgreSQL study against
one process on SQLite.

For each model: one ``memplan plan`` process on its own SQLite storage (today's default: the
study in memory, the traces prefetched on both cores), then N = 1, 2 and 3 processes started
together on one fresh PostgreSQL database (a throwaway cluster, ``tests/helpers/postgres.py``),
all with the same command (an A100-80GB target: a static plan, nothing probed, the same
anywhere), then one more process on the complete study (it estimates nothing: the cost of a
process's start). Reported: the wall time (until the last process is done), each process's
own and its CPU time (user + system, its children's included); the configurations each process
estimated (the trials with its ``worker`` attribute); whether each configuration was estimated
once and all were; whether the processes' plans are one another's and the one process's (entries:
configurations, order, figures; failures) but for each estimate's ``method``, and for how many
entries that label differs.

Every process is started from scratch (Python, torch, memplan: a few seconds each), as on
separate machines; here they share one machine's cores, so the wall time says what sharing
costs on one machine, not what it gains on several.

    python benchmarks/shared_study.py [--models gpt_tied,cnn_bn] [--workers 1,2,3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import optuna  # noqa: E402
import torch  # noqa: E402
from helpers.postgres import PostgresServer  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

MODELS = {
    "gpt_tied": ROOT / "benchmarks" / "models" / "gpt_tied.py",
    "cnn_bn": ROOT / "benchmarks" / "models" / "cnn_bn.py",
    "digits": ROOT / "examples" / "digits.py",
}
PLAN_ARGS = ["--gpu", "A100-80GB", "--probe-top", "0"]


def _plan_command(model: Path, storage: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "memplan.cli", "plan", str(model), *PLAN_ARGS, "--storage", storage,
            "--out", str(out)]


def _run(commands: list[list[str]], cache: Path, logs: Path) -> tuple[float, list[float], list[float]]:
    """Start ``commands`` together; (wall time until the last ends, each one's wall time, each
    one's CPU time: user + system, its own children's included)."""
    env = {**os.environ, "MEMPLAN_CACHE_DIR": str(cache)}
    start = time.monotonic()
    procs = []
    for i, command in enumerate(commands):
        log = open(logs / f"{i}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    own = [0.0] * len(procs)
    cpu = [0.0] * len(procs)
    pending = set(range(len(procs)))
    while pending:
        for i in list(pending):
            proc, log = procs[i]
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            own[i] = time.monotonic() - start
            cpu[i] = usage.ru_utime + usage.ru_stime
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.close()
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(commands[i])} failed ({proc.returncode}):\n"
                                 f"{(logs / f'{i}.log').read_text()}")
            pending.discard(i)
        time.sleep(0.05)
    return max(own), own, cpu


def _plan(path: Path) -> dict[str, Any]:
    plan = json.loads(path.read_text())
    return {"entries": plan["entries"], "failures": plan["failures"], "trials": plan["trials"]}


def _without_method(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan but for each estimate's ``method`` (traced at its own micro-batch size, or scaled
    from the traces of two others): which it is depends on which process traced what."""
    entries = [{**e, "predicted": {k: v for k, v in e["predicted"].items() if k != "method"}} for e in plan["entries"]]
    return {**plan, "entries": entries}


def _estimated(url: str) -> list[tuple[str, tuple[Any, ...]]]:
    (name,) = optuna.get_all_study_names(url)
    study = optuna.load_study(study_name=name, storage=url)
    return [(t.user_attrs["worker"], tuple(sorted(t.params.items())))
            for t in study.get_trials(states=(TrialState.COMPLETE,)) if "worker" in t.user_attrs]


def measure(model: Path, workers: list[int], server: PostgresServer, work: Path) -> list[dict[str, Any]]:
    rows = []
    one_out = work / "one.json"
    (work / "one").mkdir()
    wall, _, cpu = _run([_plan_command(model, f"sqlite:///{work / 'one.db'}", one_out)], work / "one", work / "one")
    one = _plan(one_out)
    rows.append({"processes": "1 (SQLite)", "wall": wall, "own": [wall], "cpu": cpu, "estimated": [one["trials"]],
                 "configs": one["trials"], "once": True, "same": True, "methods": 0})
    for n in workers:
        url = server.create_database(f"bench{n}")
        folder = work / f"n{n}"
        folder.mkdir()
        outs = [folder / f"w{i}.json" for i in range(n)]
        wall, own, cpu = _run([_plan_command(model, url, out) for out in outs], folder, folder)
        plans = [_plan(out) for out in outs]
        estimated = _estimated(url)
        configs = [c for _, c in estimated]
        per = Counter(w for w, _ in estimated)
        labels = [(e["config"], e["predicted"]["method"]) for e in one["entries"]]
        rows.append({
            "processes": f"{n} (PostgreSQL)", "wall": wall, "own": own, "cpu": cpu,
            "estimated": sorted(per.values(), reverse=True) + [0] * (n - len(per)),
            "configs": len(set(configs)),
            "once": len(configs) == len(set(configs)) == one["trials"],
            "same": all(p == plans[0] for p in plans) and _without_method(plans[0]) == _without_method(one),
            "methods": sum(1 for a, b in zip(labels, ((e["config"], e["predicted"]["method"])
                                                      for e in plans[0]["entries"])) if a != b),
        })
    # One more process on the last, complete study: what a process costs that estimates nothing.
    out = folder / "late.json"
    (folder / "late").mkdir()
    wall, _, cpu = _run([_plan_command(model, url, out)], folder, folder / "late")
    late = _plan(out)
    rows.append({"processes": "1 more, the study complete", "wall": wall, "own": [wall], "cpu": cpu,
                 "estimated": [len(_estimated(url)) - len(configs)], "configs": len(set(c for _, c in _estimated(url))),
                 "once": len(_estimated(url)) == len(configs), "same": _without_method(late) == _without_method(one),
                 "methods": sum(1 for a, b in zip(one["entries"], late["entries"])
                                if a["predicted"]["method"] != b["predicted"]["method"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt_tied,cnn_bn")
    parser.add_argument("--workers", default="1,2,3")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "shared_study.md"))
    args = parser.parse_args()
    workers = [int(n) for n in args.workers.split(",")]
    load = os.getloadavg()
    server = PostgresServer()
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for name in args.models.split(","):
            with tempfile.TemporaryDirectory(prefix="memplan-shared-bench-") as folder:
                results[name] = measure(MODELS[name], workers, server, Path(folder))
                for row in results[name]:
                    print(name, row, flush=True)
    finally:
        server.stop()

    lines = [
        "# One study, several processes (PostgreSQL) against one process (SQLite)",
        "",
        f"Command: `python benchmarks/shared_study.py --models {args.models} --workers {args.workers}`",
        "",
        f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, optuna {optuna.__version__}, {os.cpu_count()} cores; "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
        f"- every process: `memplan plan MODEL {' '.join(PLAN_ARGS)} --storage URL` (the model file's "
        "global batch), started from scratch; N processes started together on one fresh database of a "
        "local PostgreSQL cluster (a Unix socket, fsync off)",
        "- estimated: the configurations each process estimated itself (the others it copied, or never "
        "asked); once: every configuration of the space estimated, none twice; same plan: the processes' "
        "plans are one another's, and their entries (configurations, order, every figure) and failures "
        "are the one process's but for each estimate's `method` (counted in the last column: traced at "
        "its own micro-batch size or scaled from two traces, which depends on which process traced what)",
        "",
        "| model | processes | wall (s) | each process: wall, CPU (s) | estimated per process | configurations "
        "| each once | same plan | `method` labels that differ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for row in rows:
            each = ", ".join(f"{w:.1f} / {c:.1f}" for w, c in zip(row["own"], row["cpu"]))
            lines.append(
                f"| {name} | {row['processes']} | {row['wall']:.1f} | {each} | "
                f"{' + '.join(str(e) for e in row['estimated'])} | {row['configs']} | "
                f"{'yes' if row['once'] else 'NO'} | {'yes' if row['same'] else 'NO'} | {row['methods']} |"
            )
    lines += [
        "",
        "Here every process shares one machine's cores (and other jobs' load, above), so the wall time",
        "is not what sharing gains over several machines. A process's CPU time is closer to that: on a",
        "machine of its own, a shared process takes about its CPU time (it traces on one core; the one",
        "process prefetches its traces on two, its CPU time counting both). Each process pays a start",
        "(Python, torch, memplan, the model's set-up) that its share of the space does not shrink: the",
        "last row of each model, one more process on the complete study, estimates nothing and measures",
        "it. The space is split by shapes (a configuration but for its micro-batch size and accumulation:",
        "the estimator traces each shape at two or three micro-batch sizes and scales the rest), so the",
        "shares are whole shapes.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
