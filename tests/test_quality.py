"""The steps factor: flex charges AR-Topk for the followers' values sent at the leader's indices."""

from __future__ import annotations

import math

import pytest

from flexcomm.control.agreement_point import AgreementPoint
from flexcomm.control.exchange import ExchangeChooser, StepSample
from flexcomm.control.measurements import agreed_samples, measurement_vector
from flexcomm.control.quality import steps_factor
from flexcomm.control.step_log import LocalSample, StepLog, sample_from_row, sample_row
from flexcomm.control.step_model import BucketCosts, best_plan, plan_cost
from flexcomm.cost import CostEstimator, CostParams, LinkParams, Observation
from multiproc import run_world


def test_steps_factor_is_the_ratio_of_the_kept_energy_fractions() -> None:
    assert steps_factor(0.05, 0.10) == 2.0
    assert steps_factor(0.1, 0.1) == 1.0
    # Sending more than the leader's own top-k never makes an exchange cheaper than 1.
    assert steps_factor(0.2, 0.1) == 1.0
    assert steps_factor(math.nan, 0.1) is None and steps_factor(0.1, 0.0) is None and steps_factor(0.0, 0.1) is None


def two_sparse_buckets(factor: float) -> list[BucketCosts]:
    """AR-Topk 20% cheaper than AG-Topk in comm on both buckets; AR-Topk's steps factor ``factor``."""
    return [BucketCosts({"dense": 0.0, "dense16": 0.0, "artopk": 0.001, "agtopk": 0.001, "lowrank": 0.0},
                        {"dense": 1.0, "dense16": 1.0, "artopk": 0.008, "agtopk": 0.010, "lowrank": math.inf}, gap,
                        {"artopk": factor}, size)
            for gap, size in ((0.005, 3.0), (0.0, 1.0))]


def test_plan_cost_weights_each_buckets_factor_by_its_size() -> None:
    costs = two_sparse_buckets(1.2)
    # The step by hand: t 0.001 -> 0.006 -> 0.007; free 0.011 (AG-Topk) -> max(0.007, 0.011) + 0.008 = 0.019.
    assert plan_cost(costs, ["agtopk", "artopk"]) == pytest.approx(0.019 * (3.0 * 1.0 + 1.0 * 1.2) / 4.0)


def test_a_plan_takes_ar_topk_only_where_it_saves_more_time_than_the_steps_it_costs() -> None:
    # Steps by hand: all AG-Topk 0.021; AR-Topk on the last (small) bucket 0.019; on both 0.017.
    # 50% more steps: AG-Topk everywhere, from either start.  No steps factor: AR-Topk everywhere.
    assert best_plan(two_sparse_buckets(1.5), ["artopk", "artopk"], 0.0) == ["agtopk", "agtopk"]
    assert best_plan(two_sparse_buckets(1.5), ["agtopk", "agtopk"], 0.0) == ["agtopk", "agtopk"]
    assert best_plan(two_sparse_buckets(1.0), ["agtopk", "agtopk"], 0.05) == ["artopk", "artopk"]
    # 30% more steps: worth it on the small bucket only (0.019 * (3 + 1.3) / 4 = 0.0204 < 0.021).
    assert best_plan(two_sparse_buckets(1.3), ["artopk", "artopk"], 0.0) == ["agtopk", "artopk"]


def chooser_measuring(kept: tuple[float, float]) -> ExchangeChooser:
    """Two buckets at 1 Gbit where AR-Topk measured 20% less comm than AG-Topk, AR-Topk keeping ``kept`` (min, max)."""
    chooser = ExchangeChooser(CostEstimator(prior=CostParams.uniform(LinkParams.from_bandwidth(1e-4, 1e9))))
    chooser.sizes = {0: (1_000_000, 4), 1: (1_000_000, 4)}
    chooser.plan = {0: "artopk", 1: "artopk"}
    for step in range(3):
        chooser.observe(step, [StepSample(b, "agtopk", 0.01, 0.001, 0.005, 0.0) for b in (0, 1)], 2)
        chooser.observe(step, [StepSample(b, "artopk", 0.01, 0.001, 0.004, 0.0, *kept) for b in (0, 1)], 2)
    chooser.refresh()
    chooser.replan(0.01, 2)
    return chooser


def test_a_chooser_charges_ar_topk_the_steps_its_measured_kept_energy_costs() -> None:
    # Followers kept 0.05 of their energy where the leader's own top-k kept 0.10: twice the steps.
    assert chooser_measuring((0.05, 0.10)).plan == {0: "agtopk", 1: "agtopk"}
    # Nothing known about what AR-Topk sends: the time decides, and it is faster.
    assert chooser_measuring((math.nan, math.nan)).plan == {0: "artopk", 1: "artopk"}


def test_the_steps_factor_survives_a_state_round_trip() -> None:
    chooser = chooser_measuring((0.05, 0.10))
    restored = ExchangeChooser()
    restored.load_state_dict(chooser.state_dict())
    assert restored.costs(0, 0.01, 2).factor == chooser.costs(0, 0.01, 2).factor
    assert restored.costs(0, 0.01, 2).factor["artopk"] == 2.0


def test_the_step_log_keeps_the_settled_gain_squared_through_a_checkpoint() -> None:
    log = StepLog()
    log.entered(5, 0, "artopk", 0.01, 100, 4, 0.001)
    log.finished(5, 0, Observation("allreduce", 4, 2, 0.002), 0.0005)
    log.sent(5, 0, 0.5)
    log.sent(4, 0, 0.9)  # another step's gain is not this one's
    log.measured_quality(5, 0, 0.75)
    restored = StepLog()
    restored.load_state_dict(log.state_dict())
    (sample,) = restored.close()
    assert sample.kept == 0.25 and sample.quality == 0.75
    assert sample_from_row(sample_row(sample)) == sample
    # Rows saved before the quality (then the gain) were kept load with unknown ones.
    older = sample_from_row(sample_row(sample)[:-1])
    assert older.kept == 0.25 and math.isnan(older.quality)
    assert math.isnan(sample_from_row(sample_row(sample)[:-2]).kept)


def local_sample(kept: float) -> LocalSample:
    return LocalSample(3, 0, "artopk", 0.01, 100, 4, Observation("allreduce", 4, 2, 0.002), 0.001, 0.002, 0.0, 0.003, kept)


def _agree_on_kept(rank: int, world_size: int) -> list[float]:
    kept = [0.04, 0.09][rank]
    point = AgreementPoint.issue([(3, 0)], [local_sample(kept)], [0.5], None, None)
    (agreed,), periods = point.measured()
    return [agreed.kept_min, agreed.kept_max, *periods]


def test_ranks_agree_on_the_smallest_and_largest_kept_fraction_over_gloo() -> None:
    assert run_world(_agree_on_kept, 2) == [[0.04, 0.09, 0.5]] * 2


def test_a_rank_that_does_not_know_the_kept_fraction_makes_it_unknown_on_every_rank() -> None:
    vectors = [measurement_vector([(3, 0)], [local_sample(k)], [0.5]) for k in (0.04, math.nan)]
    combined = [max(a, b) for a, b in zip(*vectors)]  # what the MAX allreduce computes
    (agreed,), _ = agreed_samples([(3, 0)], [local_sample(0.04)], combined)
    assert math.isnan(agreed.kept_min) and agreed.service == 0.002
