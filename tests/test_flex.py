"""The ``flex`` exchange: the plan that makes the step fastest, measured and explored, the same on every rank."""

from __future__ import annotations

import importlib
import math
import time

import pytest
import torch
import torch.distributed as dist

import flexcomm

from flexcomm.comm import allreduce_floats, probe_collectives
from flexcomm.control import guard, step_log
from flexcomm.control.exchange import ExchangeChooser, StepSample
from flexcomm.control.step_model import BucketCosts, best_plan, simulate_step
from flexcomm.cost import (GLOO_ALGORITHMS, KINDS, CostEstimator, CostParams, LinkParams, Observation, link_bound,
                           predict_exchange_times, probe_size)
from multiproc import run_world
from test_hook_distributed import M, exchange, gradient, hooked_model

GBIT = 8 / 1e9


def bucket(block: dict[str, float], comm: dict[str, float], gap: float) -> BucketCosts:
    """A bucket's costs; exchanges not named in ``comm`` are unusable (infinite)."""
    return BucketCosts({"dense": 0.0, "dense16": 0.0, "lowrank": 0.0, **block}, {"dense16": math.inf, "lowrank": math.inf, **comm}, gap)


def test_simulation_hides_early_collectives_behind_backward() -> None:
    # Two buckets, 50 ms of backward after the first: its 40 ms allreduce is hidden, the
    # second bucket's 40 ms is exposed.  Hand-computed: t = 0 -> 50 -> 50; free = 40 -> 90.
    costs = [bucket({}, {"dense": 0.04}, 0.05), bucket({}, {"dense": 0.04}, 0.0)]
    assert simulate_step(costs, ["dense", "dense"]) == pytest.approx(0.09)


def test_simulation_queues_collectives_one_after_another() -> None:
    # No backward between the buckets: the second allreduce waits for the first.
    costs = [bucket({}, {"dense": 0.04}, 0.0), bucket({}, {"dense": 0.03}, 0.0)]
    assert simulate_step(costs, ["dense", "dense"]) == pytest.approx(0.07)


def test_selection_blocks_the_step_in_full() -> None:
    # A 30 ms selection on the autograd thread delays everything after it.
    costs = [bucket({"agtopk": 0.03}, {"dense": 0.04, "agtopk": 0.001}, 0.05), bucket({}, {"dense": 0.0}, 0.0)]
    assert simulate_step(costs, ["agtopk", "dense"]) == pytest.approx(0.03 + 0.05)
    assert simulate_step(costs, ["dense", "dense"]) == pytest.approx(0.05)


def test_fast_link_plan_is_dense_where_allreduces_hide() -> None:
    # Loopback-like: 25 ms allreduce per bucket, 60 ms backward between buckets, 30 ms
    # selection: dense costs only the last bucket's allreduce; sparse costs 4 selections.
    costs = [bucket({"artopk": 0.03, "agtopk": 0.03}, {"dense": 0.025, "artopk": 0.001, "agtopk": 0.001}, gap)
             for gap in (0.06, 0.06, 0.06, 0.0)]
    plan = best_plan(costs, ["artopk"] * 4, hysteresis=0.0)
    assert plan[:3] == ["dense"] * 3
    # The last bucket: a 25 ms exposed allreduce vs a 30 ms selection plus 1 ms: dense too.
    assert plan[3] == "dense"


def test_slow_link_plan_is_sparse() -> None:
    costs = [bucket({"artopk": 0.03, "agtopk": 0.04}, {"dense": 2.0, "artopk": 0.02, "agtopk": 0.03}, 0.06)
             for _ in range(4)]
    assert best_plan(costs, ["dense"] * 4, hysteresis=0.05) == ["artopk"] * 4


def chooser_at(rate_bps: float, order: list[int], numel: int = 1_000_000, alpha: float = 1e-4,
               dense16: bool = True) -> ExchangeChooser:
    """A chooser whose model believes a link of ``rate_bps``, knowing buckets ``order`` of ``numel`` floats."""
    prior = CostParams.uniform(LinkParams.from_bandwidth(alpha, rate_bps))
    chooser = ExchangeChooser(CostEstimator(prior=prior), explore_every=10, dense16=dense16)
    chooser.sizes = {b: (numel, 4) for b in order}
    return chooser


def test_measurements_calibrate_the_model() -> None:
    # The model says the dense allreduce takes T; it really takes 3T: after a few agreed
    # samples the prediction follows the measurement.
    model = chooser_at(1e9, [0])
    modelled = model.predicted(0, "dense", 0.01, 2)
    for step in range(10):
        model.observe(step, [StepSample(0, "dense", 0.01, 0.0, 3 * modelled, 0.0)], 2)
    assert model.predicted(0, "dense", 0.01, 2) == pytest.approx(3 * modelled, rel=0.05)


def test_predictions_follow_every_change_of_their_inputs() -> None:
    # The chooser keeps a bucket's costs until an input changes: a new size, a low-rank payload,
    # another chooser's state loaded must each be seen by the next prediction.
    model = chooser_at(1e8, [0], numel=1_000_000)
    small = model.predicted(0, "dense", 1.0, 2)
    assert model.predicted(0, "lowrank", 1.0, 2) == math.inf
    model.note_sizes(0, 4_000_000, 4, (1000, 1000))
    assert model.predicted(0, "dense", 1.0, 2) > 3 * small
    assert math.isfinite(model.predicted(0, "lowrank", 1.0, 2))
    other = chooser_at(1e8, [0], numel=1_000_000)
    other.observe(0, [StepSample(0, "dense", 1.0, 0.0, 5 * small, 0.0)], 2)
    model.load_state_dict(other.state_dict())
    assert model.predicted(0, "dense", 1.0, 2) == pytest.approx(other.predicted(0, "dense", 1.0, 2)) == pytest.approx(5 * small)
    model.forget({0})
    model.note_sizes(0, 1_000_000, 4, None)
    assert model.predicted(0, "dense", 1.0, 2) == pytest.approx(small)


