"""Rank consistency of the decisions (issue 20, cause 6): fingerprint, agreed lengths, resume."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence

import pytest
import torch

from fake_link import FakeLink, agreement_points, make_planner, spy_updates
from flexcomm.control import DensityController, StepPlanner
from flexcomm.control.periods import StepPeriods
from flexcomm.cost import CostParams, LinkParams, Observation
from flexcomm.cost.model import predicted_probe
from multiproc import raised, run_world
from test_hook_distributed import exchange, gradient, hooked_model

# ---------------------------------------------------------------- every decision option in the fingerprint

#: Options that change a decision, and rank 1's value (rank 0 keeps the default).
DIFFERING = {"hysteresis": 0.2, "redecide_every": 7, "gain_change": 0.3, "cost_change": 0.5, "min_gain": 0.3}


def _differing_options(rank: int, world: int) -> str:
    controller = DensityController(**(DIFFERING if rank else {}))
    model, state = hooked_model(compressor="flex", density="auto", controller=controller, dense16=not rank)
    if rank:
        state.chooser.explore_every = 3
    return raised(lambda: exchange(model, gradient(rank, 0)))


def test_ranks_with_different_decision_options_fail_at_the_first_bucket_naming_each() -> None:
    for message in run_world(_differing_options, 2):
        assert "configuration differs across ranks" in message
        for name, value in DIFFERING.items():
            assert f"controller.{name}: rank 0=" in message and f"rank 1={value!r}" in message
        assert "chooser.explore_every: rank 0=10, rank 1=3" in message
        assert "chooser.dense16: rank 0=True, rank 1=False" in message


# ---------------------------------------------------------------- one decision per agreement point (cause 5)

CANDIDATES = (1.0, 0.1, 0.033, 0.011, 0.004, 0.001)


def test_the_density_is_decided_once_per_agreement_point_and_never_between(monkeypatch: pytest.MonkeyPatch) -> None:
    controller = DensityController(CANDIDATES, warmup_steps=0, ramp_steps=1, measure_every=20)
    calls = spy_updates(controller)
    FakeLink(monkeypatch.setattr, rate_bps=100e6).run(make_planner("agtopk", controller), range(60))
    steps = [step for step, _ in calls]
    assert steps, "the controller never decided"
    # Before the fix a gain measured at step 20 was decided on at 21, one step after the
    # agreement point's own decision on other inputs: single-step flip-flops.
    assert len(steps) == len(set(steps)) and set(steps) <= agreement_points(60)


# ---------------------------------------------------------------- a new density gets a new plan (cause 4)

def test_a_density_change_replans_the_exchanges_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # flex on a 20 Mbit link: at density 1.0 the plan is dense (sparse at density 1 sends more);
    # once the controller lowers the density, the plan made for 1.0 must not run another step.
    link = FakeLink(monkeypatch.setattr, rate_bps=20e6)
    ran = link.run(make_planner(None, DensityController(CANDIDATES, warmup_steps=10, ramp_steps=1, measure_every=10)),
                   range(30))
    sparse_steps = [(step, exchange) for step, (density, exchange) in enumerate(ran) if density < 1.0]
    assert sparse_steps, "the density never dropped"
    assert all(exchange in ("artopk", "agtopk") for _, exchange in sparse_steps), sparse_steps


# ---------------------------------------------------------------- no dense warm-up on a slow link (cause 1)

@pytest.mark.parametrize("rate_bps,slow", [(20e6, True), (100e9, False)])
def test_auto_defaults_go_sparse_by_step_2_where_dense_is_slow_and_measure_dense_back_where_not(
        monkeypatch: pytest.MonkeyPatch, rate_bps: float, slow: bool) -> None:
    link = FakeLink(monkeypatch.setattr, rate_bps=rate_bps)
    # Every default, as FlexState(density="auto") builds it.
    densities = [density for density, _ in link.run(make_planner("agtopk", DensityController()), range(5))]
    if slow:
        assert densities[2] < 1.0, densities
    # Step 4 is the first agreement with measured exchanges (step 0's carry one-time costs and are not
    # fed): from there only the slow link stays sparse.
    assert (densities[4] < 1.0) == slow, densities


# ---------------------------------------------------------------- predictions from same-density measurements (cause 3)

def forced(controller: DensityController, schedule: Callable[[int], float]) -> list[tuple[int, list[float]]]:
    """Replace the controller's choice by ``schedule(step)``; record the seconds it was given."""
    calls: list[tuple[int, list[float]]] = []

    def update(step: int, gains: Sequence[float], seconds: Sequence[float], gains_step: int | None = None) -> float:
        calls.append((step, list(seconds)))
        controller.density = schedule(step)
        return controller.density

    controller.update = update  # type: ignore[method-assign]
    return calls


