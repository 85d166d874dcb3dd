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
the smallest ``step``, by coordinate descent from the current plan (one bucket's exchange
changes at a time, only for a gain above ``hysteresis``).

Plain Python on agreed inputs: every rank simulates alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flexcomm.cost import DENSE_EXCHANGES, EXCHANGES

#: Every exchange, in the cost model's tie-break order: on an equal step the earlier wins.
EXCHANGE_ORDER = EXCHANGES
#: The exchanges that select k elements (the others send the whole bucket).
SPARSE = tuple(e for e in EXCHANGES if e not in DENSE_EXCHANGES)


@dataclass(frozen=True)
class BucketCosts:
    """One bucket's inputs to :func:`simulate_step`: per-exchange blocking and comm seconds, and the gap after it."""

    block: Mapping[str, float]
    comm: Mapping[str, float]
    gap: float

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


def best_plan(buckets: Sequence[BucketCosts], current: Sequence[str], hysteresis: float) -> list[str]:
    """Coordinate descent from ``current``: switch one bucket at a time while the step gets faster by > ``hysteresis``."""
    plan = list(current)
    best = simulate_step(buckets, plan)
    improved = True
    while improved:
        improved = False
        for i in range(len(buckets)):
            for exchange in EXCHANGE_ORDER:
                if exchange == plan[i]:
                    continue
                trial = plan[:i] + [exchange] + plan[i + 1:]
                seconds = simulate_step(buckets, trial)
                if seconds < best * (1.0 - hysteresis):
                    plan, best, improved = trial, seconds, True
    return plan