def test_a_refit_keeps_the_calibrated_prediction_of_measured_pairs() -> None:
    # Dense measured 0.22 s; then the estimator's fit moves (samples of other sizes and
    # exchanges): the prediction of that measured pair must stay 0.22 s, while the
    # unmeasured density follows the model's new shape relative to it.
    model = chooser_at(1e9, [0], numel=6_250_000)
    model.observe(0, [StepSample(0, "artopk", 0.01, 0.0, 0.03, 0.0)], 2)
    assert model.predicted(0, "artopk", 0.01, 2) == pytest.approx(0.03)
    for _ in range(50):  # small allreduces far slower than the prior believes: alpha grows
        model.estimator.observe("allreduce", 1 << 10, 2, 0.02)
        model.estimator.observe("broadcast", 1 << 10, 2, 0.02)
    unrebased = 0.03 * predict_exchange_times(6_250_000, 0.01, 2, model.estimator.params)["artopk"] / \
        predict_exchange_times(6_250_000, 0.01, 2, model.params)["artopk"]
    model.refresh()
    assert unrebased > 0.1  # without the rebase the refit would have moved it far off
    assert model.predicted(0, "artopk", 0.01, 2) == pytest.approx(0.03)
    ratio = predict_exchange_times(6_250_000, 0.1, 2, model.params)["artopk"] / \
        predict_exchange_times(6_250_000, 0.01, 2, model.params)["artopk"]
    assert model.predicted(0, "artopk", 0.1, 2) == pytest.approx(0.03 * ratio)


def test_after_a_link_change_the_exchanges_not_in_use_follow_the_model() -> None:
    # Dense was measured once on a 1 Gbit link; flex then ran AR-Topk for many refits.  The
    # link drops to 20 Mbit: the allreduce fit follows it, and dense's prediction must follow
    # the fit (seconds), not stay at its old 1 Gbit measurement (tens of ms).
    model = chooser_at(1e9, [0], numel=2_000_000)
    at_1gbit = model.predicted(0, "dense", 0.1, 2)
    model.observe(0, [StepSample(0, "dense", 0.1, 0.0, at_1gbit, 0.0)], 2)
    model.refresh()
    for step in range(1, 40):
        model.observe(step, [StepSample(0, "artopk", 0.1, 0.005, model.predicted(0, "artopk", 0.1, 2), 0.0)], 2)
        if step % 10 == 0:
            model.refresh()
    assert model.predicted(0, "dense", 0.1, 2) == pytest.approx(at_1gbit, rel=0.01)
    for size in (1 << 16, 1 << 20, 1 << 23):  # the link at 20 Mbit/s
        for _ in range(20):
            model.estimator.observe("allreduce", size, 2, 1e-4 + 2 * size * 8 / 20e6)
    model.refresh()
    assert model.predicted(0, "dense", 0.1, 2) > 20 * at_1gbit


def _stale_dense_then_optimistic_refit() -> ExchangeChooser:
    """Dense measured 0.3 s at step 0, AG-Topk 0.08 s, then AR-Topk 0.05 s for two intervals; then the allreduce fit
    turns optimistic (fast small messages, as when one size dominates the samples): dense rated ~20x faster."""
    model = chooser_at(1e8, [0], dense16=False)
    model.observe(0, [StepSample(0, "dense", 0.01, 0.0, 0.3, 0.0)], 2)
    model.observe(1, [StepSample(0, "agtopk", 0.01, 0.0, 0.08, 0.0)], 2)
    model.refresh()
    for step in range(2, 21):
        model.observe(step, [StepSample(0, "artopk", 0.01, 0.0, 0.05, 0.0)], 2)
        if step % 10 == 0:
            model.refresh()
    model.replan(0.01, 2)
    assert model.plan == {0: "artopk"}
    for _ in range(60):
        model.estimator.observe("allreduce", 1 << 16, 2, 1e-4)
        model.estimator.observe("allreduce", 1 << 20, 2, 5e-4)
    model.observe(21, [StepSample(0, "artopk", 0.01, 0.0, 0.05, 0.0)], 2)
    model.refresh()
    assert model.predicted(0, "dense", 0.01, 2) < 0.05 / 2  # the refit rates dense far under AR-Topk's 0.05 s
    return model


def test_a_pair_the_refit_rates_far_faster_than_measured_is_tried_before_a_plan_takes_it() -> None:
    # Seen on an emulated 100 Mbit link: the fit dropped to beta = 0, dense was rated 2 ms where it
    # had measured 200, and the plan ran whole intervals of dense steps.  Now the plan keeps AR-Topk,
    # the bucket's next exploration tries dense once, and that measurement decides.
    model = _stale_dense_then_optimistic_refit()
    model.replan(0.01, 2)
    assert model.plan == {0: "artopk"}
    assert [model.choose(0, step, 0.01, 2) for step in (30, 31, 39)] == ["dense", "artopk", "artopk"]
    model.observe(30, [StepSample(0, "dense", 0.01, 0.0, 0.3, 0.0)], 2)  # still slow: not taken
    model.refresh()
    model.replan(0.01, 2)
    assert model.plan == {0: "artopk"}


def test_a_pair_tried_and_measured_fast_is_taken() -> None:
    # The link did get faster: the trial measures dense at 10 ms and the next plan takes it.
    model = _stale_dense_then_optimistic_refit()
    model.replan(0.01, 2)
    model.observe(30, [StepSample(0, "dense", 0.01, 0.0, 0.01, 0.0)], 2)
    model.refresh()
    model.replan(0.01, 2)
    assert model.plan == {0: "dense"}


