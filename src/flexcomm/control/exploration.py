"""Exploration: which bucket tries which alternative exchange, at which steps.

The plan's own choices are measured at every step; an alternative is only measured when it
is tried.  Every ``explore_every * scale`` steps one bucket (by the step counter) runs its
least recently measured alternative -- if the model predicts the step with that alternative
within ``margin`` (50%) of the plan's, or, for an alternative never measured on that bucket,
within ``2 * margin + 1`` (3x the plan's step): a wrong model corrects itself within a few
cycles over the buckets at a bounded price, and clearly worse choices (dense on a slow link)
are never tried.  A bucket whose new plan waits for a trial (``wanted``) tries that first.

Back-off: ``scale`` doubles, up to :data:`MAX_BACKOFF`, at every replan that kept the plan
after the agreed samples of an exploration came in (the exploration confirmed it), and
returns to 1 when the plan changes (a new density counts as a change) or a new plan waits
for its trial.  A link change that the model sees changes the plan and so resets it; one
only an exploration would reveal waits up to ``explore_every * MAX_BACKOFF`` steps per bucket.
The model rates a measured alternative within ``margin`` (an unmeasured one within
``2 * margin + 1``) of the plan before trying it, so on a steady link, once every alternative
is measured, explorations cost about ``margin / (explore_every * MAX_BACKOFF)`` of the run
(1.25% with the defaults) as far as the model is right.  Before, one bucket of the MLP at
1 Gbit tried fp32 dense every 10 steps, 5-10 ms on 16-20 ms steps, the whole run long;
measured with the back-off (``benchmarks/adaptive_e2e.py --group mlp``, at 8226893): 1.1% of
flex 0.01's training time, 3.1% of flex + auto's (its density switches reset the back-off).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from flexcomm.control.step_model import EXCHANGE_ORDER, SPARSE, BucketCosts, plan_cost

#: The largest factor the exploration interval backs off to on a plan that keeps being confirmed.
MAX_BACKOFF = 4


def exploration(step: int, every: int, margin: float, order: Sequence[int], plan: Mapping[int, str],
                wanted: Mapping[int, str], costs: Sequence[BucketCosts],
                measured_at: Mapping[tuple[int, str], int]) -> tuple[int, str] | None:
    """The (bucket, alternative) explored at ``step``, a multiple of ``every`` (the interval in force), or
    None; ``plan`` holds every bucket of ``order``."""
    position = (step // every) % len(order)
    bucket = order[position]
    trial = wanted.get(bucket)
    if trial is not None and trial != plan[bucket]:
        return bucket, trial
    planned = [plan[b] for b in order]
    now = plan_cost(costs, planned)

    def worth_a_try(e: str) -> bool:
        # A model that never saw e run here may be far off: a wider margin, once.
        allowed = margin if (bucket, e) in measured_at else 2.0 * margin + 1.0
        return plan_cost(costs, planned[:position] + [e] + planned[position + 1:]) <= now * (1.0 + allowed)

    cheap = [e for e in EXCHANGE_ORDER if e != plan[bucket] and worth_a_try(e)]
    if not cheap:
        return None
    return bucket, min(cheap, key=lambda e: (measured_at.get((bucket, e), -1), EXCHANGE_ORDER.index(e)))


def backed_off(scale: int, plan_changed: bool, waiting: bool, confirmed: bool) -> int:
    """The interval's factor after a replan: 1 on a new plan or one waiting for its trial, doubled
    (up to :data:`MAX_BACKOFF`) when an exploration whose agreed samples came in since the last
    replan left the plan as it was (``confirmed``)."""
    if plan_changed or waiting:
        return 1
    return min(2 * scale, MAX_BACKOFF) if confirmed else scale


def at_least_measured(costs: Sequence[BucketCosts], order: Sequence[int], last_measured: Mapping[tuple[int, str], float],
                      measured_at: Mapping[tuple[int, str], tuple[float, int]], density: float, world: int) -> list[BucketCosts]:
    """``costs`` (in ``order``) where a pair costs at least ``last_measured`` -- if measured at this world size
    and, for a sparse exchange, at this density (``measured_at``: its (density, world)).

    What explorations and the guard's trials are rated by.  The fit follows the small messages a
    compressed plan sends (a shaped link lets them through its burst faster than its rate) and can
    rate dense cheap again after it measured 20x the plan's step: with a low-rank plan of 20 ms
    steps at 20 Mbit, one 450-720 ms dense exploration every ~40 steps and 3-step dense16 guard
    trials of 550 ms.  A pair the model rates far below its measurement is still tried once, as
    the plan's wanted trial (:data:`flexcomm.control.exchange.TRUST_DRIFT`).
    """
    adjusted = []
    for bucket, bucket_costs in zip(order, costs):
        comm = dict(bucket_costs.comm)
        for exchange in comm:
            seconds, at = last_measured.get((bucket, exchange)), measured_at.get((bucket, exchange))
            if seconds is not None and at is not None and at[1] == world and (exchange not in SPARSE or at[0] == density):
                comm[exchange] = max(comm[exchange], seconds)
        adjusted.append(replace(bucket_costs, comm=comm))
    return adjusted
