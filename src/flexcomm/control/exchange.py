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

A bucket's costs per exchange (modelled and calibrated comm, measured local work, steps factors)
come from :class:`~flexcomm.control.pair_costs.PairCosts`.

Trial before adoption: a pair measured before the last interval that the refitted model now
rates ``TRUST_DRIFT`` times below its last measurement is not adopted on the model's word; the
bucket tries it first at its next exploration (a fit dominated by one message size once rated
dense at 100 Mbit at 2 ms, and whole intervals of dense ran at 10-20x the sparse step).
Explorations (:mod:`flexcomm.control.exploration`: every ``explore_every`` steps, backed off up
to 4x while they confirm the plan, one bucket tries an alternative rated within
``explore_margin``) and the guard's trials (:mod:`flexcomm.control.guard`: all-dense steps
measured faster than the plan's make the plan all-dense, dense16 where allowed; its trials back
off the same way while they confirm the side that runs) rate a pair at
no less than it last measured (:func:`~flexcomm.control.exploration.at_least_measured`).  Whole
steps are measured for every plan that runs, and a plan measured faster than the model's proposal
(each times its steps factor) runs instead of it (:func:`~flexcomm.control.guard.measured_choice`).

Everything is plain Python on agreed inputs in a fixed order: every rank plans alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexcomm.control.exploration import at_least_measured, backed_off, exploration
from flexcomm.control.guard import (PlanPeriods, all_dense_wins, arm_exchange, guard_trial, measured_choice, remember_plan,
                                   smoothed_periods)
