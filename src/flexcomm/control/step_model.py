"""The step a plan makes: backward, each bucket's local work, and one group's collectives in turn.

DDP hands buckets to the hook in a fixed order while backward runs.  For bucket ``b`` (in
that order) and exchange ``e`` the model holds, from measurements agreed across ranks:

* ``block[b, e]``: local work on the critical path, max over ranks -- selection, packing
  and write-back (for AR-Topk every follower waits for the leader's selection); dense16's
  casts.  Dense: 0;
* ``comm[b, e]``: the collectives' own time (service time: queueing behind the previous
  bucket's collectives removed), min over ranks;
* ``gap[b]``: backward compute between bucket ``b``'s hook call and the next one, max over
  ranks (the same whatever is chosen).

One process group runs its collectives one after another, so with ``t`` the autograd
thread's clock and ``free`` the time the group is next idle:

    t = free = 0
    for b in order:  t += block[b, e_b];  free = max(t, free) + comm[b, e_b];  t += gap[b]
    step = max(t, free)

``step`` is backward plus what the exchanges add to it: a dense bucket early in backward
costs nothing while its allreduce hides behind the rest of backward, a selection costs its
full time, the last buckets' collectives are exposed.  The plan is the choice vector with
the smallest ``step * factor``, by coordinate descent from the current plan (one bucket's
exchange changes at a time, only for a gain above ``hysteresis``): ``factor`` is the mean,
weighted by bucket size, of each chosen exchange's steps factor (:mod:`flexcomm.control.quality`:
how many more steps an exchange that sends less than each rank's own top-k costs; 1 unless
measured), so the plan minimises the time to accuracy, not the step alone.

Plain Python on agreed inputs: every rank simulates alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flexcomm.cost import DENSE_EXCHANGES, EXCHANGES

#: The low-rank exchange: its cost follows the bucket's matrices, not a density.
LOW_RANK = "lowrank"
#: Every exchange, in the cost model's tie-break order (low-rank last): on an equal step the earlier wins.
EXCHANGE_ORDER: tuple[str, ...] = (*EXCHANGES, LOW_RANK)
#: The exchanges that select k elements (the dense ones send the whole bucket, low-rank its factors).
SPARSE = tuple(e for e in EXCHANGES if e not in DENSE_EXCHANGES)


@dataclass(frozen=True)
class BucketCosts:
    """One bucket's inputs to :func:`simulate_step`: per-exchange blocking and comm seconds, and the gap after it;
    to :func:`plan_cost` also per-exchange steps factors (absent: 1) and the bucket's weight (its size)."""

    block: Mapping[str, float]
    comm: Mapping[str, float]
    gap: float
    factor: Mapping[str, float] = field(default_factory=dict)
    weight: float = 1.0

    def total(self, exchange: str) -> float:
        return self.block[exchange] + self.comm[exchange]


def simulate_step(buckets: Sequence[BucketCosts], choice: Sequence[str]) -> float:
    """Backward plus the exposed exchanges under ``choice`` (one exchange per bucket, in hook order)."""
    t = free = 0.0
    for costs, exchange in zip(buckets, choice):
        t += costs.block[exchange]
        free = max(t, free) + costs.comm[exchange]
        t += costs.gap
    return max(t, free)


def plan_factor(buckets: Sequence[BucketCosts], choice: Sequence[str]) -> float:
    """The size-weighted mean steps factor of ``choice``: how many more steps its updates cost (1: none)."""
    weight = sum(b.weight for b in buckets)
    return sum(b.weight * b.factor.get(e, 1.0) for b, e in zip(buckets, choice)) / weight if weight > 0 else 1.0


def plan_cost(buckets: Sequence[BucketCosts], choice: Sequence[str]) -> float:
    """:func:`simulate_step` times :func:`plan_factor` of ``choice``: time to accuracy, relatively."""
    return simulate_step(buckets, choice) * plan_factor(buckets, choice)


def best_plan(buckets: Sequence[BucketCosts], current: Sequence[str], hysteresis: float) -> list[str]:
    """Coordinate descent from ``current``: switch one bucket at a time while :func:`plan_cost` falls by > ``hysteresis``."""
    plan = list(current)
    best = plan_cost(buckets, plan)
    improved = True
    while improved:
        improved = False
        for i in range(len(buckets)):
            for exchange in EXCHANGE_ORDER:
                if exchange == plan[i]:
                    continue
                trial = plan[:i] + [exchange] + plan[i + 1:]
                cost = plan_cost(buckets, trial)
                if cost < best * (1.0 - hysteresis):
                    plan, best, improved = trial, cost, True
    return plan
