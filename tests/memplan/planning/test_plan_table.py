"""The plan's table: every samples/s figure on one basis, the order the figures', the basis named.

Races time two configurations step against step in one process: comparable with each other.
Two races run at different moments of a shared machine (or a probe in a process of its own)
are not: a configuration's figure is the measured best's times the speed ratio of the races
that link the two, so a race's loser never shows faster than its winner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from estimators import Estimate, TrainConfig
from estimators.probing._probe import ProbeResult
from estimators.probing._race import RaceResult
from memplan.planning import Plan, PlanEntry
from memplan.planning._probes import probe_best
from memplan.planning._ranking import rank_measured

GLOBAL = 8
A = TrainConfig(micro_batch_size=8, grad_accum_steps=1)
B = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
C = TrainConfig(micro_batch_size=2, grad_accum_steps=4)
D = TrainConfig(micro_batch_size=1, grad_accum_steps=8)


def estimate(config: TrainConfig, speed: float, *, method: str = "traced", peak: int = 1000) -> Estimate:
    return Estimate(step_time_s=GLOBAL / speed, samples_per_s=speed, config=config, device="cpu", gpu=None,
                    peak_allocated_bytes=peak, peak_reserved_bytes=None, breakdown={}, peak_phase="backward",
                    context_bytes=0, workspace_bytes=0, method=method, modelled=False, params=1,
                    trainable_params=1, notes=())


@dataclass
class FakeEstimator:
    """What the ranking asks of an estimator: its device, calibrations (ignored), and the
    refitted predictions (``refit``: config -> samples/s; the rest as predicted)."""

    refit: dict[TrainConfig, float]
    device: str = "cpu"

    def calibrate(self, config: TrainConfig, step: float, *, predicted: Estimate | None = None) -> None:
        pass

    def recalibrated(self, est: Estimate) -> Estimate:
        speed = self.refit.get(est.config)
        return est if speed is None else replace(est, samples_per_s=speed, step_time_s=GLOBAL / speed)


def memory_probe(calls: list[TrainConfig]):
    def probe(task, config: TrainConfig, budget: int) -> ProbeResult:
        calls.append(config)
        # A probe's own time, in a process of its own: fast here, and never what the table shows.
        return ProbeResult(status="ok", estimate=estimate(config, 1000.0, method="measured"), message="",
                           overhead_s=0.0, wall_s=0.0)
    return probe


def races_answering(races: list, answers: list):
    def race(task, pair):
        races.append(pair)
        return RaceResult(status="ok", configs=pair, step_times=answers[len(races) - 1])
    return race


def plan_of(entries: list[PlanEntry]) -> Plan:
    return Plan(entries=tuple(entries), budget_bytes=10**9, margin=0.1, device="cpu", gpu=None,
                global_batch=GLOBAL, trials=len(entries))


def table_rows(plan: Plan) -> list[list[str]]:
    lines = plan.table().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip() or not line.strip()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def assert_one_basis(plan: Plan) -> None:
    """The order is the figures', the first the measured best, every row its basis named."""
    speeds = [e.samples_per_s for e in plan.entries]
    assert speeds == sorted(speeds, reverse=True)
    rows = table_rows(plan)
    shown = [float(r[-3].replace(",", "")) for r in rows]
    assert shown == sorted(shown, reverse=True)
    assert all(float(r[-2]) <= 1.0 for r in rows) and float(rows[0][-2]) == 1.0
    assert [r[-1] for r in rows] == [e.source for e in plan.entries[: len(rows)]]
    assert "samples/s, on one basis" in plan.table()


def test_a_walk_raced_at_a_slower_moment_does_not_show_its_loser_faster():
    # Race 1: B beats the predicted best A (0.5 s against 0.4 s). The walk's race of B against
    # C runs while the machine is busier: C wins, 1.0 s against 0.8 s. C's own median (0.8 s)
    # and B's from the first race (0.4 s) would show the loser twice as fast as the winner.
    entries = [PlanEntry(config=c, predicted=estimate(c, s)) for c, s in ((A, 20.0), (B, 19.0), (C, 9.0),
                                                                         (D, 8.0))]
    races: list = []
    calls: list[TrainConfig] = []
    ranked, notes = probe_best(
        None, FakeEstimator({}), entries, 2, 10**9, memory_probe(calls),
        races_answering(races, [((0.5, 0.5, 0.5), (0.4, 0.4, 0.4)), ((1.0, 1.0, 1.0), (0.8, 0.8, 0.8)),
                                ((0.8, 0.8, 0.8), (1.0, 1.0, 1.0))]), {})
    # The walk goes one step further, D against C, and stops there: D loses (0.8 s to 1.0 s).
    assert races == [(A, B), (B, C), (C, D)] and calls == [C]
    plan = plan_of(ranked)
    assert plan.best.config == C and plan.best.source == "measured"
    assert plan.best.samples_per_s == pytest.approx(GLOBAL / 0.8)  # its race's median, not its probe's
    by_config = {e.config: e for e in plan.entries}
    # B: 1.25x slower than C (their race); A: 1.25x slower than B (theirs).
    assert by_config[B].source == "raced" and by_config[B].samples_per_s == pytest.approx(GLOBAL / 1.0)
    assert by_config[A].source == "raced" and by_config[A].samples_per_s == pytest.approx(GLOBAL / 1.25)
    assert by_config[D].source == "raced" and by_config[D].samples_per_s == pytest.approx(GLOBAL / 1.0)
    assert [e.config for e in plan.entries] == [C, B, D, A]  # B before D at equal figures: fewer micro-batches
    assert_one_basis(plan)
    table = plan.table()
    assert "raced: #1's figure times the speed ratio its races measured" in table
    assert "measured: #1's own measured step (median of 3 steps raced step against step in one process)" in table