def explorations(model: ExchangeChooser, steps: range, density: float = 0.01, confirm: bool = True,
                 restore_at: int | None = None) -> list[int]:
    """Run ``steps`` with an agreement point every 10, where (``confirm``) the explorations of the interval before
    come in measured as the model predicted them; return the steps where a bucket left the plan.
    ``restore_at``: before that step, go on with a new chooser loaded from the model's state_dict (a resume)."""
    found: dict[int, tuple[int, str]] = {}
    for step in steps:
        if step == restore_at:
            restored = ExchangeChooser(explore_every=model.explore_every)
            restored.load_state_dict(model.state_dict())
            model = restored
        if step % 10 == 0 and step > steps.start:
            for explored, (bucket, exchange) in found.items():
                if confirm and explored >= step - 10:
                    modelled = model.predicted(bucket, exchange, density, 2)
                    model.observe(explored, [StepSample(bucket, exchange, density, 0.0, modelled, 0.0)], 2)
            model.replan(density, 2)
        plan = dict(model.plan)
        left = [(b, e) for b in model.order if (e := model.choose(b, step, density, 2)) != plan[b]]
        if left:
            found[step] = left[0]
    return sorted(found)


def test_explorations_back_off_while_they_confirm_the_plan_and_resume_when_it_changes() -> None:
    model = chooser_at(1e7, [0, 1])  # AG-Topk and AR-Topk within the margin of each other
    model.replan(0.01, 2)
    # Each replan after an exploration's samples came in and left the plan doubles the interval, up to 4x.
    assert explorations(model, range(0, 200)) == [0, 20, 40, 80, 120, 160]
    # Whole all-dense steps measured faster: the guard changes the plan, and explorations are due every 10 steps.
    # Explorations whose samples never came in back nothing off.
    unseen = chooser_at(1e7, [0, 1])
    unseen.replan(0.01, 2)
    assert explorations(unseen, range(0, 40), confirm=False) == [0, 10, 20, 30]
    model.observe_steps(200, dense=0.01, other=0.5)
    model.guard_every = 0
    model.replan(0.01, 2)  # the agreement point at step 200
    assert model.plan == {0: "dense16", 1: "dense16"}
    assert explorations(model, range(200, 240)) == [200, 220]


@pytest.mark.parametrize("restore_at", [35, 45, 85])
def test_a_resumed_chooser_explores_when_the_uninterrupted_one_does(restore_at: int) -> None:
    # Resumed mid back-off (interval 20 or 40, an exploration's samples still to come in at 45 and 85):
    # the explorations fall on the same steps as in the run that was never interrupted.
    uninterrupted, resumed = chooser_at(1e7, [0, 1]), chooser_at(1e7, [0, 1])
    for model in (uninterrupted, resumed):
        model.replan(0.01, 2)
    expected = explorations(uninterrupted, range(0, 200))
    assert expected == [0, 20, 40, 80, 120, 160]
    assert explorations(resumed, range(0, 200), restore_at=restore_at) == expected


def test_a_new_density_resets_the_exploration_back_off() -> None:
    model = chooser_at(1e7, [0, 1])  # slow: sparse plans at both densities
    model.replan(0.01, 2)
    assert explorations(model, range(0, 100)) == [0, 20, 40, 80]
    plan = dict(model.plan)
    model.replan(0.033, 2)  # the controller moved the density
    assert model.plan == plan  # the same exchange names, measured at another density
    assert explorations(model, range(100, 140), density=0.033)[:1] == [100]


def test_unmeasured_bucket_borrows_the_selection_rate_of_measured_ones() -> None:
    model = chooser_at(1e9, [0, 1])
    model.note_sizes(1, 2_000_000, 4, None)
    model.observe(0, [StepSample(0, "agtopk", 0.01, 0.01, 0.001, 0.0)], 2)
    assert model.costs(1, 0.01, 2).block["artopk"] == pytest.approx(0.02)


def test_exploration_is_scheduled_by_the_step_counter_and_bounded_by_the_margin() -> None:
    model = chooser_at(20e9, [0, 1])  # fast: every exchange is within the margin
    model.guard_every = 0  # no guard trials (all-dense16 steps) in between
    model.plan = {0: "dense", 1: "dense"}
    explored = {step: [model.choose(b, step, 0.01, 2) for b in (0, 1)] for step in range(0, 40)}
    changed = {step: c for step, c in explored.items() if c != ["dense", "dense"]}
    assert sorted(changed) == [0, 10, 20, 30]  # every explore_every steps, never in between
    assert changed[0][1] == "dense" and changed[10][0] == "dense"  # one bucket at a time, alternating
    slow = chooser_at(1e7, [0, 1])
    slow.plan = {0: "artopk", 1: "artopk"}
    # 10 Mbit/s: dense would be ~100x the step (dense16 ~50x); neither is ever tried.
    assert all(slow.choose(b, step, 0.01, 2) in ("artopk", "agtopk") for step in range(40) for b in (0, 1))


def test_replan_and_state_round_trip_are_deterministic() -> None:
    first, second = chooser_at(1e8, [3, 1, 0]), chooser_at(1e8, [3, 1, 0])
    for model in (first, second):
        model.estimator.observe("allreduce", 1 << 20, 2, 0.09)
        model.refresh()
        model.observe(0, [StepSample(b, "dense", 0.01, 0.0, 0.05 * (b + 1), 0.02) for b in (3, 1, 0)], 2)
        model.replan(0.01, 2)
    assert first.plan == second.plan
    restored = ExchangeChooser()
    restored.load_state_dict(first.state_dict())
    assert restored.state_dict() == first.state_dict()
    assert restored.step_seconds(0.01, 2, None) == first.step_seconds(0.01, 2, None)


