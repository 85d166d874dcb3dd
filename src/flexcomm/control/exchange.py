"""Which exchange each bucket uses: the plan that makes the whole step fastest (``flex``).

The step a plan makes is simulated by :mod:`flexcomm.control.step_model`: backward runs on,
each bucket's local work holds it, one group runs the collectives one after another.  The plan
is the choice vector with the smallest simulated step times its steps factor, by coordinate
descent from the current plan (one bucket's exchange changes at a time, only for a gain above
``hysteresis``).  The steps factor charges AR-Topk for sending the followers' values at the
leader's indices rather than their own top-k (:mod:`flexcomm.control.quality`), measured per
bucket from the agreed energy fractions sent: at one density AR-Topk is taken only where it
saves more time than the extra steps it costs.  The low-rank exchange pays ``1 / quality``, its
measured cosine to the mean gradient; it is a choice at every density (at 1.0 it stands for
dense where dense's bytes cost more than its extra steps), for buckets with a matrix to factor.

``comm`` is the alpha-beta model times the calibration ``kappa[b, e]`` of
:mod:`flexcomm.control.calibration` (measured over modelled, rebased at every refit for the
pairs measured since the last one).

``block`` of an unmeasured sparse pair scales the measured seconds per element of sparse
exchanges; unmeasured dense16 and low-rank pairs, and sparse ones before any measurement,
block 0 (optimistic: they get tried).  An exchange that cannot help a bucket costs infinity.
Measurements are plain EWMAs: the plan's own pairs follow a change within one interval, single
slow samples (frequent on a busy CPU) do not flip it.

Trial before adoption: a pair measured before the last interval that the refitted model now
rates ``TRUST_DRIFT`` times below its last measurement is not adopted on the model's word; the
bucket tries it first at its next exploration (a fit dominated by one message size once rated
dense at 100 Mbit at 2 ms, and whole intervals of dense ran at 10-20x the sparse step).
Explorations (:mod:`flexcomm.control.exploration`: every ``explore_every`` steps, backed off up
to 4x while they confirm the plan, one bucket tries an alternative rated within
``explore_margin``) and the guard's trials (:mod:`flexcomm.control.guard`: all-dense steps
measured faster than the plan's make the plan all-dense, dense16 where allowed) rate a pair at
no less than it last measured (:func:`~flexcomm.control.exploration.at_least_measured`).

Everything is plain Python on agreed inputs in a fixed order: every rank plans alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexcomm.control.calibration import Calibration
from flexcomm.control.exploration import at_least_measured, backed_off, exploration
from flexcomm.control.guard import arm_exchange, guard_trial, smoothed_periods
from flexcomm.control.measurements import StepSample
from flexcomm.control.quality import quality_factor, steps_factor
from flexcomm.control.step_model import (EXCHANGE_ORDER, LOW_RANK, SPARSE, BucketCosts, best_plan, plan_factor,
                                         simulate_step)
from flexcomm.control.tables import drop_buckets, own_or_mean, pairs, unpairs
from flexcomm.cost import HALF_BYTES, CostEstimator, CostParams, lowrank_time, predict_exchange_times

#: A measured pair the model now rates this many times faster than it last measured is tried before a plan adopts it.
TRUST_DRIFT = 1.5


@dataclass(frozen=True)
class Choice:
    """One bucket's exchange and the predicted blocking + comm seconds of every exchange."""

    exchange: str
    predicted: dict[str, float]
    #: Whether this is an exploration: not the plan a guard or the model chose for the step.
    explored: bool = False