def test_unmeasured_rows_are_scaled_to_the_measured_best_and_rank_below_it():
    # The measured best runs at 10/s where the time model says 20/s: the unmeasured row the
    # model puts at 18/s shows 9/s (0.9 of the best, as the model has it), below the best.
    best = PlanEntry(config=A, predicted=estimate(A, 20.0), measured=estimate(A, 10.0, method="measured"),
                     probe_status="ok", basis="measured")
    other = PlanEntry(config=B, predicted=estimate(B, 18.0))
    ranked = rank_measured(FakeEstimator({}), [best], [], [other], None)
    plan = plan_of(ranked)
    assert [e.config for e in plan.entries] == [A, B]
    assert plan.entries[1].source == "predicted" and plan.entries[1].samples_per_s == pytest.approx(9.0)
    assert_one_basis(plan)
    assert "scaled so that #1's prediction is its measured figure" in plan.table()
    # Predicted under 1% above the measured best: a tie, shown equal and below it.
    close = PlanEntry(config=B, predicted=estimate(B, 20.1))
    plan = plan_of(rank_measured(FakeEstimator({}), [best], [], [close], None))
    assert [e.config for e in plan.entries] == [A, B] and plan.entries[1].samples_per_s == pytest.approx(10.0)
    assert "shown tied" in plan.entries[1].predicted.notes[-1]
    assert_one_basis(plan)


def test_probes_in_their_own_processes_share_one_basis_and_a_kept_order_agrees_with_its_figures():
    # No race: three probes, each in its own process. B's probe (15/s) put it ahead of the
    # predicted best A (12/s) by less than the probes' noise, so the predicted order is kept:
    # B's figure is then A's times the prediction's ratio, not its faster probe.
    probed = [PlanEntry(config=c, predicted=estimate(c, p), measured=estimate(c, m, method="measured"),
                        probe_status="ok") for c, p, m in ((A, 20.0, 12.0), (B, 19.0, 15.0), (C, 10.0, 8.0))]
    ranked = rank_measured(FakeEstimator({}), probed, [], [], (A, B))
    plan = plan_of(ranked)
    assert [e.config for e in plan.entries] == [A, B, C]
    assert plan.entries[1].samples_per_s == pytest.approx(12.0 * 19 / 20) and plan.entries[1].source == "predicted"
    assert [plan.entries[0].source, plan.entries[2].source] == ["probed", "probed"]
    assert_one_basis(plan)
    assert "probed: a probe of a few steps in its own process" in plan.table()


def test_an_unmeasured_row_the_refit_puts_above_the_measured_best_is_raced_first():
    # A beats B in the race; the time model, refitted by it, then puts C (unmeasured) above A:
    # C races A before the plan believes it, loses, and shows the race's figure below A.
    entries = [PlanEntry(config=c, predicted=estimate(c, s)) for c, s in ((A, 20.0), (B, 19.0), (C, 18.0))]
    races: list = []
    calls: list[TrainConfig] = []
    ranked, notes = probe_best(
        None, FakeEstimator({C: 30.0}), entries, 2, 10**9, memory_probe(calls),
        races_answering(races, [((0.4, 0.4, 0.4), (0.5, 0.5, 0.5)), ((0.4, 0.4, 0.4), (0.45, 0.45, 0.45))]), {})
    assert races == [(A, B), (A, C)] and calls == [A]
    plan = plan_of(ranked)
    assert [e.config for e in plan.entries] == [A, C, B]
    assert [e.source for e in plan.entries] == ["measured", "raced", "raced"]
    assert plan.entries[1].samples_per_s == pytest.approx(GLOBAL / 0.45)
    assert any("put micro-batch 2" in n and "above the measured best" in n for n in notes)
    assert_one_basis(plan)


def test_the_basis_survives_the_plan_file(tmp_path):
    best = PlanEntry(config=A, predicted=estimate(A, 20.0), measured=estimate(A, 10.0, method="measured"),
                     probe_status="ok", basis="measured")
    plan = plan_of(rank_measured(FakeEstimator({}), [best], [], [PlanEntry(config=B, predicted=estimate(B, 18.0))],
                                 None))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert [e.source for e in loaded.entries] == ["measured", "predicted"]
    assert loaded.table() == plan.table()