def test_a_plan_measured_slower_gives_way_to_one_measured_faster() -> None:
    # The model proposes a sparse plan P and rates all-dense Q ~10x slower (100 Mbit/s in its eyes);
    # P's steps measured 50 ms where Q's measured 30 ms at the same density: Q runs.  A resumed
    # chooser decides alike; a link change forgets what was measured.
    model = chooser_at(1e8, [0, 1])
    model.replan(0.01, 2)
    proposed = dict(model.plan)
    other = dict.fromkeys(proposed, "dense")
    costs = model.step_costs(0.01, 2)
    assert set(proposed.values()) <= {"agtopk", "artopk"}
    assert simulate_step(costs, list(other.values())) > 5 * simulate_step(costs, list(proposed.values()))
    model.plan = dict(other)
    model.observe_steps(10, None, 0.03)
    model.plan = dict(proposed)
    model.observe_steps(20, None, 0.05)
    model.forget(set())  # the planner's every step: no bucket gone, nothing forgotten
    copy = chooser_at(1e8, [0, 1])
    copy.load_state_dict(model.state_dict())
    model.replan(0.01, 2)
    copy.replan(0.01, 2)
    assert model.plan == copy.plan == other
    model.observe_steps(30, None, 0.031, link_changed=True)
    assert model.measured_plans == {}


def test_plan_periods_average_jump_and_expire() -> None:
    periods = guard.remember_plan({}, 10, 0.01, ("agtopk",), 0.030, smoothing=0.5)
    periods = guard.remember_plan(periods, 20, 0.01, ("agtopk",), 0.034, smoothing=0.5)
    assert periods[(0.01, ("agtopk",))] == (pytest.approx(0.032), 20)
    periods = guard.remember_plan(periods, 30, 0.01, ("agtopk",), 0.2, smoothing=0.5)  # a jump: replaced
    assert periods[(0.01, ("agtopk",))] == (0.2, 30)
    periods = guard.remember_plan(periods, 30 + guard.PLAN_MEMORY + 1, 1.0, ("dense16",), 0.02, smoothing=0.5)
    assert list(periods) == [(1.0, ("dense16",))]
    both = {(1.0, ("dense16",)): (0.020, 0), (1.0, ("lowrank",)): (0.017, 0)}
    # Measured faster in seconds, but its steps factor makes it slower to accuracy: the proposal stays.
    assert guard.measured_choice(both, 0, 1.0, ("dense16",), lambda p: 1.25 if p == ("lowrank",) else 1.0, 0.05) \
        == ("dense16",)
    assert guard.measured_choice(both, 0, 1.0, ("dense16",), lambda p: 1.0, 0.05) == ("lowrank",)
    assert guard.measured_choice(both, 0, 1.0, ("dense16",), lambda p: math.inf if p == ("lowrank",) else 1.0,
                                 0.05) == ("dense16",)  # no longer usable
    assert guard.measured_choice(both, 0, 1.0, ("agtopk",), lambda p: 1.0, 0.05) == ("agtopk",)  # unmeasured
    stale = guard.PLAN_MEMORY + 1
    assert guard.measured_choice(both, stale, 1.0, ("dense16",), lambda p: 1.0, 0.05) == ("dense16",)  # too old


@pytest.mark.parametrize("dense16, arm", [(True, "dense16"), (False, "dense")])
def test_guard_goes_all_dense_when_dense_steps_measure_faster(dense16: bool, arm: str) -> None:
    # The model prefers AG-Topk (a slow link in its eyes), but whole all-dense steps measured
    # faster than the plan's: the plan becomes all-dense (dense16 where flex may send it, as
    # PyTorch's fp16 hook does); the guard's trials (3 steps every guard_every steps) then run
    # the simulated plan, so the comparison stays fresh.
    model = chooser_at(1e8, [0, 1], dense16=dense16)
    model.guard_every = 10
    model.replan(0.01, 2)
    simulated = dict(model.plan)
    assert model.guard_exchange == arm and arm not in simulated.values()
    model.observe_steps(10, dense=0.5, other=0.8)
    model.replan(0.01, 2)
    assert model.plan == {0: arm, 1: arm}
    assert [model.choose(0, step, 0.01, 2) for step in (10, 11, 12, 13)] == [simulated[0]] * 3 + [arm]
    model.observe_steps(20, dense=None, other=0.2)  # the sparse plan got 4x faster: taken whole (0.8 -> 0.2)
    model.observe_steps(30, dense=None, other=0.1)
    model.replan(0.01, 2)
    assert model.plan == simulated


def _guard_trials(model: ExchangeChooser, steps: range, restore_at: int | None = None) -> list[int]:
    """Steps in ``steps`` where bucket 0 ran a guard trial; at every agreement point (step % 10 == 0) the all-dense
    arm's steps measured 0.5 s and, where a trial ran in the interval, the plan's 0.8 s."""
    trials: list[int] = []
    for step in steps:
        if step == restore_at:
            restored = chooser_at(1e8, [0, 1])
            restored.load_state_dict(model.state_dict())
            restored.guard_every, restored.explore_every = model.guard_every, model.explore_every
            model = restored
        if step % 10 == 0 and step > steps.start:
            model.observe_steps(step, dense=0.5, other=0.8 if any(t >= step - 10 for t in trials) else None)
            model.replan(0.01, 2)
        if model.choose(0, step, 0.01, 2) != model.plan[0]:
            trials.append(step)
    return trials


@pytest.mark.parametrize("restore_at", [None, 25, 45])
def test_guard_trials_back_off_while_they_confirm_the_side_that_runs(restore_at: int | None) -> None:
    # On loopback flex at density 1.0 ran 3 all-dense16 trial steps every 25 the whole run long, each
    # confirming the fp32 plan.  Each agreement point after a trial's period came in and left the same
    # side running doubles the interval, up to 4x; a resumed run tries on the same steps.
    model = chooser_at(1e8, [0, 1])
    model.guard_every, model.explore_every = 10, 0
    model.replan(0.01, 2)
    model.observe_steps(10, dense=0.5, other=0.8)
    model.replan(0.01, 2)
    assert model.plan == {0: "dense16", 1: "dense16"}
    assert _guard_trials(model, range(10, 200), restore_at) == [10, 11, 12, 20, 21, 22, 40, 41, 42, 80, 81, 82,
                                                                 120, 121, 122, 160, 161, 162]


