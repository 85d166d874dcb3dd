"""The step's decisions behind one small interface: which exchange, at which density.

:class:`StepPlanner` is all that the state asks about decisions.  The state calls, on
every rank in the same order:

``begin_step(step)``        at a step's first bucket, before any of its exchanges: the
                            finished step is closed (if it began all-dense steps, one
                            allreduce checks it: :mod:`flexcomm.control.dense_check`),
                            a due probe runs, and at an
                            agreement point the agreed values are read and the
                            decisions taken (exchange plan, density);
``plan(bucket, numel, value_bytes, step, factor_size) -> Plan``
                            the exchange, density and predicted time of one bucket;
``measuring_gain`` / ``observe_gain(bucket, a, workspace)``
                            the gain curve of ``density="auto"`` at measurement steps;
``observe_exchange(step, bucket, observation, t_compress)``
                            a finished exchange's timings, agreed at a later agreement point;
``end_step(step)``          right after the step's last bucket's exchange was issued: the
                            next step's agreement collectives, if it is an agreement point,
                            are issued asynchronously (:mod:`flexcomm.control.agreement_point`).

So at an agreement point nothing stands between the first bucket's work and its exchange
but the wait for an allreduce issued one optimizer step, forward and backward earlier.
Probes (at start, then every ``probe_every`` steps within a budget, :mod:`flexcomm.control.probing`)
still run at the step's first bucket: they time a quiet link, and at the previous step's end
its last exchanges still use it.

Every decision is a deterministic function of the step counter and of values every rank
received in the same collective, so every rank decides alike:

* ``flex``: the :class:`~flexcomm.control.exchange.ExchangeChooser` plans, per bucket, the
  exchange (dense, dense16, AG-Topk, AR-Topk or low-rank) that makes the whole step fastest for
  the steps it costs (:mod:`flexcomm.control.quality`).  Its inputs: (alpha, beta) fitted to
  probes (at start and every ``probe_every`` steps) and to the collectives' own times (those at
  least as large as the smallest probe), and each bucket exchange's measurements
  (:mod:`flexcomm.control.step_log`), agreed every ``flex_interval`` steps (and at steps 1, 2,
  4, ... before) over the steps up to two before the agreement point; the plan changes only
  then, and one bucket every few steps tries an alternative (exploration by step counter).
* ``density="auto"``: the :class:`~flexcomm.control.density.DensityController` decides once
  per agreement point, never between them, on the gains and times agreed there.  The gain
  curve (one top-k pass per bucket over the candidates, summed over buckets and ranks by one
  allreduce of fixed length) is measured at the step before an agreement point, at least
  ``measure_every`` steps after the last one, so the decision sees it fresh (the first at
  step 0, for the decision at step 1).  Each candidate's step time comes from step periods
  measured at that same density where there are any (:mod:`flexcomm.control.periods`); a
  step's period, from its first bucket to the next step's, is closed at that next step (not
  kept for a step where a bucket explored: it ran neither the plan nor all-dense; nor for a
  step that probed, step 0 among them: it also ran the probes and one-time set-up).
  Whenever the density changes the exchange plan is made again for it.
* the first ``warmup_steps`` steps, and density 1.0 under ``auto`` with a fixed
  compressor, are dense (fp32); ``flex`` at density 1.0 plans between dense, dense16 and low-rank.

Collectives: whether the measurement allreduce runs, and its length, follow from the step
counter and the exchanges every rank planned, never from rank-local samples
(:mod:`flexcomm.control.measurements`).  :meth:`StepPlanner.state_dict` holds everything a
later decision reads (unagreed samples and periods, the open step, the gain curve, and the
values of an agreement issued but not yet read, waiting for them), so a resumed run decides
as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.comm import allreduce_floats, probe_collectives
from flexcomm.compress import TopkWorkspace
from flexcomm.control.dense_check import TOO_SLOW, DenseCheck, slowdown
from flexcomm.control.density import DensityController
from flexcomm.control.exchange import ExchangeChooser
from flexcomm.control.gain_curve import GainCurve
from flexcomm.control.intake import feed_agreed
from flexcomm.control.agreement_point import AgreementPoint
from flexcomm.control.measurements import AgreedSample
from flexcomm.control.periods import RecentPeriods, StepPeriods
from flexcomm.control.probing import probe_due
from flexcomm.control.step_log import LocalSample, StepLog, sample_from_row, sample_row
from flexcomm.cost import CostEstimator, Observation, probe_time


#: How many of the newest agreed (exchange, predicted, measured) pairs ``prediction_log``
#: keeps.  Each is ~130 bytes of Python objects; 10,000 of them took a long run's first
#: 10,000 samples to fill and read as 1-2 MB of growth per rank (benchmarks/memory_growth.py).
PREDICTION_LOG = 2_000


@dataclass(frozen=True)
class Plan:
    """One bucket's decision: the exchange, the density, the model's time for it (NaN if none), and
    whether it is an exploration (not the exchange the plan or the guard chose)."""

    exchange: str
    density: float
    predicted: float = math.nan
    explored: bool = False


class StepPlanner:
    """Decides, identically on every rank, how each bucket is exchanged.

    Args:
        exchange: the compressor's fixed exchange, or ``None`` for ``flex`` (chosen per bucket).
        density: the fixed density, or ``None`` when ``controller`` decides (``density="auto"``).
        controller: the density controller of ``density="auto"``.
        warmup_steps: steps exchanged dense at the start.
        flex_interval, probe_every, probe_sizes, forgetting: the online cost estimate
            (see :class:`flexcomm.FlexState`).
        group: the process group the agreement collectives run on.
        dense16: whether ``flex`` may allreduce a bucket in fp16 (see :class:`flexcomm.FlexState`).
        lowrank: whether ``flex`` may send a bucket's low-rank factors (see :class:`flexcomm.FlexState`).
    """

    def __init__(
        self,
        exchange: str | None,
        density: float | None,
        controller: DensityController | None,
        warmup_steps: int,
        flex_interval: int,
        probe_every: int,
        probe_sizes: Sequence[int],
        forgetting: float,
        group: dist.ProcessGroup | None,
        dense16: bool = True,
        lowrank: bool = True,
    ) -> None:
        self.exchange = exchange
        self.controller = controller
        self.fixed_density = density
        self.warmup_steps = warmup_steps
        self.flex_interval = flex_interval
        self.probe_every = probe_every
        self.probe_sizes = tuple(probe_sizes)
        self.group = group
        self.chooser = ExchangeChooser(CostEstimator(forgetting=forgetting), dense16=dense16, lowrank=lowrank)
        self._log = StepLog()
        # Local samples and the (step, bucket) every rank planned, since the last agreement point.
        self._pending: list[LocalSample] = []
        self._expected: list[tuple[int, int]] = []
        # Whole-step periods since the last agreement point.
        self._recent = RecentPeriods()
        self._dense_check = DenseCheck()
        self._simulated = 0.0
        # The buckets planned in this step (a rebuild can drop some).
        self._step_buckets: set[int] = set()
        # The last step in which a bucket explored an alternative (its period is not kept).
        self._explored_step: int | None = None
        #: Agreed step periods per density (``density="auto"``'s time predictions).
        self.periods = StepPeriods(self.chooser.smoothing)
        #: ``(exchange, predicted, measured)`` seconds (blocking work + collectives) of every agreed bucket
        #: exchange, newest last: how far the model is from what it then measured.
        self.prediction_log: deque[tuple[str, float, float]] = deque(maxlen=PREDICTION_LOG)
        #: The step of the last probe (``None`` before the first).
        self.probed_at: int | None = None
        #: ``density="auto"``'s gain curve: this step's energies and the last agreed gains.
        self.gain_curve = GainCurve()
        # (period, simulated) agreed at this agreement point per density, for the density decision.
        self._new_periods: dict[float, tuple[float, float]] = {}
        # The next agreement point's collectives, issued at the end of the step before it.
        self._agreement: AgreementPoint | None = None

    @property
    def density(self) -> float:
        """The density in force now (the controller's choice under ``density="auto"``)."""
        return self.controller.density if self.controller else self.fixed_density

    @property
    def estimating(self) -> bool:
        """Whether decisions need the online cost estimate (``flex`` or ``auto``)."""
        return self.exchange is None or self.controller is not None

    @property
    def measuring_gain(self) -> bool:
        """Whether this step's buckets add to the gain curve (:meth:`observe_gain`)."""
        return self.gain_curve.measuring

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def begin_step(self, step: int) -> None:
        """A step's first bucket, when none of its exchanges is issued: probe, read the agreement, decide."""
        if not self.estimating:
            return
        entered, closed = self._close_step()
        if self.exchange is None and self._dense_check.closed(entered):  # see flexcomm.control.dense_check
            local = slowdown(sum(s.service for s in closed), self.chooser.measured_steps.get("other"))
            if allreduce_floats([local], self.group, dist.ReduceOp.MIN)[0] > TOO_SLOW:
                self.chooser.hold(self._dense_check.fallback)
        # Buckets the last step did not have are gone (DDP rebuilt fewer): nothing may plan them.
        if self._step_buckets:
            self.chooser.forget(set(self.chooser.sizes) - self._step_buckets)
        self._step_buckets = set()
        agreement, self._agreement = self._agreement, None
        learned = False
        if self._probe_due(step):
            self.chooser.estimator.observe_all(probe_collectives(self.probe_sizes, self.group, self.chooser.params.algorithms))
            self.probed_at = step
            learned = True
        measured = agreement.measured() if agreement else None  # waits: issued at the previous step's end
        if measured is not None:
            self._observe_measurements(*measured)
            learned = True
        if learned:
            self.chooser.refresh()
        if self.controller:
            energy = agreement.gain_energy() if agreement else None
            if energy is not None:
                self.gain_curve.agree(step, energy)
            if self._agrees_at(step):
                self._update_density(step)  # the one decision of this agreement point
            self.gain_curve.measuring = (self._agrees_at(step + 1)
                                         and self.controller.measure_due(step + 1, self.gain_curve.agreed_at))
        if learned or self.chooser.plan_density != self.density:
            self.chooser.replan(self.density, self.world_size)  # never run a plan made for another density
            if self.controller:
                simulated = self.chooser.step_seconds(self.density, self.world_size, self.exchange)
                self._simulated = simulated if math.isfinite(simulated) else 0.0

    def _probe_due(self, step: int) -> bool:
        """:func:`~flexcomm.control.probing.probe_due` on the model and plan in force (agreed: every rank probes alike)."""
        if self.probed_at is None:
            return True
        world = self.world_size
        return probe_due(step - self.probed_at, self.probe_every,
                         lambda: probe_time(self.probe_sizes, world, self.chooser.params),
                         lambda: self.chooser.plan_seconds(world))

    def end_step(self, step: int) -> None:
        """The step's last bucket's exchange was issued: issue the next step's agreement, if it is an agreement point.

        Measurements are due when the next step agrees and some exchange was closed since the
        last agreement (planned exchanges, the same on every rank); the gain curve when this
        step measured one.  Called on every rank at the same place in the dispatcher's order.
        """
        if not self.estimating:
            return
        measure = self._agrees_at(step + 1) and bool(self._expected)
        energy = self.gain_curve.take_energy()
        if not measure and energy is None:
            return
        candidates = self.controller.candidates if self.controller else ()
        periods = self._recent.medians(candidates) if measure else None
        self._agreement = AgreementPoint.issue(self._expected if measure else [], self._pending if measure else [],
                                               periods, energy, self.group)
        if measure:
            self._pending, self._expected = [], []
            self._recent.clear()

    def _close_step(self) -> tuple[dict[int, tuple[str, float]], list[LocalSample]]:
        """Move the finished step's samples and period to the pending measurements; return its exchanges (the
        same on every rank) and samples (none where an exchange never reported)."""
        entered = self._log.exchanges()
        expected = self._log.keys()
        closed = self._log.close()
        self._expected += expected
        self._pending += closed
        # An exploration's step ran neither the plan nor all-dense: its period describes neither.  A
        # step that probed also ran the probes' collectives, and the first (step 0) its one-time
        # set-up: 70 ms against 16 ms for the next dense16 steps (MLP, 1 Gbit), which made the
        # guard take 28 ms fp32 dense steps for faster and run them for 55 steps.
        # Warm-up steps run fp32 dense, which is neither the plan nor (dense16 arm) the guard's all-dense.
        kept = bool(closed) and closed[0].step not in (self._explored_step, self.probed_at) and closed[0].step >= self.warmup_steps
        guard = self.chooser.guard_exchange
        ended = (all(s.exchange == guard for s in closed), closed[0].density, self._simulated) if kept else None
        self._recent.step_began(perf_counter(), ended)
        return entered, closed

    def _agrees_at(self, step: int) -> bool:
        """Every ``flex_interval`` steps, and at steps 1, 2, 4, ... before the first such step:
        the uncalibrated model decides only the first step, not the first ``flex_interval``."""
        return step % self.flex_interval == 0 or (step < self.flex_interval and step & (step - 1) == 0)

    def plan(self, bucket_index: int, numel: int, value_bytes: int, step: int,
             factor_size: tuple[int, int] | None = None) -> Plan:
        """How this bucket is exchanged at ``step`` (``factor_size``: its low-rank payload, for ``flex``)."""
        density = self.density
        world = self.world_size
        explored = False
        # Under density="auto", density 1.0 means dense (sending every index would only add bytes):
        # a fixed compressor's fp32 dense, flex's choice of dense or dense16.
        if step < self.warmup_steps or (self.controller is not None and density >= 1.0 and self.exchange is not None):
            exchange = "dense"
        elif self.exchange is not None:
            exchange = self.exchange
        else:
            choice = self.chooser.choice(bucket_index, numel, density, world, value_bytes, step, factor_size)
            exchange, explored = choice.exchange, choice.explored
            if explored:
                self._explored_step = step
        if not self.estimating:
            return Plan(exchange, density)
        self._step_buckets.add(bucket_index)
        if self.chooser.sizes.get(bucket_index) != (numel, value_bytes):
            self.chooser.note_sizes(bucket_index, numel, value_bytes, factor_size)
        predicted = self.chooser.predicted(bucket_index, exchange, density, world)
        self._log.entered(step, bucket_index, exchange, density, numel, value_bytes, predicted)
        return Plan(exchange, density, predicted, explored)

    def observe_gain(self, bucket_index: int, accumulated: torch.Tensor, workspace: TopkWorkspace) -> None:
        """Add one bucket's kept energy per candidate density (and its total) to this step's curve."""
        assert self.controller is not None
        self.gain_curve.add(accumulated, self.controller.candidates, workspace)

    def observe_exchange(self, step: int, bucket_index: int, observation: Observation, t_compress: float | None) -> None:
        """Note a finished exchange: its collective's sample and its local work (0 for dense)."""
        if self.estimating:
            self._log.finished(step, bucket_index, observation, t_compress or 0.0)

    def observe_sent(self, step: int, bucket_index: int, gain: float) -> None:
        """Note a settled exchange's gain ``||sent|| / ||accumulated||`` on this rank (what the steps factor needs)."""
        if self.estimating:
            self._log.sent(step, bucket_index, gain)

    def observe_quality(self, step: int, bucket_index: int, quality: float) -> None:
        """Note a settled exchange's ``cos(update, mean gradient)`` (the same on every rank)."""
        if self.estimating:
            self._log.measured_quality(step, bucket_index, quality)

    def _update_density(self, step: int) -> None:
        """The controller's decision on the last agreed gains and every candidate's predicted step period.

        Every candidate is predicted from the periods measured at its own density, each paired
        with the simulated step the model gave when those steps ran (:mod:`flexcomm.control.periods`;
        a period over which the link changed is dropped there).
        """
        assert self.controller is not None
        candidates = self.controller.candidates
        world = self.world_size
        simulated, best = zip(*(self.chooser.step_plan(c, world, self.exchange) for c in candidates))
        new, self._new_periods = self._new_periods, {}
        if not all(math.isfinite(t) for t in simulated):
            return
        as_ran = [self._as_ran(c, t, plan) for c, t, plan in zip(candidates, simulated, best)]
        for density, (period, ran_under) in new.items():
            self.periods.agreed(step, density, period, ran_under, *as_ran[candidates.index(density)])
        curve = self.gain_curve
        if curve.gains is not None:
            # The plan each density would run: the plan in force at its own density (hysteresis keeps it), else the best.
            predicted = self.periods.predict(candidates, simulated, [plan for _, plan in as_ran])
            self.controller.update(step, curve.gains, predicted, curve.agreed_at)

    def _as_ran(self, density: float, best: float, best_plan: tuple[str, ...]) -> tuple[float, tuple[str, ...]]:
        """The simulated step, under the model now, of the plan that ran at ``density``, and that plan: flex's
        plan in force (not necessarily the best one now); the best ones for a fixed exchange or another density."""
        if self.exchange is not None or self.chooser.plan_density != density:
            return best, best_plan
        ran, plan = self.chooser.plan_seconds(self.world_size), self.chooser.plan_in_force()
        return (ran, plan) if math.isfinite(ran) and plan else (best, best_plan)

    def _observe_measurements(self, agreed: list[AgreedSample], periods: Sequence[float]) -> None:
        """Feed the chooser the agreed step samples and periods, the same on every rank."""
        candidates = self.controller.candidates if self.controller else ()
        dense_period, other_period, *by_density = periods
        n = len(candidates)
        self._new_periods = {c: (t, sim) for c, t, sim in zip(candidates, by_density[:n], by_density[n:]) if t > 0.0}
        if not agreed:
            return
        feed_agreed(self.chooser, agreed, dense_period, other_period, min(self.probe_sizes), self.world_size)
        self.prediction_log.extend((a.sample.exchange, a.sample.predicted, a.block + a.service) for a in agreed
                                   if math.isfinite(a.sample.predicted))

    def fingerprint(self) -> dict[str, object]:
        """The decision settings that must be equal on every rank, one key per option (the error names it)."""
        controller = self.controller
        settings = {f"controller.{name}": value for name, value in controller.settings().items()} if controller else {}
        if self.estimating:
            settings.update({f"chooser.{name}": value for name, value in self.chooser.settings().items()})
        return {"density": "auto" if controller else self.fixed_density, **settings, "warmup_steps": self.warmup_steps}

    def state_dict(self) -> dict[str, Any]:
        """Everything a later decision reads; clock readings as ages (a clock does not survive a restart)."""
        return {
            "chooser": self.chooser.state_dict(),
            "probed_at": self.probed_at,
            "controller": self.controller.state_dict() if self.controller else None,
            **self.gain_curve.state_dict(),
            "periods": self.periods.state_dict(),
            "pending": [sample_row(s) for s in self._pending],
            "expected": [list(key) for key in self._expected],
            **self._recent.state_dict(perf_counter()),
            "simulated": self._simulated,
            "explored_step": self._explored_step,
            **self._dense_check.state_dict(),
            "open_step": self._log.state_dict(),
            "agreement": None if self._agreement is None else self._agreement.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["controller"] is None) != (self.controller is None):
            raise ValueError("checkpoint and this run disagree on density='auto'")
        self.chooser.load_state_dict(state["chooser"])
        self.probed_at = state["probed_at"]
        self.gain_curve.load_state_dict(state)
        if self.controller:
            self.controller.load_state_dict(state["controller"])
        self.periods.load_state_dict(state["periods"])
        self._pending = [sample_from_row(row) for row in state["pending"]]
        self._expected = [(int(s), int(b)) for s, b in state["expected"]]
        self._recent.load_state_dict(state, perf_counter())
        self._simulated = state["simulated"]
        self._explored_step = state.get("explored_step")  # absent from states saved before it was kept
        self._dense_check.load_state_dict(state)
        self._log.load_state_dict(state["open_step"])
        agreement = state.get("agreement")  # absent from states saved before agreements were issued early
        self._agreement = None if agreement is None else AgreementPoint.from_state(agreement)

