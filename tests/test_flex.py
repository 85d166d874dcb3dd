"""The ``flex`` exchange: the cheapest exchange by the cost model, the same on every rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from flexcomm.comm import allreduce_floats, probe_collectives
from flexcomm.control import ExchangeChooser
from flexcomm.cost import CostEstimator, CostParams, LinkParams
from multiproc import run_world
from test_hook_distributed import M, exchange, gradient, hooked_model

GBIT = 8 / 1e9  # seconds per byte at 1 Gbit/s


def chooser_for(alpha: float, beta: float) -> ExchangeChooser:
    return ExchangeChooser(CostEstimator(prior=CostParams.uniform(LinkParams(alpha, beta))))


def test_fast_link_keeps_dense() -> None:
    # 25M-element bucket at density 0.01, 100 Gbit/s, 10 us: dense ~8 ms, and a top-k selection
    # of 50 ms (measured order of magnitude on CPU) makes either sparse exchange slower.
    chooser = chooser_for(1e-5, GBIT / 100)
    chooser.observe_compression(0, 0.05)
    assert chooser.choose(0, 25_000_000, 0.01, 4, 4).exchange == "dense"


def test_slow_link_many_ranks_picks_artopk() -> None:
    # 100 Mbit/s, 64 ranks, 25M elements at 0.01: the allgather moves 63 * 2 MB, AR-Topk ~2 MB.
    chooser = chooser_for(1e-4, GBIT * 10)
    assert chooser.choose(0, 25_000_000, 0.01, 64, 4).exchange == "artopk"


def test_high_latency_tiny_message_picks_allgather() -> None:
    # 5 ms latency, k = 10: one allgather (N-1 latency terms) beats a broadcast plus a ring
    # allreduce (log2 N + 2(N-1) latency terms).
    chooser = chooser_for(5e-3, GBIT)
    assert chooser.choose(0, 1000, 0.01, 8, 4).exchange == "agtopk"


def test_compression_time_counts_against_sparse_exchanges() -> None:
    chooser = chooser_for(1e-4, GBIT)
    before = chooser.choose(3, 1_000_000, 0.01, 2, 4)
    assert before.exchange != "dense"
    chooser.observe_compression(3, 1.0)
    after = chooser.choose(3, 1_000_000, 0.01, 2, 4)
    assert after.exchange == "dense"
    assert after.predicted["artopk"] == pytest.approx(before.predicted["artopk"] + 1.0)


def test_hysteresis_keeps_the_current_exchange_on_a_near_tie() -> None:
    chooser = chooser_for(1e-4, GBIT)
    best = chooser.choose(0, 1_000_000, 0.01, 2, 4)
    runner_up = sorted(best.predicted, key=best.predicted.__getitem__)[1]
    margin = best.predicted[runner_up] / best.predicted[best.exchange] - 1
    chooser.keep(0, runner_up)
    expected = runner_up if margin <= chooser.hysteresis else best.exchange
    assert chooser.choose(0, 1_000_000, 0.01, 2, 4).exchange == expected
    chooser.hysteresis = margin / 2  # now the runner-up is clearly slower: switch
    assert chooser.choose(0, 1_000_000, 0.01, 2, 4).exchange == best.exchange


def test_chooser_state_round_trip() -> None:
    chooser = chooser_for(1e-4, GBIT)
    chooser.estimator.observe("allreduce", 1 << 20, 2, 0.02)
    chooser.observe_compression(0, 0.003)
    chooser.refresh()
    restored = ExchangeChooser()
    restored.load_state_dict(chooser.state_dict())
    assert restored.choose(0, 10**6, 0.01, 2, 4) == chooser.choose(0, 10**6, 0.01, 2, 4)


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
    assert sorted(kinds) == sorted((k, n) for n in (64, 4096) for k in ("allreduce", "allgather", "broadcast"))


def _flex_run(rank: int, world: int, steps: int) -> dict:
    model, state = hooked_model(compressor="flex", density=0.01, flex_interval=2, probe_every=5)
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


def test_flex_decisions_identical_on_four_ranks_with_different_timings() -> None:
    results = run_world(_flex_run, 4, 9)
    assert len(results[0]["decisions"]) == 9
    for r in results[1:]:
        assert r["decisions"] == results[0]["decisions"]
        assert r["predicted"] == results[0]["predicted"]
        assert r["estimator"] == results[0]["estimator"]
    # The local measurements really did differ, so agreement is not an accident.
    assert len({tuple(r["measured"]) for r in results}) > 1
    # Probes at steps 0 and 5 (2 probes x 2 sizes x 3 kinds), then the agreed exchange timings.
    counts = [est["count"] for est in results[0]["estimator"]["estimator"].values()]
    assert sum(counts) > 2 * 2 * 3
    assert all(p > 0 for p in results[0]["predicted"])


def _flex_update(rank: int, world: int) -> torch.Tensor:
    model, _ = hooked_model(compressor="flex", density=1.0)
    return exchange(model, gradient(rank, 0))


def test_flex_at_full_density_equals_dense_average() -> None:
    results = run_world(_flex_update, 2)
    dense = torch.stack([gradient(r, 0) for r in range(2)]).mean(0)
    for update in results:
        torch.testing.assert_close(update, dense)
    assert update.numel() == M