def test_guard_trials_resume_their_full_rate_when_the_side_or_the_link_changes() -> None:
    model = chooser_at(1e8, [0, 1])
    model.guard_every, model.explore_every = 10, 0
    model.replan(0.01, 2)
    simulated = dict(model.plan)
    model.observe_steps(10, dense=0.5, other=0.8)
    model.replan(0.01, 2)
    _guard_trials(model, range(10, 60))
    assert model.state_dict()["guard_scale"] == 4
    for step in (60, 70, 80):  # the plan's trials now measure 0.3 s: it overtakes the arm's 0.5 s
        model.observe_steps(step, dense=None, other=0.3)
        model.replan(0.01, 2)
    assert model.plan == simulated
    assert model.state_dict()["guard_scale"] == 1
    model.observe_steps(90, dense=0.5, other=0.3)
    model.replan(0.01, 2)
    assert model.state_dict()["guard_scale"] == 2
    model.observe_steps(100, dense=5.0, other=3.0)  # a drop: both periods jumped
    model.replan(0.01, 2)
    assert model.state_dict()["guard_scale"] == 1


def test_a_mixed_dense_plan_gives_way_to_all_dense16_steps_that_measured_faster() -> None:
    # MLP group, seed 3, at 809c9e4: at density 1.0 one bucket stayed on fp32 dense (the simulation
    # let its allreduce hide behind backward) and the steps took 20 ms against 16 ms all-dense16,
    # for 50 steps; the guard's trials ran fp32 on both buckets (27-32 ms) and never tried dense16.
    model = chooser_at(1e9, [0, 1])
    # Bucket 0 is followed by 50 ms of backward (its 32 ms fp32 allreduce hides) and its casts cost
    # 5 ms; bucket 1 is the last (exposed) and casts in 0.5 ms.
    for bucket, cast, gap in ((0, 0.005, 0.05), (1, 0.0005, 0.0)):
        comm = model.costs(bucket, 1.0, 2).comm
        model.observe(0, [StepSample(bucket, "dense16", 1.0, cast, comm["dense16"], gap),
                          StepSample(bucket, "dense", 1.0, 0.0, comm["dense"], gap)], 2)
    model.replan(1.0, 2)
    assert model.plan == {0: "dense", 1: "dense16"}  # what the simulation says
    assert [model.choose(b, step, 1.0, 2) for step in (25, 26, 27, 28) for b in (0, 1)] == ["dense16"] * 6 + ["dense", "dense16"]
    model.observe_steps(30, dense=0.016, other=0.020)
    model.replan(1.0, 2)
    assert model.plan == {0: "dense16", 1: "dense16"}  # what the steps measured


def test_guard_forgets_a_dense_period_measured_before_the_link_changed() -> None:
    # All-dense steps measured 80 ms on a fast link; the link drops and the sparse plan's
    # steps jump from 25 ms to 1 s.  The old dense period must not make the plan all-dense
    # (dense would now take seconds): the guard waits until dense is measured again.
    model = chooser_at(1e7, [0, 1])
    model.replan(0.01, 2)
    simulated = dict(model.plan)
    assert set(simulated.values()) != {"dense"}
    model.observe_steps(10, dense=0.08, other=0.025)
    model.observe_steps(20, dense=None, other=1.0)
    model.replan(0.01, 2)
    assert model.plan == simulated
    assert "dense" not in model.measured_steps


def _guard_across_a_drop(density: float, dense: float, other: float) -> tuple[ExchangeChooser, dict[int, str]]:
    """A chooser whose guard measured 17 / 18 ms at step 10 and ``dense`` / ``other`` at step 20, replanned;
    and the plan the simulation makes."""
    model = chooser_at(1e8, [0, 1])
    model.replan(density, 2)
    simulated = dict(model.plan)
    model.observe_steps(10, dense=0.017, other=0.018)
    model.observe_steps(20, dense=dense, other=other)
    model.replan(density, 2)
    return model, simulated


def test_guard_forgets_a_plan_period_measured_in_the_interval_where_dense_jumped() -> None:
    # MLP group, seed 5, at 639773f: the interval's one plan step (18 ms) ran just before the link
    # dropped, its all-dense16 steps after it (117 ms).  That 18 ms must not keep the plan all-dense:
    # the guard compares again once both are measured on the new link.
    model, simulated = _guard_across_a_drop(0.01, dense=0.117, other=0.018)
    assert model.plan == simulated
    assert model.measured_steps == {}
    model.observe_steps(30, dense=None, other=0.025)  # the plan, measured on the new link
    model.replan(0.01, 2)
    assert model.plan == simulated
    assert model.measured_steps == {"other": (0.025, 30)}


def test_guard_forgets_both_periods_when_both_jumped() -> None:
    # MLP group, seed 4, at 9bd6434: in the interval of a drop the plan's median read 189 ms (the
    # transition's steps) against all-dense16's 121 ms, and the guard held all-dense16 for 20 steps
    # and more where the low-rank plan took 20-25 ms.
    model, simulated = _guard_across_a_drop(1.0, dense=0.121, other=0.189)
    assert model.measured_steps == {}
    assert model.plan == simulated


def test_guard_tries_dense_only_when_the_model_rates_it_close_to_the_plan() -> None:
    # Dense rated ~2.5x the sparse plan: the guard's trials (steps 0-2 mod guard_every) keep
    # the plan.  After a drop the model can rate dense far too fast (a 3-step trial of dense
    # at 20 Mbit/s took 12 s), and what the guard corrects is tens of percent, not 2.5x.
    model = chooser_at(1e9, [0, 1])
    model.replan(0.1, 2)
    costs = model.step_costs(0.1, 2)
    plan = [model.plan[b] for b in model.order]
    assert "dense16" not in plan
    assert 1.5 < simulate_step(costs, ["dense16", "dense16"]) / simulate_step(costs, plan) < 5.0
    assert [model.choose(b, step, 0.1, 2) for step in (25, 26, 27) for b in (0, 1)] == plan * 3


