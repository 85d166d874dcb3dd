"""Tests for benchmarks/mechanisms.py: issue 20's mechanism figures, on synthetic runs with known answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mechanisms  # noqa: E402
from runs import Run, Spec, time_to_target  # noqa: E402


def _run(step_ms: list[float], decisions: list[tuple[int, float, float]] | None = None,
         change_at_s: float | None = None, density: list[float] | None = None, loading_ms: float = 0.0) -> Run:
    """A run whose steps take ``step_ms`` after ``loading_ms`` of data loading each; ``decisions``: (step, chosen
    density, its predicted ms)."""
    records, wall = [], 0.0
    for step, ms in enumerate(step_ms):
        wall += (ms + loading_ms) / 1e3
        records.append({"step": step, "t_step": ms / 1e3, "train_wall": wall, "wall": wall,
                        "density": density[step] if density else 1.0})
    changes = [{"time_s": 0.0, "rate_bps": 1e9}] + ([{"time_s": change_at_s, "rate_bps": 1e8}] if change_at_s else [])
    summary = {"density_decisions": [
        {"step": s, "density": d, "candidates": [{"density": d, "gain": 1.0, "seconds": ms / 1e3}]}
        for s, d, ms in decisions or []]}
    return Run(Spec("mlp", "flex"), summary, records, {"changes": changes}, None, None)


def test_switches_right_after_a_link_change_are_counted_apart() -> None:
    # 100 steps of 10 ms; the link changes during step 49 (at 0.5 s).  Switches at steps 20, 50
    # (right after the change) and 80.
    run = _run([10.0] * 100, [(1, 1.0, 10), (20, 0.1, 10), (50, 1.0, 10), (80, 0.1, 10)], change_at_s=0.495)
    assert mechanisms.change_steps(run) == [49]
    assert mechanisms.density_switches(run, settle=20) == (3.0, 2.0)
    assert mechanisms.density_switches(_run([10.0] * 10), settle=20) is None  # no controller


def test_plan_changes_count_the_step_record_s_density() -> None:
    run = _run([10.0] * 4, density=[1.0, 0.41, 0.41, 1.0])
    assert mechanisms.plan_changes_per_100(run) == 50.0


def test_slow_intervals_count_windows_until_one_is_within_the_factor_of_the_best_static() -> None:
    # Phase 2 starts at step 10; the static's median there is 20 ms, so 30 ms is the limit.
    static = _run([10.0] * 10 + [20.0] * 40, change_at_s=0.1)
    adaptive = _run([10.0] * 10 + [100.0] * 10 + [40.0] * 10 + [25.0] * 10, change_at_s=0.1)
    assert mechanisms.change_steps(adaptive) == [10]
    assert mechanisms.slow_intervals_after_changes(adaptive, [static], interval=10) == [2]
    assert mechanisms.slow_intervals_after_changes(static, [static], interval=10) == [0]


def test_prediction_errors_compare_each_choice_with_the_median_step_until_the_next_decision() -> None:
    run = _run([10.0] * 10 + [30.0] * 10, [(0, 1.0, 12.0), (10, 0.1, 15.0)])
    errors = mechanisms.prediction_errors(run)
    assert errors[1.0] == [pytest.approx(0.2)]
    assert errors[0.1] == [pytest.approx(-0.5)]


def test_prediction_errors_compare_with_the_period_the_controller_predicts_not_t_step() -> None:
    # The controller predicts a step's whole period, data loading included (t_step leaves it out).
    run = _run([10.0] * 20, [(1, 1.0, 12.0)], loading_ms=2.0)
    assert mechanisms.prediction_errors(run)[1.0] == [pytest.approx(0.0, abs=1e-9)]


def test_time_to_target_on_the_mean_of_the_last_evaluations_ignores_one_lucky_evaluation() -> None:
    run = _run([10.0] * 12)
    for record, accuracy in zip(run.records[1::2], [0.5, 0.9, 0.6, 0.8, 0.85, 0.9]):
        record["accuracy"] = accuracy
    assert time_to_target(run, 0.8) == (pytest.approx(0.04), pytest.approx(0.04), 4)  # the spike at step 3
    assert time_to_target(run, 0.8, window=3) == (pytest.approx(0.12), pytest.approx(0.12), 12)  # (0.8+0.85+0.9)/3
    assert time_to_target(run, 0.95, window=3) == (None, None, None)