from flexcomm.control.measurements import StepSample
from flexcomm.control.pair_costs import PairCosts
from flexcomm.control.step_model import EXCHANGE_ORDER, BucketCosts, best_plan, plan_factor, simulate_step
from flexcomm.cost import CostEstimator, CostParams

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
    """The plan that minimises the step, on the measured and modelled costs of its :class:`PairCosts`.

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
        #: The measured and modelled costs of every (bucket, exchange) pair.
        self.table = PairCosts(estimator or CostEstimator(), smoothing, dense16, lowrank)
        self.hysteresis = hysteresis
        self.explore_every = explore_every
        self.explore_margin = explore_margin
        self.guard_every = guard_every
        self.plan: dict[int, str] = {}
        #: The density :attr:`plan` was made for (a plan for another density must not run).
        self.plan_density: float | None = None
        # The guard: measured whole-step periods of all-dense steps (its arm) and of the others, (seconds, step).
        self.measured_steps: dict[str, tuple[float, int]] = {}
        #: The agreed step periods of every plan that ran, per (density, plan) (see :mod:`flexcomm.control.guard`).
        self.measured_plans: PlanPeriods = {}
        self._last_agreed = 0
        self._simulated_plan: dict[int, str] = {}
        # bucket -> the exchange a replan wanted but must try first (see TRUST_DRIFT).
        self._wanted: dict[int, str] = {}
        # (step, bucket) of the last exploration; whether its agreed samples came in since the last
        # replan; the back-off of the exploration interval.
        self._explored: tuple[int, int] | None = None
        self._exploration_seen = False
        self._explore_scale = 1
        # The same back-off for the guard's trials: whether a trial's period came in since the last replan.
        self._guard_seen = False
        self._guard_scale = 1
        # bucket -> exchange held until the next replan (see hold).
        self._held: dict[int, str] = {}

    def settings(self) -> dict[str, object]:
        """Every option that changes a plan: ranks whose settings differ would plan differently."""
        return {"smoothing": self.smoothing, "hysteresis": self.hysteresis, "explore_every": self.explore_every,
                "explore_margin": self.explore_margin, "guard_every": self.guard_every, "dense16": self.dense16,
                "lowrank": self.lowrank}

    @property
    def estimator(self) -> CostEstimator:
        return self.table.estimator

    @property
    def smoothing(self) -> float:
        return self.table.smoothing

    @property
    def dense16(self) -> bool:
        return self.table.dense16

    @property
    def lowrank(self) -> bool:
        return self.table.lowrank

    @property
    def params(self) -> CostParams:
        """The (alpha, beta) the predictions use (taken from the estimator at :meth:`refresh`)."""
        return self.table.params

    @property
    def sizes(self) -> dict[int, tuple[int, int]]:
        """bucket -> (numel, value bytes) of the buckets of the current layout."""
        return self.table.sizes

    @sizes.setter
    def sizes(self, sizes: dict[int, tuple[int, int]]) -> None:
        self.table.set_sizes(sizes)

    @property
    def order(self) -> list[int]:
        """The buckets in hook order (DDP hands them over by index)."""
        return self.table.order

    def refresh(self) -> None:
        """Take the estimator's current (alpha, beta) for the next predictions (at agreement points)."""
        self.table.refresh()

    def observe(self, step: int, samples: Sequence[StepSample], world: int) -> None:
        """Fold one step's agreed samples in (same order on every rank)."""
        for sample in samples:
            self.table.observe(step, sample, world)
            if self._explored == (step, sample.bucket):
                self._exploration_seen = True

    def costs(self, bucket: int, density: float, world: int) -> BucketCosts:
        """Predicted blocking and comm seconds of every exchange of ``bucket`` at ``density``."""
        return self.table.costs(bucket, density, world)

    def step_costs(self, density: float, world: int) -> list[BucketCosts]:
        return self.table.step_costs(density, world)

    # -- decisions ------------------------------------------------------------------------
    def replan(self, density: float, world: int) -> None:
        """Re-decide the plan of every known bucket (at an agreement point).

        The simulation leaves out that collectives and compute share the CPU, so measured whole
        steps overrule it (:mod:`flexcomm.control.guard`): a plan measured faster than the model's
        proposal at this density, times each one's steps factor, runs instead of it; and when
        all-dense steps (plain DDP's behaviour) measured faster than the plan's, the plan is all-dense.
        """
        if not self.order:
            return
        self._held = {}
        before, density_before = dict(self.plan), self.plan_density
        self.plan_density = density
        costs = self.step_costs(density, world)
        current = self._start(costs, self._simulated_plan)
        proposed = best_plan(costs, current, self.hysteresis)
        self._wanted = {b: new for b, old, new in zip(self.order, current, proposed)
                        if new != old and self._drifted_faster(b, new, world)}
        simulated = tuple(old if b in self._wanted else new for b, old, new in zip(self.order, current, proposed))
        chosen = measured_choice(self.measured_plans, self._last_agreed, density, simulated,
                                 lambda plan: plan_factor(costs, plan) if math.isfinite(simulate_step(costs, plan))
                                 else math.inf, self.hysteresis)
        self._simulated_plan = dict(zip(self.order, chosen))
        self.plan = dict(self._simulated_plan)
        dense, other = self.measured_steps.get("dense"), self.measured_steps.get("other")
        if dense and other and all_dense_wins(dense[0], other[0], plan_factor(costs, [self.plan[b] for b in self.order]),
                                              self.hysteresis):
            self.plan = self._guard_plan()
        # A new density is a new plan, whatever its exchange names: its pairs were measured at another.
        changed = self.plan != before or density != density_before
        self._explore_scale = backed_off(self._explore_scale, changed, bool(self._wanted), self._exploration_seen)
        self._exploration_seen = False
        # The guard's trials back off while they confirm which side of the guard runs.
        guard_changed = (self._is_guard_plan(before.values()) != self._is_guard_plan(self.plan.values())
                         or density != density_before)
        self._guard_scale = backed_off(self._guard_scale, guard_changed, False, self._guard_seen)
        self._guard_seen = False

    def hold(self, exchanges: Mapping[int, str]) -> None:
        """Run ``exchanges`` (bucket -> exchange) until the next replan, no trial nor exploration: all-dense steps
        that turned out far too slow for what chose them (:mod:`flexcomm.control.dense_check`)."""
        self._held = {b: e for b, e in exchanges.items() if b in self.plan}

    def _is_guard_plan(self, exchanges: Iterable[str]) -> bool:
        """Whether a plan's ``exchanges`` are the guard's all-dense steps (no exchanges: no plan, not those)."""
        return set(exchanges) == {self.guard_exchange}

    def _drifted_faster(self, bucket: int, exchange: str, world: int) -> bool:
        """Whether the model rates a pair not measured in the last interval ``TRUST_DRIFT`` times below its last measurement."""
        key = (bucket, exchange)
        calibration = self.table.calibration
        anchor = calibration.anchor.get(key)
        if anchor is None or calibration.recent(key) or not self.explore_every:  # no explorations: nothing to try it with
            return False
        density, measured_world = calibration.measured_at[key]
        now = calibration.of(bucket, exchange) * self.table.modelled(bucket, density, measured_world, self.params)[exchange]
        return now * TRUST_DRIFT < anchor

    def observe_steps(self, step: int, dense: float | None, other: float | None, link_changed: bool = False) -> None:
        """Agreed median step periods of the last all-dense steps and of the others (None: none ran).

        ``link_changed``: the collectives showed a change of regime (:meth:`CostEstimator.observe_batch`):
        both periods start over, as when one of them jumps (:func:`~flexcomm.control.guard.smoothed_periods`).
        """
        self.measured_steps = {} if link_changed else smoothed_periods(self.measured_steps, step, dense, other,
                                                                        self.smoothing)
        self._last_agreed = step
        trial = other if self._is_guard_plan(self.plan.values()) else dense
        if not self.measured_steps:  # a new link (or a jump): the guard compares afresh, at its full rate
            self._guard_scale, self._guard_seen = 1, False
        elif trial is not None:
            self._guard_seen = True
        ran = self._plan_that_ran()
        if link_changed:
            self.measured_plans = {}
        elif other is not None and ran and self.plan_density is not None:
            self.measured_plans = remember_plan(self.measured_plans, step, self.plan_density, ran, other, self.smoothing)

    def _plan_that_ran(self) -> tuple[str, ...]:
        """The plan of the steps that were not all-dense since the last replan: the plan in force, or the
        simulated plan the guard's trials ran while the plan in force was all-dense (() if unknown)."""
        plan = self.plan_in_force()
        if self._is_guard_plan(plan):
            simulated = tuple(self._simulated_plan.get(b, "") for b in self.order)
            return simulated if all(simulated) and simulated != plan else ()
        return plan

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
        if bucket in self._held:
            return self._held[bucket]
        measured = self.measured_steps.get("other")
        trial = guard_trial(step, self.guard_every * self._guard_scale, self.plan, self._simulated_plan, self._guard_plan(),
                            lambda: self._trial_costs(density, world), measured[0] if measured else None)
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
        step): what was measured and planned under the index is dropped."""
        if self.sizes.get(bucket, (numel, value_bytes)) != (numel, value_bytes):
            self.forget({bucket})
        self.table.note_sizes(bucket, numel, value_bytes, factor_size)

    def forget(self, buckets: set[int]) -> None:
        """Drop all that was measured and planned for ``buckets`` (gone, or other buckets under their indices)."""
        if not buckets:
            return
        self.table.forget(buckets)
        self.measured_plans = {}  # keyed by plans over the old buckets
        for table in (self.plan, self._simulated_plan, self._wanted):
            for bucket in buckets & set(table):
                del table[bucket]
        if self._explored is not None and self._explored[1] in buckets:
            self._explored = None

    def _exploration(self, step: int, density: float, world: int) -> tuple[int, str] | None:
        every = self.explore_every * self._explore_scale
        if not every or step % every or len(self.plan) != len(self.order):
            return None
        return exploration(step, every, self.explore_margin, self.order, self.plan, self._wanted,
                           self._trial_costs(density, world), self.table.measured_step)

    def _trial_costs(self, density: float, world: int) -> list[BucketCosts]:
        """The costs explorations and guard trials are rated by (see :func:`at_least_measured`)."""
        calibration = self.table.calibration
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
        return {**self.table.state_dict(), "plan": dict(self.plan), "plan_density": self.plan_density,
                "measured_steps": dict(self.measured_steps), "simulated_plan": dict(self._simulated_plan),
                "measured_plans": [[d, list(plan), t, at] for (d, plan), (t, at) in sorted(self.measured_plans.items())],
                "last_agreed": self._last_agreed,
                "wanted": dict(self._wanted), "explore_scale": self._explore_scale,
                "explored": None if self._explored is None else list(self._explored),
                "exploration_seen": self._exploration_seen, "guard_scale": self._guard_scale,
                "guard_seen": self._guard_seen, "held": dict(self._held)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; keys absent from older checkpoints load empty or at their defaults."""
        self.table.load_state_dict(state)
        self.plan = {int(b): str(e) for b, e in state["plan"].items()}
        self.plan_density = state["plan_density"]
        self.measured_steps = {k: (float(t), int(at)) for k, (t, at) in state["measured_steps"].items()}
        self.measured_plans = {(float(d), tuple(str(e) for e in plan)): (float(t), int(at))
                               for d, plan, t, at in state.get("measured_plans", [])}
        self._last_agreed = int(state.get("last_agreed", 0))
        self._simulated_plan = {int(b): str(e) for b, e in state["simulated_plan"].items()}
        self._wanted = {int(b): str(e) for b, e in state.get("wanted", {}).items()}
        self._explore_scale = int(state.get("explore_scale", 1))
        explored = state.get("explored")
        self._explored = None if explored is None else (int(explored[0]), int(explored[1]))
        self._exploration_seen = bool(state.get("exploration_seen", False))
        self._guard_scale = int(state.get("guard_scale", 1))
        self._guard_seen = bool(state.get("guard_seen", False))
        self._held = {int(b): str(e) for b, e in state.get("held", {}).items()}