def test_guard_rates_dense_on_whole_steps_where_the_plan_s_period_was_measured() -> None:
    # The simulation rates all-dense ~2.5x the plan (exchanges and backward only).  Measured, the plan's
    # whole steps take 0.2 s more than simulated (forward, optimizer, CPU shared): whole steps of dense would
    # be well within GUARD_MARGIN of the plan's, so the guard tries it (MLP group, seed 3 at 57c572a: never
    # tried, a low-rank plan ran 116 steps at all-dense16's period).  Measured as simulated: still not tried.
    model = chooser_at(1e9, [0, 1])
    model.replan(0.1, 2)
    costs = model.step_costs(0.1, 2)
    plan = [model.plan[b] for b in model.order]
    simulated = simulate_step(costs, plan)
    model.observe_steps(20, dense=None, other=simulated + 0.2)
    assert [model.choose(b, step, 0.1, 2) for step in (25, 26, 27) for b in (0, 1)] == ["dense16"] * 6
    model.observe_steps(30, dense=None, other=0.1 * simulated)  # a jump: the periods start over
    model.observe_steps(40, dense=None, other=simulated)
    assert [model.choose(b, step, 0.1, 2) for step in (75, 76, 77) for b in (0, 1)] == plan * 3


def test_single_bucket_choices_follow_the_link() -> None:
    # 25M floats at density 0.01 with a 50 ms selection: 100 Gbit/s keeps dense; 100 Mbit/s on
    # 64 ranks picks AR-Topk (the allgather moves 63 x 2 MB); 5 ms latency with k = 10 on 8
    # ranks picks AG-Topk (N-1 latency terms vs a broadcast plus a ring allreduce).
    fast = chooser_at(100e9, [0], numel=25_000_000, alpha=1e-5)
    fast.observe(0, [StepSample(0, "artopk", 0.01, 0.05, 0.0, 0.0), StepSample(0, "agtopk", 0.01, 0.05, 0.0, 0.0)], 4)
    assert fast.choice(0, 25_000_000, 0.01, 4, 4, step=1).exchange == "dense16"  # half the bytes, casts unmeasured
    # Its casts measured at 20 ms, more than the 7.5 ms of the 100 MB allreduce they save: dense.
    fast.observe(1, [StepSample(0, "dense16", 0.01, 0.02, fast.predicted(0, "dense16", 0.01, 4), 0.0)], 4)
    assert fast.choice(0, 25_000_000, 0.01, 4, 4, step=2).exchange == "dense"
    assert chooser_at(100e6, []).choice(0, 25_000_000, 0.01, 64, 4, step=1).exchange == "artopk"
    assert chooser_at(1e9, [], alpha=5e-3).choice(0, 1000, 0.01, 8, 4, step=1).exchange == "agtopk"


def test_measured_selection_time_counts_against_sparse_exchanges() -> None:
    chooser = chooser_at(1e9, [])
    before = chooser.choice(3, 1_000_000, 0.01, 2, 4, step=1)
    assert before.exchange in ("artopk", "agtopk")
    chooser.observe(1, [StepSample(3, before.exchange, 0.01, 1.0, 0.0, 0.0)], 2)
    after = chooser.choice(3, 1_000_000, 0.01, 2, 4, step=2)
    assert after.exchange == "dense16"
    assert after.predicted[before.exchange] == pytest.approx(1.0, abs=0.01)


# ---------------------------------------------------------------- agreement across ranks

def _agreement(rank: int, world: int) -> dict:
    local = [0.001 * (rank + 1), 0.5 - rank * 0.1]
    mins = allreduce_floats(local, None, dist.ReduceOp.MIN)
    probes = probe_collectives((64, 4096), None)
    return {"mins": mins, "probes": probes}


def test_timings_agreed_across_four_ranks() -> None:
    results = run_world(_agreement, 4)
    assert results[0]["mins"] == pytest.approx([0.001, 0.2])
    for r in results:
        assert r == results[0]  # bitwise the same lists on every rank
    kinds = [(obs.kind, obs.nbytes) for obs in results[0]["probes"]]
    assert kinds[:3] == [(k, 64) for k in KINDS]
    # The larger size as configured, or cut (at least twice the smaller) where the busy host made
    # 64 bytes look slow: alike on every rank either way (checked above).
    assert [k for k, _ in kinds[3:]] == list(KINDS) and all(128 <= n <= 4096 for _, n in kinds[3:])


def _probe_on_a_100_mbit_link(rank: int, world: int) -> list:
    # Each rank times the same message a little differently (a 100 Mbit/s link, slower per rank).
    probes = importlib.import_module("flexcomm.comm.probes")
    probes._timed = lambda kind, nbytes, group: nbytes * 8 / 100e6 * (1 + 0.1 * rank)
    return probe_collectives((65536, 1 << 20), None)


@pytest.mark.parametrize("world", [2, 4])
def test_a_probe_cuts_its_larger_size_alike_on_every_rank_from_the_agreed_time(world: int) -> None:
    results = run_world(_probe_on_a_100_mbit_link, world)
    for r in results[1:]:
        assert r == results[0]
    def slowest(nbytes: int) -> float:  # the MAX over ranks
        return nbytes * 8 / 100e6 * (1 + 0.1 * (world - 1))
    # Every kind cut at the median rate per unit of its bandwidth term, or its own where slower.
    bound = link_bound({k: (65536, slowest(65536)) for k in KINDS}, slowest(4), world, GLOO_ALGORITHMS)
    cuts = [probe_size(1 << 20, bound[k], slowest(4)) for k in KINDS]
    assert all(2 * 65536 <= cut < 1 << 20 for cut in cuts)
    assert [(obs.kind, obs.nbytes) for obs in results[0]] == [(k, 65536) for k in KINDS] + list(zip(KINDS, cuts))
    assert results[0][0].seconds == pytest.approx(slowest(65536))


