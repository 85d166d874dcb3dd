"""``flex`` with the low-rank exchange: its measured quality, its steps factor, switching in and out of it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from fake_link import WORLD, FakeLink, make_planner
from flexcomm.compress.stats import sample_positions, sample_size
from flexcomm.control.exchange import ExchangeChooser, StepSample
from flexcomm.control.probing import MAX_PROBE_STRETCH, probe_due
from flexcomm.control.quality import MIN_QUALITY, QUALITY_EVERY, measures_quality, quality_factor
from flexcomm.cost import CostEstimator, CostParams, LinkParams
from multiproc import raised, run_world
from test_lowrank import Injector, gradients

MATRIX = [(64, 50)]
SCHEDULE = ("lowrank", "agtopk", "lowrank", "dense", "artopk", "lowrank", "lowrank", "agtopk", "dense", "lowrank")


def forced(state: flexcomm.FlexState, schedule: tuple[str, ...] = SCHEDULE) -> None:
    """Make flex run ``schedule`` (by step and bucket) through its chooser."""
    state.chooser.choose = lambda bucket, step, density, world: schedule[(step + bucket) % len(schedule)]


def _quality(rank: int, world: int, steps: int) -> dict:
    model = DDP(Injector(MATRIX))
    state = flexcomm.register(model, compressor="flex", density=0.01, flex_interval=3)
    forced(state, ("lowrank",))
    updates = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(gradients(rank, step, MATRIX)).backward()
        updates.append(model.module.params[0].grad.detach().clone())
    return {"updates": updates, "records": state.drain_records()}


def test_quality_is_the_update_s_cosine_to_the_mean_gradient_on_the_shared_sample() -> None:
    steps, world = QUALITY_EVERY + 2, 2
    results = run_world(_quality, world, steps)
    numel = 64 * 50
    for step in (0, QUALITY_EVERY):
        mean = torch.stack([gradients(r, step, MATRIX)[0] for r in range(world)]).mean(0).reshape(-1)
        update = results[0]["updates"][step].reshape(-1)
        sample = sample_positions(numel, step)
        expected = torch.nn.functional.cosine_similarity(update[sample], mean[sample], dim=0).item()
        rec = results[0]["records"][step]
        assert rec.exchange == "lowrank" and rec.quality == pytest.approx(expected, abs=1e-5)
        assert results[1]["records"][step].quality == rec.quality  # computed from allreduced values on every rank
        assert 0.0 < rec.quality < 1.0


def test_the_quality_sample_rides_on_one_step_in_quality_every() -> None:
    # Between the measured steps the second allreduce carries the factors alone: no sample's bytes.
    records = run_world(_quality, 2, QUALITY_EVERY + 2)[0]["records"]
    factors = (64 + 50) * 4
    measured = [r.step for r in records if not math.isnan(r.quality)]
    assert measured == [0, QUALITY_EVERY]
    assert [r.bytes_sent for r in records] == [4 * (factors + (sample_size(64 * 50) if r.step in measured else 0))
                                               for r in records]
    assert all(r.k == factors for r in records)  # the update's payload: the step's density does not move with the sample
    assert measures_quality(3, explored=True)  # an exploration's one step always measures


def _fixed_lowrank(rank: int, world: int) -> list:
    model = DDP(Injector(MATRIX))
    state = flexcomm.register(model, compressor="lowrank")
    model(gradients(rank, 0, MATRIX)).backward()
    return state.drain_records()


def test_quality_is_measured_only_where_flex_decides() -> None:
    # A fixed low-rank compressor sends no sample (it would only add bytes): its records carry no quality.
    records = run_world(_fixed_lowrank, 2)[0]
    assert math.isnan(records[0].quality)
    assert records[0].k == (64 + 50) * 4


def _switching(rank: int, world: int) -> dict:
    model = DDP(Injector(MATRIX))
    state = flexcomm.register(model, compressor="flex", density=0.05, flex_interval=3, probe_every=100)
    forced(state)
    grads = torch.zeros(64 * 50, dtype=torch.float64)
    updates = torch.zeros_like(grads)
    for step in range(len(SCHEDULE)):
        g = gradients(rank, step, MATRIX)
        grads += g[0].reshape(-1).double()
        model.zero_grad(set_to_none=True)
        model(g).backward()
        updates += model.module.params[0].grad.reshape(-1).double()
    residual = state.memory.residual(0)
    return {"grads": grads, "updates": updates, "residual": None if residual is None else residual.double(),
            "exchanges": [r.exchange for r in state.drain_records()]}


def test_switching_in_and_out_of_low_rank_neither_drops_nor_double_counts_residuals() -> None:
    results = run_world(_switching, 4)
    assert set(results[0]["exchanges"]) == {"lowrank", "agtopk", "artopk", "dense"}
    for r in results[1:]:
        assert torch.equal(r["updates"], results[0]["updates"])
    delivered = 4 * results[0]["updates"] + sum(r["residual"] for r in results if r["residual"] is not None)
    torch.testing.assert_close(delivered, sum(r["grads"] for r in results), rtol=0, atol=1e-4)


def chooser_on(rate_bps: float, numel: int = 1_000_000, payload: tuple[int, int] | None = (20_000, 20_000)) -> ExchangeChooser:
    """A chooser whose model believes a 2-rank link of ``rate_bps``, knowing bucket 0 with its low-rank payload."""
    chooser = ExchangeChooser(CostEstimator(prior=CostParams.uniform(LinkParams.from_bandwidth(1e-4, rate_bps))))
    chooser.note_sizes(0, numel, 4, payload)
    return chooser


def lowrank_sample(chooser: ExchangeChooser, quality: float, comm: float | None = None) -> StepSample:
    """A low-rank exchange of bucket 0 measured at ``comm`` seconds (default: as the model predicts) and ``quality``."""
    comm = chooser.predicted(0, "lowrank", 0.01, 2) if comm is None else comm
    return StepSample(0, "lowrank", 0.01, 0.002, comm, 0.0, quality=quality)


def test_the_low_rank_steps_factor_is_one_over_its_measured_quality() -> None:
    chooser = chooser_on(1e9)
    assert chooser.costs(0, 0.01, 2).factor["lowrank"] == 1.0  # unmeasured: it gets tried
    chooser.observe(1, [lowrank_sample(chooser, 0.5)], 2)
    assert chooser.costs(0, 0.01, 2).factor["lowrank"] == pytest.approx(2.0)
    chooser.observe(2, [lowrank_sample(chooser, math.nan)], 2)  # not measured this time: no change
    assert chooser.costs(0, 0.01, 2).factor["lowrank"] == pytest.approx(2.0)
    assert quality_factor(0.0) == 1.0 / MIN_QUALITY and quality_factor(1.3) == 1.0
    restored = ExchangeChooser()
    restored.load_state_dict(chooser.state_dict())
    assert restored.costs(0, 0.01, 2).factor == chooser.costs(0, 0.01, 2).factor


def test_a_bucket_s_untried_local_work_is_scaled_from_another_bucket_s_measured_rate() -> None:
    chooser = chooser_on(1e9)
    chooser.note_sizes(1, 3_000_000, 4, (60_000, 60_000))
    assert chooser.costs(1, 0.01, 2).block["lowrank"] == 0.0  # measured nowhere: it gets tried
    chooser.observe(1, [StepSample(0, "lowrank", 0.01, 0.02, 0.001, 0.0, quality=0.8),
                        StepSample(1, "dense16", 0.01, 0.006, 0.01, 0.0)], 2)
    assert chooser.costs(1, 0.01, 2).block["lowrank"] == pytest.approx(0.06)  # 3x the elements, 3x the work
    assert chooser.costs(0, 0.01, 2).block["dense16"] == pytest.approx(0.002)
    assert chooser.costs(0, 0.01, 2).block["lowrank"] == pytest.approx(0.02)  # its own measurement
    assert chooser.costs(0, 0.01, 2).block["agtopk"] == 0.0  # no sparse exchange measured yet


@pytest.mark.parametrize(("quality", "chosen"), [(0.9, "lowrank"), (0.1, "artopk")])
def test_a_slow_link_takes_low_rank_only_where_its_quality_pays_for_its_bytes(quality: float, chosen: str) -> None:
    # 20 Mbit/s, a 1M-float bucket at density 0.01: AR-Topk sends 40 KB of indices and 40 KB of
    # values, low-rank two allreduces of 20 KB.  At quality 0.9 (factor 1.1) low-rank is the
    # fastest for the steps it costs; at quality 0.1 (factor 10) AR-Topk is.
    chooser = chooser_on(20e6, payload=(5_000, 5_000))
    chooser.observe(1, [lowrank_sample(chooser, quality)], 2)
    chooser.replan(0.01, 2)
    assert chooser.plan[0] == chosen


@pytest.mark.parametrize(("quality", "other", "plan"), [(0.8, 0.1, "dense16"), (0.8, 0.078, "dense16"),
                                                      (0.8, 0.07, "lowrank"), (1.0, 0.1, "lowrank")])
def test_the_guard_charges_the_plan_s_steps_factor_against_all_dense_steps(quality: float, other: float,
                                                                           plan: str) -> None:
    # The model rates low-rank far faster than dense16 at 20 Mbit; measured, whole all-dense16 steps took
    # 0.1 s.  A plan that gives up quality stays only where its period times its steps factor (1.25 at
    # quality 0.8) beats them by the hysteresis (5%): one that buys no time for it is all-dense.  At
    # quality 1 it gives up nothing, and all-dense must beat it by the hysteresis.
    chooser = chooser_on(20e6, payload=(5_000, 5_000))
    chooser.observe(1, [lowrank_sample(chooser, quality)], 2)
    chooser.replan(0.01, 2)
    assert chooser.plan[0] == "lowrank"
    chooser.observe_steps(step=20, dense=0.1, other=other)
    chooser.replan(0.01, 2)
    assert chooser.plan[0] == plan


def test_at_density_one_low_rank_stands_for_dense_where_dense_is_slow() -> None:
    slow, fast = chooser_on(20e6, payload=(5_000, 5_000)), chooser_on(100e9, payload=(5_000, 5_000))
    for chooser in (slow, fast):
        chooser.observe(1, [lowrank_sample(chooser, 0.8)], 2)
        chooser.replan(1.0, 2)
    assert slow.plan[0] == "lowrank"
    assert fast.plan[0] in ("dense", "dense16")


def test_without_the_option_or_a_matrix_low_rank_is_never_chosen() -> None:
    off = ExchangeChooser(CostEstimator(prior=CostParams.uniform(LinkParams.from_bandwidth(1e-4, 20e6))), lowrank=False)
    off.note_sizes(0, 1_000_000, 4, (5_000, 5_000))
    no_matrix = chooser_on(20e6, payload=None)
    for chooser in (off, no_matrix):
        chooser.replan(1.0, 2)
        assert chooser.plan[0] != "lowrank"
        assert math.isinf(chooser.costs(0, 1.0, 2).comm["lowrank"])
    assert "lowrank must be True or False, got 1" in raised(lambda: flexcomm.FlexState(compressor="flex", lowrank=1))


def test_trials_are_not_spent_on_a_pair_the_model_alone_rates_cheap() -> None:
    # Dense measured at 0.5 s on this bucket at 20 Mbit/s, low-rank at its modelled few ms; then the
    # fit (small messages through a shaped link's burst) believes 3 Gbit/s and rates dense within the
    # exploration and guard margins of the plan, though not below it.  The plan stays low-rank and no
    # exploration or guard trial runs dense on the model's word.
    chooser = ExchangeChooser(CostEstimator(prior=CostParams.uniform(LinkParams.from_bandwidth(1e-4, 20e6))), dense16=False)
    chooser.note_sizes(0, 1_000_000, 4, (5_000, 5_000))
    chooser.observe(1, [lowrank_sample(chooser, 0.9)], 2)
    chooser.observe(2, [StepSample(0, "dense", 1.0, 0.0, 0.5, 0.0)], 2)
    chooser.refresh()
    chooser.replan(1.0, 2)
    # The estimator now believes a 3 Gbit/s link (what a refit after a faster link's samples gives).
    chooser.estimator.load_state_dict(CostEstimator(prior=CostParams.uniform(LinkParams.from_bandwidth(1e-4, 3e9))).state_dict())
    chooser.refresh()
    chooser.replan(1.0, 2)
    costs = chooser.costs(0, 1.0, 2)
    assert chooser.plan[0] == "lowrank"
    assert costs.total("lowrank") * costs.factor["lowrank"] < costs.total("dense") < 0.01  # the model alone: close, cheap
    assert {chooser.choose(0, step, 1.0, 2) for step in range(200)} == {"lowrank"}


def test_a_probe_waits_while_it_would_cost_more_than_its_budget_of_the_plan_s_time() -> None:
    probe, plan = (lambda: 1.5), (lambda: 0.02)  # a 1.5 s probe on 20 ms steps
    assert not probe_due(199, 200, probe, plan)
    assert not probe_due(200, 200, probe, plan)  # 1.5 s > 2% of 200 x 20 ms
    assert probe_due(200, 200, (lambda: 0.05), plan)  # 50 ms <= 80 ms
    assert probe_due(200, 200, probe, (lambda: math.nan))  # no plan yet: no budget to keep
    assert probe_due(MAX_PROBE_STRETCH * 200, 200, probe, plan)  # never later than this


def test_a_bucket_index_that_changes_size_starts_unmeasured() -> None:
    # DDP's first step has its own bucket layout; after the rebuild index 0 is another, smaller bucket.
    chooser = chooser_on(1e9)
    chooser.note_sizes(1, 3_000_000, 4, (60_000, 60_000))
    chooser.observe(1, [StepSample(0, "lowrank", 0.01, 0.02, 0.001, 0.0, quality=0.1),
                        StepSample(1, "lowrank", 0.01, 0.06, 0.001, 0.0, quality=0.8)], 2)
    assert chooser.costs(0, 0.01, 2).factor["lowrank"] == pytest.approx(10.0)  # its own poor quality
    chooser.note_sizes(0, 500_000, 4, (10_000, 10_000))
    costs = chooser.costs(0, 0.01, 2)
    assert costs.factor["lowrank"] == pytest.approx(1 / 0.8)  # the other bucket's, not the old index's
    assert costs.block["lowrank"] == pytest.approx(0.06 / 3_000_000 * 500_000)  # scaled from the other bucket
    assert 0 not in chooser.plan


def test_buckets_a_step_no_longer_has_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeLink(monkeypatch.setattr, rate_bps=1e9)  # the clock and the probes
    planner = make_planner(None, None, density=0.01)
    planner.begin_step(0)
    for bucket in range(3):
        planner.plan(bucket, 1000 * (bucket + 1), 4, 0)
    assert planner.chooser.order == [0, 1, 2]
    planner.begin_step(1)
    for bucket in range(2):  # rebuilt into two buckets of the same sizes as before
        planner.plan(bucket, 1000 * (bucket + 1), 4, 1)
    planner.begin_step(2)
    assert planner.chooser.order == [0, 1]


def test_the_first_step_s_exchanges_do_not_rate_an_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    link = FakeLink(monkeypatch.setattr, rate_bps=1e9, select=0.5)  # step 0: one-time costs in the selection
    planner = make_planner(None, None, density=0.01)
    _, first = link.step(planner, 0)
    assert first in ("agtopk", "artopk")
    link.select = 0.004
    link.run(planner, range(1, 12))
    assert planner.chooser.costs(0, 0.01, WORLD).block[first] < 0.05