class ExchangeChooser:
    """Measured and modelled costs per (bucket, exchange), and the plan that minimises the step.

    Args:
        estimator: the online (alpha, beta) estimate; its parameters are taken at :meth:`refresh`.
        smoothing: EWMA factor of the measurements (weight of the old value).
        hysteresis: relative gain a new plan needs over the current one.
        explore_every: steps between explorations (0: never explore).
        explore_margin: an alternative is explored only if the model's step with it is within
            this fraction of the plan's step.
        guard_every: steps between the guard's trials (0: no guard; see :meth:`replan`).
        dense16: whether ``dense16`` (the bucket allreduced in fp16) is among the choices.
        lowrank: whether ``lowrank`` (rank-r factors, two allreduces) is among the choices.
    """

    def __init__(self, estimator: CostEstimator | None = None, smoothing: float = 0.7, hysteresis: float = 0.05,
                 explore_every: int = 10, explore_margin: float = 0.5, guard_every: int = 25, dense16: bool = True,
                 lowrank: bool = True) -> None:
        self.estimator = estimator or CostEstimator()
        self.params: CostParams = self.estimator.params
        self.smoothing = smoothing
        self.hysteresis = hysteresis
        self.explore_every = explore_every
        self.explore_margin = explore_margin
        self.guard_every = guard_every
        self.dense16 = dense16
        self.lowrank = lowrank
        #: bucket -> (numel, value bytes) of the buckets of the current layout.
        self.sizes: dict[int, tuple[int, int]] = {}
        #: bucket -> elements of the low-rank exchange's two allreduces (absent: nothing to factor).
        self.factor_sizes: dict[int, tuple[int, int]] = {}
        self.plan: dict[int, str] = {}
        #: The density :attr:`plan` was made for (a plan for another density must not run).
        self.plan_density: float | None = None
        self._block: dict[tuple[int, str], float] = {}
        self._calibration = Calibration(smoothing)
        self._gap: dict[int, float] = {}
        self._measured_at: dict[tuple[int, str], int] = {}
        # The guard: measured whole-step periods of all-dense steps (its arm) and of the others, (seconds, step).
        self.measured_steps: dict[str, tuple[float, int]] = {}
        self._simulated_plan: dict[int, str] = {}
        # bucket -> the exchange a replan wanted but must try first (see TRUST_DRIFT).
        self._wanted: dict[int, str] = {}
        # (step, bucket) of the last exploration; whether its agreed samples came in since the last
        # replan; the back-off of the exploration interval.
        self._explored: tuple[int, int] | None = None
        self._exploration_seen = False
        self._explore_scale = 1
        # Steps factor of AR-Topk pairs (EWMA): the followers send less than their own top-k.
        self._factor: dict[tuple[int, str], float] = {}
        # cos(update, mean gradient) of low-rank pairs (EWMA): their steps factor.
        self._quality: dict[tuple[int, str], float] = {}
        # costs() per (bucket, density, world) until an input changes: every bucket of every step asks
        # for its own twice, and a step's plan for all of them, while the inputs change at agreement points.
        self._costs: dict[tuple[int, float, int], BucketCosts] = {}

    def settings(self) -> dict[str, object]:
        """Every option that changes a plan: ranks whose settings differ would plan differently."""
        return {"smoothing": self.smoothing, "hysteresis": self.hysteresis, "explore_every": self.explore_every,
                "explore_margin": self.explore_margin, "guard_every": self.guard_every, "dense16": self.dense16,
                "lowrank": self.lowrank}

    @property
    def order(self) -> list[int]:
        """The buckets in hook order (DDP hands them over by index)."""
        return sorted(self.sizes)

    def refresh(self) -> None:
        """Take the estimator's current (alpha, beta) for the next predictions (at agreement points).

        The calibration of every pair measured since the last refresh is rebased to the new
        parameters, so that its prediction at the density it was measured at stays what the
        measurements made it; the others follow the model.
        """
        params = self.estimator.params
        self._costs.clear()
        self._calibration.rebase(lambda b, e, d, w, p: self._modelled(b, d, w, p)[e], self.params, params, set(self.sizes))
        self.params = params

    # -- measurements ---------------------------------------------------------------------
    def observe(self, step: int, samples: Sequence[StepSample], world: int) -> None:
        """Fold one step's agreed samples in (same order on every rank)."""
        self._costs.clear()
        for s in samples:
            key = (s.bucket, s.exchange)
            model = self._modelled(s.bucket, s.density, world, self.params)[s.exchange]
            self._calibration.observe(key, s.comm / model if model > 0 else 1.0, s.density, world)
            self._smooth(self._block, key, s.block)
            self._smooth(self._gap, s.bucket, s.gap)
            self._measured_at[key] = step
            if self._explored == (step, s.bucket):
                self._exploration_seen = True
            factor = steps_factor(s.kept_min, s.kept_max) if s.exchange == "artopk" else None
            if factor is not None:
                self._smooth(self._factor, key, factor)
            if s.exchange == LOW_RANK and math.isfinite(s.quality):
                self._smooth(self._quality, key, s.quality)

    def _smooth(self, table: dict, key: Any, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.smoothing * old + (1.0 - self.smoothing) * value

    # -- predictions ----------------------------------------------------------------------
    def _modelled(self, bucket: int, density: float, world: int, params: CostParams) -> dict[str, float]:
        """The alpha-beta model's comm seconds of every exchange of ``bucket`` (uncalibrated)."""
        numel, vb = self.sizes[bucket]
        modelled: dict[str, float] = dict(predict_exchange_times(numel, density, world, params, vb))
        payload = self.factor_sizes.get(bucket)
        modelled[LOW_RANK] = lowrank_time(*payload, world, params) if payload else math.inf
        return modelled

    def costs(self, bucket: int, density: float, world: int) -> BucketCosts:
        """Predicted blocking and comm seconds of every exchange of ``bucket`` at ``density``."""
        key = (bucket, density, world)
        cached = self._costs.get(key)
        if cached is None:
            cached = self._costs[key] = self._costs_now(bucket, density, world)
        return cached

    def _costs_now(self, bucket: int, density: float, world: int) -> BucketCosts:
        numel, vb = self.sizes[bucket]
        modelled = self._modelled(bucket, density, world, self.params)
        comm = {e: self._calibration.of(bucket, e) * modelled[e] if self._usable(bucket, e, vb, density) else math.inf
                for e in EXCHANGE_ORDER}
        block = {e: self._block_for(bucket, e, numel) for e in EXCHANGE_ORDER}
        factors = {"artopk": self._factor_for(bucket), LOW_RANK: quality_factor(own_or_mean(self._quality, bucket, LOW_RANK))}
        return BucketCosts(block, comm, self._gap.get(bucket, 0.0), factors, float(numel))

    def step_costs(self, density: float, world: int) -> list[BucketCosts]:
        return [self.costs(b, density, world) for b in self.order]

    def _usable(self, bucket: int, exchange: str, value_bytes: int, density: float) -> bool:
        """Whether ``exchange`` can help: sparse ones below density 1 (sending every index only adds bytes),
        ``dense16`` when enabled and the gradient is wider than 16 bits, ``lowrank`` when enabled and the
        bucket has a matrix to factor, at any density: charged by its measured quality, it stands for dense
        where dense costs more than the steps it saves.  An unusable one costs inf."""
        if exchange in SPARSE:
            return density < 1.0
        if exchange == LOW_RANK:
            return self.lowrank and bucket in self.factor_sizes
        if exchange == "dense16":
            return self.dense16 and value_bytes > HALF_BYTES
        return True

    def _factor_for(self, bucket: int) -> float:
        """AR-Topk's steps factor on ``bucket`` (1 until measured anywhere: it gets tried)."""
        return own_or_mean(self._factor, bucket, "artopk")

    def _block_for(self, bucket: int, exchange: str, numel: int) -> float:
        """The bucket's measured local work of ``exchange``, else the slowest per-element rate measured on another
        bucket by an exchange of its kind (any sparse one for a sparse exchange) times ``numel``, else 0
        (optimistic: it gets tried).  Without the scaled rate every bucket's first low-rank trial was rated at
        its collectives alone: 1-8 ms predicted against 40-80 ms of factoring per 6.25M-float bucket
        (``benchmarks/flex_step.py``), tried again on each bucket."""
        own = self._block.get((bucket, exchange))
        if own is not None:
            return own
        kin = SPARSE if exchange in SPARSE else (exchange,)
        rates = [t / self.sizes[b][0] for (b, e), t in sorted(self._block.items())
                 if e in kin and b in self.sizes and self.sizes[b][0] > 0]
        return max(rates) * numel if rates else 0.0

    # -- decisions ------------------------------------------------------------------------
    def replan(self, density: float, world: int) -> None:
        """Re-decide the plan of every known bucket (at an agreement point).

        The guard: the simulation leaves out that collectives and compute share the CPU, so
        when whole all-dense steps (plain DDP's behaviour) measured faster than the plan's
        steps times the plan's steps factor, the plan is all-dense, whatever the simulation says.
        """
        if not self.order:
            return
        before, density_before = dict(self.plan), self.plan_density
        self.plan_density = density
        costs = self.step_costs(density, world)
        current = self._start(costs, self._simulated_plan)
        proposed = best_plan(costs, current, self.hysteresis)
        self._wanted = {b: new for b, old, new in zip(self.order, current, proposed)
                        if new != old and self._drifted_faster(b, new, world)}
        self._simulated_plan = {b: old if b in self._wanted else new for b, old, new in zip(self.order, current, proposed)}
        self.plan = dict(self._simulated_plan)
        dense, other = self.measured_steps.get("dense"), self.measured_steps.get("other")
        if dense and other and (dense[0] < other[0] * plan_factor(costs, [self.plan[b] for b in self.order])
                                * (1.0 - self.hysteresis)):
            self.plan = self._guard_plan()
        # A new density is a new plan, whatever its exchange names: its pairs were measured at another.
        changed = self.plan != before or density != density_before
        self._explore_scale = backed_off(self._explore_scale, changed, bool(self._wanted), self._exploration_seen)
        self._exploration_seen = False

    def _drifted_faster(self, bucket: int, exchange: str, world: int) -> bool:
        """Whether the model rates a pair not measured in the last interval ``TRUST_DRIFT`` times below its last measurement."""
        key = (bucket, exchange)
        calibration = self._calibration
        anchor = calibration.anchor.get(key)
        if anchor is None or calibration.recent(key) or not self.explore_every:  # no explorations: nothing to try it with
            return False
        density, measured_world = calibration.measured_at[key]
        now = calibration.of(bucket, exchange) * self._modelled(bucket, density, measured_world, self.params)[exchange]
        return now * TRUST_DRIFT < anchor

    def observe_steps(self, step: int, dense: float | None, other: float | None, link_changed: bool = False) -> None:
        """Agreed median step periods of the last all-dense steps and of the others (None: none ran).

        ``link_changed``: the collectives showed a change of regime (:meth:`CostEstimator.observe_batch`):
        both periods start over, as when one of them jumps (:func:`~flexcomm.control.guard.smoothed_periods`).
        """
        self.measured_steps = {} if link_changed else smoothed_periods(self.measured_steps, step, dense, other,
                                                                        self.smoothing)

    @property
    def guard_exchange(self) -> str:
        """The exchange of the guard's all-dense steps (:func:`~flexcomm.control.guard.arm_exchange`)."""
        return arm_exchange((vb for _, vb in self.sizes.values()), self.dense16)

    def _guard_plan(self) -> dict[int, str]:
        return dict.fromkeys(self.order, self.guard_exchange)

    def _start(self, costs: Sequence[BucketCosts], plan: Mapping[int, str]) -> list[str]:
        """``plan`` in hook order, where a bucket without a usable choice takes its cheapest exchange alone.

        (A choice of another density can be unusable here -- sparse at density 1 -- and a
        descent from an infinite step could never improve one bucket at a time.)
        """
        def start(bucket: int, costs: BucketCosts) -> str:
            chosen = plan.get(bucket)
            return chosen if chosen is not None and math.isfinite(costs.total(chosen)) else min(EXCHANGE_ORDER, key=costs.total)

        return [start(b, c) for b, c in zip(self.order, costs)]

    def choose(self, bucket: int, step: int, density: float, world: int) -> str:
        """The exchange of ``bucket`` at ``step``: the plan, an exploration, or (unknown bucket) the cheapest alone."""
        if bucket not in self.plan:
            return min(EXCHANGE_ORDER, key=self.costs(bucket, density, world).total)
        trial = guard_trial(step, self.guard_every, self.plan, self._simulated_plan, self._guard_plan(),
                            lambda: self._trial_costs(density, world))
        if trial is not None:
            return trial[bucket]
        explored = self._exploration(step, density, world)
        if explored is not None and explored[0] == bucket:
            self._explored = (step, bucket)
            return explored[1]
        return self.plan[bucket]

    def choice(self, bucket: int, numel: int, density: float, world: int, value_bytes: int, step: int,
               factor_size: tuple[int, int] | None = None) -> Choice:
        """:meth:`choose` for a bucket of ``numel`` elements (``factor_size``: its low-rank payload), with every
        exchange's predicted seconds."""
        self.note_sizes(bucket, numel, value_bytes, factor_size)
        costs = self.costs(bucket, density, world)
        exchange = self.choose(bucket, step, density, world)
        return Choice(exchange, {e: costs.total(e) for e in EXCHANGE_ORDER}, self._explored == (step, bucket))

    def note_sizes(self, bucket: int, numel: int, value_bytes: int, factor_size: tuple[int, int] | None) -> None:
        """What the model needs of a bucket: its elements, their bytes, its low-rank payload (None: none).
        A bucket index whose size changed is another bucket (DDP rebuilds its buckets after the first
        step): what was measured under the index is dropped."""
        if self.sizes.get(bucket, (numel, value_bytes)) != (numel, value_bytes):
            self.forget({bucket})
        if self.sizes.get(bucket) == (numel, value_bytes) and self.factor_sizes.get(bucket) == factor_size:
            return
        self._costs.clear()
        self.sizes[bucket] = (numel, value_bytes)
        if factor_size is None:
            self.factor_sizes.pop(bucket, None)
        else:
            self.factor_sizes[bucket] = factor_size

    def forget(self, buckets: set[int]) -> None:
        """Drop all that was measured and planned for ``buckets`` (gone, or other buckets under their indices)."""
        self._costs.clear()
        for table in (self.sizes, self.factor_sizes, self.plan, self._gap, self._simulated_plan, self._wanted):
            for bucket in buckets & set(table):
                del table[bucket]
        for pairs_table in (self._block, self._measured_at, self._factor, self._quality):
            drop_buckets(pairs_table, buckets)
        self._calibration.forget(buckets)
        if self._explored is not None and self._explored[1] in buckets:
            self._explored = None

    def _exploration(self, step: int, density: float, world: int) -> tuple[int, str] | None:
        every = self.explore_every * self._explore_scale
        if not every or step % every or len(self.plan) != len(self.order):
            return None
        return exploration(step, every, self.explore_margin, self.order, self.plan, self._wanted,
                           self._trial_costs(density, world), self._measured_at)

    def _trial_costs(self, density: float, world: int) -> list[BucketCosts]:
        """The costs explorations and guard trials are rated by (see :func:`at_least_measured`)."""
        calibration = self._calibration
        return at_least_measured(self.step_costs(density, world), self.order, calibration.anchor, calibration.measured_at,
                                 density, world)

    def predicted(self, bucket: int, exchange: str, density: float, world: int) -> float:
        """Predicted blocking + comm seconds of one bucket exchange (what the records compare with)."""
        return self.costs(bucket, density, world).total(exchange)

    def step_seconds(self, density: float, world: int, exchange: str | None) -> float:
        """Predicted backward + exchanges at ``density``: the best plan, or ``exchange`` for every bucket.

        At density 1.0 a fixed exchange means dense; ``flex`` plans between dense and dense16.
        """
        return self.step_plan(density, world, exchange)[0]

    def step_plan(self, density: float, world: int, exchange: str | None) -> tuple[float, tuple[str, ...]]:
        """:meth:`step_seconds` and the plan it simulates, in hook order (NaN and () before any bucket)."""
        if not self.order:
            return math.nan, ()
        costs = self.step_costs(density, world)
        if exchange is not None:
            plan = ["dense" if density >= 1.0 else exchange] * len(costs)
        else:
            plan = best_plan(costs, self._start(costs, self.plan), 0.0)
        return simulate_step(costs, plan), tuple(plan)

    def plan_in_force(self) -> tuple[str, ...]:
        """The plan in force, in hook order (() while some bucket has none)."""
        if not self.order or set(self.plan) != set(self.order):
            return ()
        return tuple(self.plan[b] for b in self.order)

    def plan_seconds(self, world: int) -> float:
        """The simulated step of the plan in force, at its density, under the model as it stands (NaN without one)."""
        plan = self.plan_in_force()
        if self.plan_density is None or not plan:
            return math.nan
        return simulate_step(self.step_costs(self.plan_density, world), plan)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"estimator": self.estimator.state_dict(), "sizes": {b: list(s) for b, s in self.sizes.items()},
                "plan": dict(self.plan), "plan_density": self.plan_density, "block": pairs(self._block),
                **self._calibration.state_dict(), "gap": dict(self._gap), "measured_at": pairs(self._measured_at),
                "measured_steps": dict(self.measured_steps), "simulated_plan": dict(self._simulated_plan),
                "wanted": dict(self._wanted), "factor": pairs(self._factor), "quality": pairs(self._quality),
                "factor_sizes": {b: list(s) for b, s in self.factor_sizes.items()}, "explore_scale": self._explore_scale,
                "explored": None if self._explored is None else list(self._explored),
                "exploration_seen": self._exploration_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; keys absent from older checkpoints load empty or at their defaults."""
        self._costs.clear()
        self.estimator.load_state_dict(state["estimator"])
        self.params = self.estimator.params  # the parameters the saved calibrations are relative to
        self.sizes = {int(b): (int(n), int(v)) for b, (n, v) in state["sizes"].items()}
        self.plan = {int(b): str(e) for b, e in state["plan"].items()}
        self.plan_density = state["plan_density"]
        self._block = unpairs(state["block"])
        self._calibration.load_state_dict(state)
        self._gap = {int(b): float(g) for b, g in state["gap"].items()}
        self._measured_at = unpairs(state["measured_at"])
        self.measured_steps = {k: (float(t), int(at)) for k, (t, at) in state["measured_steps"].items()}
        self._simulated_plan = {int(b): str(e) for b, e in state["simulated_plan"].items()}
        self._wanted = {int(b): str(e) for b, e in state.get("wanted", {}).items()}
        self._factor = {key: float(v) for key, v in unpairs(state.get("factor", [])).items()}
        self._quality = {key: float(v) for key, v in unpairs(state.get("quality", [])).items()}
        self.factor_sizes = {int(b): (int(p), int(q)) for b, (p, q) in state.get("factor_sizes", {}).items()}
        self._explore_scale = int(state.get("explore_scale", 1))
        explored = state.get("explored")
        self._explored = None if explored is None else (int(explored[0]), int(explored[1]))
        self._exploration_seen = bool(state.get("exploration_seen", False))