def _probe_behind_a_token_bucket(rank: int, world: int) -> list:
    # 20 Mbit/s whose token bucket passes the first message, the 64 KiB allreduce, at line speed.
    probes = importlib.import_module("flexcomm.comm.probes")
    first = [True]

    def timed(kind: str, nbytes: int, group: object) -> float:
        burst, first[0] = first[0] and kind == "allreduce" and nbytes == 65536, False
        return 0.0007 if burst else 0.0001 + nbytes * 8 / 20e6

    probes._timed = timed
    return probe_collectives((65536, 1 << 20), None)


def test_a_probe_cuts_every_kind_at_the_rate_the_link_showed() -> None:
    # The allreduce read the burst, the allgather and broadcast the link (26 ms for 64 KiB): the
    # 1 MiB allreduce would take 0.42 s; it is cut like the others, to twice 64 KiB.
    results = run_world(_probe_behind_a_token_bucket, 2)
    assert [(obs.kind, obs.nbytes) for obs in results[0][3:]] == [(k, 2 * 65536) for k in KINDS]


def _flex_run(rank: int, world: int, steps: int, probe_sizes: tuple[int, ...] = (64, 4096), probe_every: int = 5) -> dict:
    model, state = hooked_model(compressor="flex", density=0.01, flex_interval=2, probe_every=probe_every,
                                probe_sizes=probe_sizes)
    for step in range(steps):
        # Rank-dependent stalls so every rank measures different times.
        time.sleep(0.003 * rank * (step % 3))
        exchange(model, gradient(rank, step))
    records = state.drain_records()
    return {
        "decisions": [(rec.step, rec.bucket, rec.exchange) for rec in records],
        "predicted": [rec.predicted for rec in records],
        "measured": [rec.t_exchange for rec in records],
        "estimator": state.chooser.state_dict(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_flex_decisions_identical_on_every_rank_with_different_timings(world: int) -> None:
    results = run_world(_flex_run, world, 13)
    assert len(results[0]["decisions"]) == 13
    for r in results[1:]:
        assert r["decisions"] == results[0]["decisions"]
        assert r["predicted"] == results[0]["predicted"]
        assert r["estimator"] == results[0]["estimator"]
    # The local measurements really did differ, so agreement is not an accident.
    assert len({tuple(r["measured"]) for r in results}) > 1
    # Probes at steps 0 and 5 (at most 2 probes x 2 sizes x 3 kinds), then the agreed exchange timings
    # (step 0's are not fed: they carry one-time costs).
    counts = [est["count"] for est in results[0]["estimator"]["estimator"].values()]
    assert sum(counts) > 2 * 2 * 3
    assert all(p > 0 for p in results[0]["predicted"])


def test_exchange_samples_smaller_than_the_smallest_probe_are_not_fitted() -> None:
    # The same run with the default probes (64 KiB and 1 MiB), one probe at step 0: its exchanges'
    # messages (a 5000-float bucket, at most 20 KB) would pass a shaped link's burst faster than
    # its rate; only the probe reaches the (alpha, beta) fit.
    results = run_world(_flex_run, 2, 9, (65536, 1 << 20), 100)
    counts = [est["count"] for est in results[0]["estimator"]["estimator"].values()]
    assert sum(counts) == 2 * 3


def _multi_bucket_flex(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    # Four 128 x 128 layers (64 KB each) over a 50 KB bucket cap: one bucket per layer.
    net = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(4)))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    state = flexcomm.register(model, compressor="flex", density=0.05, flex_interval=2, probe_every=7)
    state.chooser.explore_every = 3  # explore often, so the run holds explorations
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        time.sleep(0.004 * rank * (step % 2))  # rank-dependent timings
        model.zero_grad()
        model(torch.randn(8, 128, generator=gen)).square().mean().backward()
    return {"decisions": [(r.step, r.bucket, r.exchange, r.predicted) for r in state.drain_records()],
            "chooser": state.chooser.state_dict(), "log": list(state.planner.prediction_log)}


def test_flex_plans_and_explorations_identical_on_four_ranks_with_many_buckets() -> None:
    results = run_world(_multi_bucket_flex, 4, 16)
    assert len({b for _, b, _, _ in results[0]["decisions"]}) >= 3
    assert results[0]["log"], "no bucket exchange was agreed"
    for r in results[1:]:
        assert r == results[0]


def _flex_update(rank: int, world: int, dense16: bool) -> tuple[torch.Tensor, str]:
    model, state = hooked_model(compressor="flex", density=1.0, dense16=dense16)
    return exchange(model, gradient(rank, 0)), state.drain_records()[-1].exchange


def test_flex_at_full_density_equals_dense_average() -> None:
    results = run_world(_flex_update, 2, False)
    dense = torch.stack([gradient(r, 0) for r in range(2)]).mean(0)
    for update, chosen in results:
        assert chosen == "dense"
        torch.testing.assert_close(update, dense)
    assert update.numel() == M


def test_flex_dense16_is_the_fp16_average_widened() -> None:
    # Without a measurement the model rates dense16 (half the bytes, casts not yet measured)
    # cheapest: the update is sum_i fp16(g_i / 2), summed in fp16, widened -- bit for bit.
    results = run_world(_flex_update, 2, True)
    halves = [(gradient(r, 0) / 2).half() for r in range(2)]
    expected = (halves[0].float() + halves[1].float()).half().float()
    for update, chosen in results:
        assert chosen == "dense16"
        assert update.dtype == torch.float32
        assert torch.equal(update, expected)
    assert not torch.equal(expected, torch.stack([gradient(r, 0) for r in range(2)]).mean(0))


# ---------------------------------------------------------------- switching exchanges mid-training

SWITCHES = ("agtopk", "dense", "artopk", "artopk", "dense", "agtopk", "agtopk", "artopk", "dense", "dense")


def _forced(state, offset: int = 0) -> None:
    """Make flex switch exchanges by a fixed schedule of (step, bucket), through its chooser."""
    state.chooser.choose = lambda bucket, step, density, world: SWITCHES[(step + bucket + offset) % len(SWITCHES)]


def _switching_error_feedback(rank: int, world: int) -> dict:
    model, state = hooked_model(compressor="flex", density=0.01, flex_interval=3, probe_every=100)
    _forced(state)
    grads, updates = torch.zeros(M, dtype=torch.float64), torch.zeros(M, dtype=torch.float64)
    for step in range(len(SWITCHES)):
        g = gradient(rank, step)
        grads += g.double()
        updates += exchange(model, g).double()
    residual = state.memory.residual(0)
    return {"grads": grads, "updates": updates, "residual": None if residual is None else residual.double(),
            "exchanges": [r.exchange for r in state.drain_records()]}


def test_switching_exchanges_neither_drops_nor_double_counts_residuals() -> None:
    # Error feedback across switches (dense flushes the residual, sparse keeps the rest): over the
    # run, N x the sum of the averaged updates plus every rank's final residual is the sum of all
    # ranks' gradients.  A switch that dropped a residual or sent it twice breaks the equality.
    results = run_world(_switching_error_feedback, 4)
    assert set(results[0]["exchanges"]) == {"dense", "agtopk", "artopk"}
    for r in results[1:]:
        assert torch.equal(r["updates"], results[0]["updates"])
    delivered = 4 * results[0]["updates"] + sum(r["residual"] for r in results if r["residual"] is not None)
    torch.testing.assert_close(delivered, sum(r["grads"] for r in results), rtol=0, atol=1e-4)


def _switching_training(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)
    state = flexcomm.register(model, compressor="flex", density=0.05, flex_interval=3, probe_every=100)
    _forced(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3 * len(SWITCHES)):
        x = torch.randn(16, 32, generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    buckets = {r.bucket for r in state.drain_records()}
    return {"model": {k: v.detach().clone() for k, v in net.named_parameters()}, "buckets": buckets}


def test_switching_exchanges_keeps_every_rank_on_the_same_model() -> None:
    # The regression check for the 4-rank flex run whose accuracy fell: several buckets switching
    # among all three exchanges under momentum SGD must leave the four ranks' parameters bitwise
    # identical (BatchNorm statistics differ by the last batch: DDP broadcasts them before a forward).
    results = run_world(_switching_training, 4)
    assert len(results[0]["buckets"]) >= 2
    for r in results[1:]:
        for name, tensor in results[0]["model"].items():
            assert torch.equal(r["model"][name], tensor), name


def step_log_on_clock(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> step_log.StepLog:
    """A step log whose clock reads ``times``, one per entered / finished call."""
    clock = iter(times)
    monkeypatch.setattr(step_log, "perf_counter", lambda: next(clock))
    return step_log.StepLog()


def test_step_log_splits_overlapping_collectives_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two 25 MB allreduces launched 10 ms apart share the link and finish at 400 and 410 ms; a
    # small allgather starts after both.  Serial queueing would give the second one 10 ms.
    log = step_log_on_clock(monkeypatch, [0.0, 0.010, 0.400, 0.410, 0.420, 0.450])
    log.entered(7, 0, "dense", 1.0, 6_250_000, 4, 0.2)  # t = 0
    log.entered(7, 1, "dense", 1.0, 6_250_000, 4, 0.2)  # t = 0.010
    log.finished(7, 0, Observation("allreduce", 25_000_000, 2, 0.400), 0.0)  # done 0.400
    log.finished(7, 1, Observation("allreduce", 25_000_000, 2, 0.400), 0.0)  # done 0.410
    log.entered(7, 2, "agtopk", 0.01, 1000, 4, 0.01)  # t = 0.420
    log.finished(7, 2, Observation("allgather", 800, 2, 0.020), 0.005)  # done 0.450
    samples = {s.bucket: s for s in log.close()}
    assert samples[0].service == pytest.approx(0.205) and samples[1].service == pytest.approx(0.205)
    assert samples[2].service == pytest.approx(0.020)  # launched at 0.430, after the busy period: alone
    assert samples[0].gap == pytest.approx(0.010)


def test_step_log_gives_a_long_allreduce_the_period_it_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 25 MB allreduce runs 0-210 ms; two 250 kB AR-Topk value allreduces are launched at 30
    # and 60 ms and finish before it (gloo runs them alongside).  One busy period of 210 ms,
    # split by bytes: the long one keeps ~206 ms, not only the time after the small ones.
    log = step_log_on_clock(monkeypatch, [0.0, 0.030, 0.050, 0.060, 0.080, 0.210])
    log.entered(3, 0, "dense", 0.01, 6_250_000, 4, 0.2)  # t = 0
    log.entered(3, 1, "artopk", 0.01, 6_250_000, 4, 0.01)  # t = 0.030
    log.finished(3, 1, Observation("allreduce", 250_000, 2, 0.020), 0.0)  # done 0.050
    log.entered(3, 2, "artopk", 0.01, 6_250_000, 4, 0.01)  # t = 0.060
    log.finished(3, 2, Observation("allreduce", 250_000, 2, 0.020), 0.0)  # done 0.080
    log.finished(3, 0, Observation("allreduce", 25_000_000, 2, 0.210), 0.0)  # done 0.210
    samples = {s.bucket: s for s in log.close()}
    assert samples[0].service == pytest.approx(0.210 * 25 / 25.5)
    assert samples[1].service == pytest.approx(0.210 * 0.25 / 25.5)


def test_dense16_option_is_checked_and_keeps_flex_off_dense16() -> None:
    with pytest.raises(TypeError, match="dense16 must be True or False, got 'no'"):
        flexcomm.FlexState(compressor="flex", dense16="no")
    # fp16 gradients gain nothing from dense16: it is never a choice for them, nor when disabled.
    for chooser, value_bytes in ((chooser_at(1e8, []), 2), (ExchangeChooser(dense16=False), 4)):
        chooser.sizes = {0: (1_000_000, value_bytes)}
        assert chooser.predicted(0, "dense16", 0.01, 2) == math.inf
        assert chooser.choice(0, 1_000_000, 1.0, 2, value_bytes, step=1).exchange == "dense"