def test_each_candidate_is_predicted_from_periods_measured_at_its_own_density(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step at 0.1 costs 50 ms that the model cannot see (e.g. a slower write-back).  After
    # running 0.1 and then 0.011, the prediction for 0.1 must be 0.1's own measured period,
    # not 0.011's period with the model's difference between the two swapped in.
    candidates = (1.0, 0.1, 0.011)
    link = FakeLink(monkeypatch.setattr, rate_bps=100e6, extra={0.1: 0.05})
    controller = DensityController(candidates, warmup_steps=0, ramp_steps=1, measure_every=10)
    calls = forced(controller, lambda step: 0.1 if step < 30 else 0.011)
    planner = make_planner("agtopk", controller)
    periods: dict[float, float] = {}
    for step in range(60):
        start = link.clock
        density, _ = link.step(planner, step)
        periods[density] = link.clock - start
    step, seconds = calls[-1]
    assert step >= 50
    assert seconds[1] == pytest.approx(periods[0.1], rel=0.05)
    assert seconds[2] == pytest.approx(periods[0.011], rel=0.05)


def test_a_link_drop_keeps_forward_and_optimizer_in_every_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 Gbit, then 20 Mbit from step 38: the agreement at step 40 sees mostly fast periods but a
    # model that already learned the drop.  The part of the step the model leaves out (compute,
    # 100 ms) must stay in every candidate's time: clamped to 0, sparse candidates looked ~free.
    link = FakeLink(monkeypatch.setattr, rate_bps=1e9)
    controller = DensityController(CANDIDATES, warmup_steps=0, ramp_steps=1, measure_every=10)
    calls = spy_updates(controller)
    link.run(make_planner("agtopk", controller), range(60), rates={38: 20e6})
    after = [(step, seconds) for step, seconds in calls if step >= 38]
    assert after
    for step, seconds in after:
        assert min(seconds) >= 0.95 * link.compute, (step, seconds)
    assert controller.density != CANDIDATES[-1]


def test_a_link_drop_seen_on_the_plan_s_collectives_moves_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # flex at 0.01 on a 10 Gbit/s link runs dense (allreduces only); from step 25 the link is
    # 100x slower.  The agreement at step 30 must move the allgather's fit too (AG-Topk is rated
    # on it); before, it kept its 10 Gbit/s fit until AG-Topk ran again (MLP group, seed 3).
    link = FakeLink(monkeypatch.setattr, rate_bps=10e9)
    planner = make_planner(None, None, density=0.01)
    ran = link.run(planner, range(31), rates={25: 100e6})
    assert {exchange for _, exchange in ran[20:30]} <= {"dense", "dense16"}
    slow = LinkParams.from_bandwidth(link.alpha, 100e6).beta
    assert 0.5 * slow <= planner.chooser.params.allgather.beta <= 2.05 * slow  # within KIND_SPREAD (was 1/100)


def test_a_link_drop_seen_on_the_collectives_restarts_the_guard_s_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compute (100 ms) hides the drop from the step periods (102 -> ~166 ms, under the guard's own
    # 3x jump); the collectives show it.  Periods from before it must not decide the guard after it
    # (MLP group, seed 4, at c90b666: all-dense16 steps of the fast link, 19 ms, against plan steps
    # after the drop, 56 ms, held all-dense16 at 120 ms).
    link = FakeLink(monkeypatch.setattr, rate_bps=10e9)
    planner = make_planner(None, None, density=0.01)
    link.run(planner, range(41))
    assert set(planner.chooser.measured_steps) == {"dense", "other"}
    link.run(planner, range(41, 51), rates={45: 100e6})
    assert planner.chooser.measured_steps == {}


@pytest.mark.parametrize("exchange", ["agtopk", None])
def test_a_period_measured_across_a_link_drop_is_not_taken_for_time_the_model_leaves_out(
        monkeypatch: pytest.MonkeyPatch, exchange: str | None) -> None:
    # Dense at 1 Gbit, 20 Mbit from step 22, then 0.1 from step 50 and 1 Gbit again from 52.
    # What dense's prediction keeps beyond the model's dense step is what the model leaves out
    # (the link's compute).  Paired with the model the steps ran under (a 1 Gbit model at the
    # first agreement after the drop), the drop itself was kept too, and dense stayed ~0.15 s
    # too slow after the link came back.
    link = FakeLink(monkeypatch.setattr, rate_bps=1e9)
    controller = DensityController(CANDIDATES, warmup_steps=0, measure_every=10)
    calls = forced(controller, lambda step: 1.0 if step < 50 else 0.1)
    # Probes every 20 steps: allreduce times (dense) are learned from them while only 0.1 runs.
    planner = make_planner(exchange, controller, probe_every=20)
    link.run(planner, range(90), rates={22: 20e6, 52: 1e9})
    step, seconds = calls[-1]
    assert step >= 80
    left_out = seconds[0] - planner.chooser.step_seconds(1.0, 2, exchange)
    assert left_out == pytest.approx(link.compute, rel=0.15), (seconds[0], left_out)


# ---------------------------------------------------------------- the measurement allreduce's length is agreed (cause 6)

def _uneven_samples(rank: int, world: int) -> dict:
    planner = make_planner(None, None, density=0.01, flex_interval=4)
    for step in range(9):
        planner.begin_step(step)
        planner.plan(0, 100_000, 4, step)
        # Rank 1 misses step 2's exchange (a step that failed there): it holds fewer samples.
        if not (rank == 1 and step == 2):
            planner.observe_exchange(step, 0, Observation("allgather", 8000, world, 0.001 * (rank + 1)), 0.002)
        planner.end_step(step)
    return planner.chooser.state_dict()


def test_ranks_holding_different_numbers_of_samples_agree_on_the_same_measurements() -> None:
    # Agreement at step 4 (issued at step 3's end): rank 0 holds samples of steps 1 and 2, rank 1
    # only of step 1.  The allreduce was as long as each rank's own samples: different lengths.
    results = run_world(_uneven_samples, 2, timeout_s=20.0)
    assert results[0] == results[1]


# ---------------------------------------------------------------- a resumed run decides as the uninterrupted one

RESUME_AFTER, RESUME_END, DROP_AT = 29, 64, 45


def _decide(rank: int, world: int, resume: bool) -> dict:
    link = FakeLink(setattr, rate_bps=1e9, identity=False, jitter=0.002 * rank)
    calls: list[tuple[int, list[float]]] = []  # every decision's inputs, whichever planner took it

    def fresh() -> StepPlanner:
        controller = DensityController(CANDIDATES, warmup_steps=0, ramp_steps=1, measure_every=20)
        spy_updates(controller, calls)
        return make_planner("agtopk", controller, flex_interval=10)

    planner = fresh()
    ran = link.run(planner, range(RESUME_AFTER + 1))
    if resume:  # through a checkpoint file, loaded as the app loads it
        buffer = io.BytesIO()
        torch.save(planner.state_dict(), buffer)
        buffer.seek(0)
        link.clock += 5.0  # the restart takes time that belongs to no step
        planner = fresh()
        planner.load_state_dict(torch.load(buffer, weights_only=True))
    ran += link.run(planner, range(RESUME_AFTER + 1, RESUME_END), rates={DROP_AT: 20e6})
    assert planner.controller is not None
    return {"ran": ran, "calls": calls, "decisions": list(planner.controller.decisions),
            "chooser": planner.chooser.state_dict()}


def test_a_resumed_run_takes_the_decisions_of_the_uninterrupted_one() -> None:
    # The checkpoint falls between a gain measurement (step 29) and the agreement point that
    # decides on it (30), with samples and step periods of steps 20-29 not yet agreed; the
    # link drops at step 45, so the density changes after the resume.
    straight, resumed = run_world(_decide, 2, False), run_world(_decide, 2, True)
    for rank in (0, 1):
        assert resumed[rank]["ran"] == straight[rank]["ran"]
        assert resumed[rank]["calls"] == straight[rank]["calls"]  # every decision's inputs, bit for bit
        assert resumed[rank]["decisions"] == straight[rank]["decisions"]
        assert resumed[rank]["chooser"] == straight[rank]["chooser"]
    after = {density for density, _ in straight[0]["ran"][RESUME_AFTER + 1:]}
    assert len(after) > 1, "no density change after the resume to compare"


# ---------------------------------------------------------------- all-dense steps chosen on stale measurements, cut short

DENSE = {"dense", "dense16"}


def _sparse_then_drop(patch: Callable, drop_at: int, steps: int = 110, identity: bool = True, rank: int = 0,
                      resume_after: int | None = None) -> list[tuple[float, str]]:
    """flex at 0.01 on one bucket, 10 Gbit/s until ``drop_at``, then 100 Mbit/s.  AG-Topk's 16 KB messages
    are below the probes' sizes: the fit does not see the drop, dense keeps its 10 Gbit/s rating."""
    link = FakeLink(patch, rate_bps=10e9, compute=0.005, select=0.0002, identity=identity, jitter=0.0005 * rank)
    planner = make_planner(None, None, density=0.01)
    if resume_after is None:
        return link.run(planner, range(steps), rates={drop_at: 100e6})
    ran = link.run(planner, range(resume_after + 1), rates={drop_at: 100e6})
    buffer = io.BytesIO()
    torch.save(planner.state_dict(), buffer)
    buffer.seek(0)
    link.clock += 5.0
    planner = make_planner(None, None, density=0.01)
    planner.load_state_dict(torch.load(buffer, weights_only=True))
    return ran + link.run(planner, range(resume_after + 1, steps))


def test_an_all_dense_plan_made_on_stale_measurements_runs_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The drop (step 74) slows the sparse pairs that ran; dense, not run since, keeps its fast
    # calibration, and the plan of step 90 is fp32 dense: 69 ms steps against 7 ms.  All 10 steps of
    # the interval ran it; now the first one's period cuts it, and AR-Topk (the step before) runs
    # until the next agreement point, which has the dense step's collective in the fit.
    ran = [exchange for _, exchange in _sparse_then_drop(monkeypatch.setattr, 74)]
    assert ran[90] == "dense" and ran[89] not in DENSE
    assert not DENSE & set(ran[91:])
    assert set(ran[91:100]) == {ran[89]}


def test_a_guard_trial_after_an_unseen_drop_runs_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = [exchange for _, exchange in _sparse_then_drop(monkeypatch.setattr, 48)]
    assert ran[50] == "dense16"  # the guard's trial, rated by a model that still sees 10 Gbit/s
    assert not DENSE & set(ran[51:])  # its 2 other steps (and every later one) run sparse


def test_trials_on_an_unchanged_link_keep_their_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = [exchange for _, exchange in _sparse_then_drop(monkeypatch.setattr, 10_000)]
    trials = [step for step, exchange in enumerate(ran) if exchange == "dense16"]
    assert trials[:6] == [20, 25, 26, 27, 50, 51]  # a dense16 exploration at 20, then 3-step trials
    assert ran[52] == "dense16"


def test_a_step_to_density_one_is_not_cut_back_to_a_sparse_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    # auto moves from 0.01 to 1.0 on a slow link: the first dense step is far slower than the sparse
    # plan's, but it is the controller's choice.  Holding the sparse exchanges of the step before ran
    # AG-Topk at density 1.0 (every value and index: 720 ms steps at 100 Mbit/s where dense took 120).
    link = FakeLink(monkeypatch.setattr, rate_bps=100e6, compute=0.005, select=0.0002)
    controller = DensityController(CANDIDATES, warmup_steps=0, measure_every=10)
    forced(controller, lambda step: 0.011 if step < 40 else 1.0)
    ran = link.run(make_planner(None, controller), range(60))
    assert ran[39][0] == 0.011 and ran[39][1] not in DENSE
    assert all(density == 1.0 and exchange in DENSE for density, exchange in ran[40:50])


def _cut_on_ranks(rank: int, world: int, resume_after: int | None) -> list[tuple[float, str]]:
    return _sparse_then_drop(setattr, 74, steps=104, identity=False, rank=rank, resume_after=resume_after)


def test_ranks_cut_alike_and_a_resumed_run_holds_the_same_steps() -> None:
    # Real allreduces between 2 ranks (rank 1's steps jitter): the check runs at the same step on both;
    # a checkpoint after the cut (step 92) restores the held exchanges.
    straight = run_world(_cut_on_ranks, 2, None, timeout_s=60.0)
    resumed = run_world(_cut_on_ranks, 2, 92, timeout_s=60.0)
    assert straight[0] == straight[1] == resumed[0] == resumed[1]
    assert [exchange for _, exchange in straight[0]][90:92] == ["dense", straight[0][89][1]]


# ---------------------------------------------------------------- a minimum dwell, a link change at once (cause 5)

GAINS = [1.0, 0.9, 0.7, 0.5, 0.3, 0.2]
SLOW = [3.0, 1.5, 1.2, 1.08, 1.02, 1.0]  # goodput picks 0.1


def test_a_switch_holds_for_min_dwell_steps_then_takes_the_held_choice() -> None:
    controller = DensityController(CANDIDATES, warmup_steps=0, ramp_steps=1, measure_every=1, admit_margin=0.0)  # min_dwell: 30
    assert controller.update(0, GAINS, SLOW) == 0.1
    # 0.033's time moved 29% (past cost_change, not link_change): it now wins by 7% > hysteresis,
    # but a switch 10 steps after the last one would disturb the residual again.
    better = [3.0, 1.5, 0.85, 1.08, 1.02, 1.0]
    assert controller.update(10, GAINS, better) == 0.1
    assert controller.update(20, GAINS, better) == 0.1
    assert controller.update(30, GAINS, better) == 0.033  # the dwell is over: the held choice is taken


def test_a_link_change_is_followed_at_once_within_the_dwell() -> None:
    controller = DensityController(CANDIDATES, warmup_steps=0, ramp_steps=1, measure_every=1, admit_margin=0.0)  # min_dwell: 30
    assert controller.update(0, GAINS, SLOW) == 0.1
    assert controller.update(10, GAINS, [3.0, 1.5, 0.55, 1.08, 1.02, 1.0]) == 0.033  # moved 54%: a new link


# ---------------------------------------------------------------- the guard compares plans, not probes

def test_dense16_steps_are_the_guards_all_dense_steps_and_warm_up_steps_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    # flex at density 1.0 on a 1 Gbit link plans dense16: its steps are the guard's all-dense steps
    # (what the fp16 hook sends), not the plan's "other" steps.  Warm-up steps run fp32 dense, which
    # is neither: they keep no period (they had started the plan's period at fp32's time).
    link = FakeLink(monkeypatch.setattr, rate_bps=1e9)
    planner = make_planner(None, None, density=1.0)
    ran = link.run(planner, range(1, 25))
    assert all(exchange == "dense16" for step, (_, exchange) in enumerate(ran, start=1) if step % 10)  # 10, 20: explorations
    assert planner.chooser.guard_exchange == "dense16"
    assert set(planner.chooser.measured_steps) == {"dense"}
    warming = StepPlanner(None, 0.01, None, warmup_steps=30, flex_interval=10, probe_every=1000,
                          probe_sizes=(65536, 1 << 20), forgetting=0.9, group=None)
    assert {exchange for _, exchange in link.run(warming, range(1, 25))} == {"dense"}
    assert warming.chooser.measured_steps == {}


def test_a_step_that_probed_gives_the_guard_no_period(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps 0 and 5 probe the collectives (1 s of them here); step 0 also pays one-time set-up.  Taken for
    # a step of the plan, such a period made all-dense steps look faster and the guard ran them for 55 steps.
    link = FakeLink(monkeypatch.setattr, rate_bps=1e9, probe_cost=1.0)
    planner = make_planner(None, None, density=0.01, probe_every=5)
    periods = []
    for step in range(12):
        link.step(planner, step)
        periods += [seconds for seconds, _ in planner.chooser.measured_steps.values()]
    assert periods, "no period was agreed"
    assert max(periods) < 0.5, periods


# ---------------------------------------------------------------- periods measured under another plan

def _periods_of_two_plans() -> StepPeriods:
    periods = StepPeriods()
    # Two early steps at density 1.0 ran all-dense16 on the small bucket (57 ms against a simulated 20 ms)...
    periods.observe(2, 1.0, 0.057, 0.020, ("dense16", "lowrank"))
    # ...then density 0.1 ran for a while (30 ms against 13 ms).
    periods.observe(10, 0.1, 0.030, 0.013, ("artopk", "lowrank"))
    return periods


def test_a_density_measured_under_another_plan_is_predicted_from_the_density_running() -> None:
    periods = _periods_of_two_plans()
    # Density 1.0's plan is now low-rank on both buckets, simulated at 20 ms.
    predicted = periods.predict([1.0, 0.1], [0.020, 0.013], [("lowrank", "lowrank"), ("artopk", "lowrank")])
    assert predicted[1] == pytest.approx(0.030)
    assert predicted[0] == pytest.approx(0.030 + (0.020 - 0.013))  # carried from 0.1, not 57 ms of another plan
    # The same plan as measured: its own period.
    same = periods.predict([1.0, 0.1], [0.020, 0.013], [("dense16", "lowrank"), ("artopk", "lowrank")])
    assert same[0] == pytest.approx(0.057)


def test_a_period_of_another_plan_replaces_the_density_s_period_whole() -> None:
    periods = _periods_of_two_plans()
    periods.observe(20, 1.0, 0.050, 0.020, ("dense16", "lowrank"))  # same plan: averaged
    assert periods.predict([1.0], [0.020], [("dense16", "lowrank")])[0] == pytest.approx(0.7 * 0.057 + 0.3 * 0.050)
    periods.observe(30, 1.0, 0.022, 0.020, ("lowrank", "lowrank"))  # another plan, within JUMP: replaced
    assert periods.predict([1.0], [0.020], [("lowrank", "lowrank")])[0] == pytest.approx(0.022)


def test_periods_keep_their_plans_through_a_checkpoint_and_read_older_ones() -> None:
    periods = _periods_of_two_plans()
    restored = StepPeriods()
    restored.load_state_dict(json.loads(json.dumps(periods.state_dict())))
    assert restored.state_dict() == periods.state_dict()
    older = {"measured": [[1.0, 0.057, 0.020, 2]]}  # before plans were kept: any plan matches
    restored.load_state_dict(older)
    assert restored.predict([1.0], [0.020], [("lowrank", "lowrank")]) == [pytest.approx(0.057)]


# ---------------------------------------------------------------- the first periods count while the model calibrates

def test_the_first_periods_count_while_the_model_calibrates(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probes see a link 10x faster than the exchanges get (on the MLP group's 2 shared cores the
    # first decisions predicted 1-8 ms steps that took 13-23 ms): the first agreed samples move the
    # model's step by more than REGIME_CHANGE, which dropped those steps' periods as if the link had
    # changed, and the next decisions saw no forward, backward or optimizer at all.
    link = FakeLink(monkeypatch.setattr, rate_bps=100e6)
    fast = CostParams.uniform(LinkParams.from_bandwidth(link.alpha, 1e9))
    monkeypatch.setattr(link, "probe", lambda sizes: [Observation(kind, nbytes, 2, seconds)
                                                      for kind, nbytes, seconds in predicted_probe(sizes, 2, fast)])
    controller = DensityController(CANDIDATES, measure_every=1)
    calls = spy_updates(controller)
    link.run(make_planner("agtopk", controller), range(12))
    informed = [(step, seconds) for step, seconds in calls if step >= 4]
    assert informed
    for step, seconds in informed:
        assert min(seconds) >= 0.95 * link.compute, (step, seconds)
