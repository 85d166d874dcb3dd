"""Online estimation of ``alpha`` and ``beta`` for every collective kind, one
:class:`~flexcomm.cost.link_fit.AlphaBetaEstimator` per kind (its module states the fit).

Regime shifts.  Forgetting follows a link that changed only as fast as new samples of each
kind come in, and a kind the plan does not use gets none: after a drop from 1 Gbit/s to
100 Mbit/s the allreduces of all-dense steps refitted that kind within an interval while the
allgather's fit stayed at 1 Gbit/s, so AG-Topk was rated fast, chosen, and ran 56-93 ms steps
for an interval where low-rank steps took 22 ms (MLP group, seed 3, at 639773f).  So a batch of
samples (one agreement point's) is read before it is fed.  A kind whose ``SHIFT_MIN_SAMPLES``
newest bandwidth-bound samples (the fit's latency term at most ``1 - BANDWIDTH_BOUND`` of the
predicted or the measured time) each have a ``beta`` ratio -- measured time less the fit's
latency term, over its bandwidth term -- over ``SHIFT`` shows a link that slowed down (the
newest: an interval can span the change).  That kind's fit moves to ``(alpha, r beta)``, ``r``
the median of those ratios, and every kind without such samples in the batch to the shifted
kind's new ``beta`` times the ratio of their old betas (within ``KIND_SPREAD``): the kinds share
one link.  The move rebases the sums (``r := M theta' - p (1, 1)``, so the solution is exactly
``theta'`` with the samples' weights kept) before the batch itself is fed.  Only slower: on a
shaped link, messages that fit in its burst pass faster than its rate, so a kind fitted on
large messages would read its smaller ones as a faster link and move every kind there until
the next large message moved them back; a link that came back is learned by forgetting (sparse
steps, the choice of a slow link, stay fast on it meanwhile).

Agreement across ranks.  The arithmetic is plain Python floats in a fixed order, so
estimators fed identical samples in identical order hold bitwise identical state.  The
communication layer should (1) time each collective locally, (2) combine the per-rank
times with MAX -- the collective is done when its slowest rank is, and a broadcast timed at
its root alone is meaningless -- e.g. one ``all_reduce(MAX)`` of a small tensor of times
per step, or :func:`merge_observations` after an allgather of the sample lists, and (3) feed
the merged samples to every rank's estimator in the same order.  Broadcasting rank 0's
``state_dict`` is the alternative when ranks may have diverged (e.g. after a restore).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from flexcomm.cost.link_fit import DEFAULT_PRIOR, PRIOR_WEIGHT, AlphaBetaEstimator
from flexcomm.cost.model import KINDS, Algorithms, CollectiveKind, CostParams

#: Beta ratios (measured over fitted bandwidth time) all over this factor show a link that slowed down
#: (the guard's ``JUMP``): 1 Gbit/s <-> 100 Mbit/s is 10x, timing noise on a busy CPU under 2x.
SHIFT = 3.0
#: A shift is called on this many of a kind's newest bandwidth-bound samples in a batch, each over
#: ``SHIFT``: one slow sample is noise.  Two, because an interval often holds only a few
#: steps after the change, and a plan that mixes exchanges gives a kind one sample per step (MLP
#: group, seed 5: two slow steps before the agreement; the plan then ran fp32 dense on one bucket,
#: whose pair followed the old fit, at 100 ms per step against 20 ms for the low-rank plan after).
#: A false call costs one interval: the next batch shifts the fits back.
SHIFT_MIN_SAMPLES = 2
#: How far apart two kinds' betas may stay when one follows the other's shift (gloo's allgather
#: measured ~1.5x its allreduce per byte here; an old fit can be further off where it was poorly identified).
KIND_SPREAD = 2.0


class Observation(NamedTuple):
    """One timed collective: ``seconds`` for ``nbytes`` (per rank for allgather) on ``world_size`` ranks."""

    kind: CollectiveKind
    nbytes: int
    world_size: int
    seconds: float



class CostEstimator:
    """One :class:`AlphaBetaEstimator` per collective kind, producing a :class:`CostParams`.

    ``prior`` supplies each kind's starting ``(alpha, beta)`` and the algorithms whose
    coefficients are fitted (gloo's by default).
    """

    def __init__(self, prior: CostParams | None = None, forgetting: float = 0.97,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        prior = prior if prior is not None else CostParams.uniform(DEFAULT_PRIOR)
        self.estimators: dict[CollectiveKind, AlphaBetaEstimator] = {
            kind: AlphaBetaEstimator(
                kind,
                forgetting=forgetting,
                algorithm=prior.algorithms.of(kind),
                prior=prior.link(kind),
                prior_weight=prior_weight,
            )
            for kind in KINDS
        }

    def observe(self, kind: CollectiveKind, nbytes: int, world_size: int, seconds: float) -> None:
        """Add one timed collective of ``kind``."""
        if kind not in self.estimators:
            raise ValueError(f"unknown collective kind {kind!r}")
        self.estimators[kind].observe(nbytes, world_size, seconds)

    def observe_all(self, observations: Iterable[Observation]) -> None:
        """Add samples in order (feed every rank the same merged list to keep ranks identical)."""
        for obs in observations:
            self.observe(obs.kind, obs.nbytes, obs.world_size, obs.seconds)

    def observe_batch(self, observations: Iterable[Observation]) -> dict[CollectiveKind, float]:
        """Add one agreed batch in order, first moving each kind's fit if the batch shows a change of regime
        (module docstring, "Regime shifts"); returns the factor each kind's ``beta`` was moved by."""
        batch = list(observations)
        shifts = self.regime_shift(batch)
        for kind, factor in shifts.items():
            self.estimators[kind].shift_beta(factor)
        self.observe_all(batch)
        return shifts

    def regime_shift(self, batch: Sequence[Observation]) -> dict[CollectiveKind, float]:
        """The ``beta`` factor per kind that ``batch`` calls for (empty: no change of regime)."""
        ratios: dict[CollectiveKind, list[float]] = {}
        for obs in batch:
            ratio = self.estimators[obs.kind].beta_ratio(obs.nbytes, obs.world_size, obs.seconds)
            if ratio is not None:
                ratios.setdefault(obs.kind, []).append(ratio)
        # The newest samples: a batch can span the change (the plan may also leave a kind right after it).
        newest = {kind: r[-SHIFT_MIN_SAMPLES:] for kind, r in ratios.items() if len(r) >= SHIFT_MIN_SAMPLES}
        shifted = {kind: statistics.median(r) for kind, r in newest.items() if min(r) > SHIFT}
        if not shifted:
            return {}
        # The kinds without evidence follow the most sampled shifted kind's new beta, keeping their ratio
        # to its old one within KIND_SPREAD (a fit that was poorly identified is not amplified).
        ref = max(shifted, key=lambda kind: (len(ratios[kind]), -KINDS.index(kind)))
        ref_beta = self.estimators[ref].params.beta
        factors = dict(shifted)
        for kind in KINDS:
            beta = self.estimators[kind].params.beta
            if kind not in newest:  # every fitted beta is > 0 (the fit's floor)
                relative = min(KIND_SPREAD, max(1.0 / KIND_SPREAD, beta / ref_beta))
                factors[kind] = ref_beta * shifted[ref] * relative / beta
        return factors

    @property
    def params(self) -> CostParams:
        """Current estimates of every kind, with the algorithms they were fitted for."""
        est = self.estimators
        return CostParams(
            allreduce=est["allreduce"].params,
            allgather=est["allgather"].params,
            broadcast=est["broadcast"].params,
            algorithms=Algorithms(**{kind: est[kind].algorithm for kind in KINDS}),
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain, picklable state of all kinds."""
        return {kind: est.state_dict() for kind, est in self.estimators.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of every kind."""
        missing = set(KINDS) - set(state)
        if missing:
            raise ValueError(f"state lacks kinds {sorted(missing)}")
        for kind, est in self.estimators.items():
            est.load_state_dict(state[kind])


def merge_observations(per_rank: Sequence[Sequence[Observation]]) -> list[Observation]:
    """Combine every rank's samples of the same collectives into one list, time = max over ranks.

    ``per_rank[i]`` is rank ``i``'s list (e.g. from ``all_gather_object``); all lists must
    describe the same collectives in the same order.  Every rank that feeds the result to
    its estimator ends with the same state.
    """
    if not per_rank:
        return []
    length = len(per_rank[0])
    if any(len(samples) != length for samples in per_rank):
        raise ValueError("ranks observed different numbers of collectives")
    merged = []
    for column in zip(*per_rank):
        first = column[0]
        if any(obs[:3] != first[:3] for obs in column):
            raise ValueError(f"ranks disagree on a collective: {column}")
        merged.append(first._replace(seconds=max(obs.seconds for obs in column)))
    return merged
