"""The step's decisions behind one small interface: which exchange, at which density.

:class:`StepPlanner` is all that the state asks about decisions.  The state calls, on
every rank in the same order:

``begin_step(step)``        at a step's first bucket, before any of its exchanges; the
                            agreement points (probes, agreed measurements, the density
                            decision) happen here and may issue small collectives;
``plan(bucket, numel, value_bytes, step) -> Plan``
                            the exchange, density and predicted time of one bucket;
``measuring_gain`` / ``observe_gain(bucket, a, workspace)``
                            the gain curve of ``density="auto"`` at measurement steps;
``observe_exchange(step, bucket, observation, t_compress)``
                            a finished exchange's timings, agreed at the next agreement point.

Every decision is a deterministic function of the step counter and of values every rank
received in the same collective, so every rank decides alike:

* ``flex``: the :class:`~flexcomm.control.exchange.ExchangeChooser` plans, per bucket, the
  exchange (dense, AG-Topk or AR-Topk) that makes the whole step fastest: blocking local
  work, collectives queued on the group, what hides behind the rest of backward (see its
  module).  Its inputs: (alpha, beta) estimated online from a probe of a few message sizes
  at start and every ``probe_every`` steps and from the collectives' own times, and each
  bucket exchange's agreed measurements (:mod:`flexcomm.control.step_log`), all agreed
  across ranks every ``flex_interval`` steps (and at steps 1, 2, 4, ... before the first
  of them, so the model is calibrated early); the plan changes only then, and one bucket
  every few steps tries an alternative the model rates close (exploration by step counter).
* ``density="auto"``: every ``measure_every`` steps each bucket's gain curve over the
  candidates is computed from one top-k pass, summed over buckets and ranks by one
  allreduce; the :class:`~flexcomm.control.density.DensityController` picks from the gains
  and each candidate's predicted step time, and again at every agreement point (new times,
  the last agreed gains), so a changed network is followed within ``flex_interval`` steps.
* the first ``warmup_steps`` steps, and density 1.0 under ``auto``, are dense.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.comm import allreduce_floats, probe_collectives
from flexcomm.compress import TopkWorkspace
from flexcomm.compress.gain import kept_energy, total_energy
from flexcomm.control.density import DensityController
from flexcomm.control.exchange import ExchangeChooser, StepSample
from flexcomm.control.step_log import LocalSample, StepLog
from flexcomm.cost import CostEstimator, Observation


PREDICTION_LOG = 10_000


@dataclass(frozen=True)
class Plan:
    """One bucket's decision: the exchange, the density, and the model's time for it (NaN if none)."""

    exchange: str
    density: float
    predicted: float = math.nan


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
    ) -> None:
        self.exchange = exchange
        self.controller = controller
        self.fixed_density = density
        self.warmup_steps = warmup_steps
        self.flex_interval = flex_interval
        self.probe_every = probe_every
        self.probe_sizes = tuple(probe_sizes)
        self.group = group
        self.chooser = ExchangeChooser(CostEstimator(forgetting=forgetting))
        self._log = StepLog()
        self._pending: list[LocalSample] = []
        # Wall time between consecutive steps' first buckets (a whole iteration), and the agreed
        # median of recent ones: what the exchanges' simulation leaves out (forward, the
        # backward before the first bucket, the optimizer) is this minus the simulated part.
        self._last_begin: float | None = None
        self._periods: list[tuple[float, bool]] = []  # (seconds, whether every bucket went dense)
        self.step_period: float | None = None
        #: ``(exchange, predicted, measured)`` seconds (blocking work + collectives) of every agreed bucket
        #: exchange, newest last: how far the model is from what it then measured.
        self.prediction_log: deque[tuple[str, float, float]] = deque(maxlen=PREDICTION_LOG)
        #: The step of the last probe (``None`` before the first).
        self.probed_at: int | None = None
        self.measuring_gain = False
        # Gain curve of this step (density="auto"): kept energy per candidate, then the total.
        self._gain_energy: list[float] | None = None
        # The last agreed gain of every candidate (density="auto").
        self._gains: list[float] | None = None

    @property
    def density(self) -> float:
        """The density in force now (the controller's choice under ``density="auto"``)."""
        return self.controller.density if self.controller else self.fixed_density

    @property
    def estimating(self) -> bool:
        """Whether decisions need the online cost estimate (``flex`` or ``auto``)."""
        return self.exchange is None or self.controller is not None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def begin_step(self, step: int) -> None:
        """The agreement points of a step, at its first bucket, when no exchange is in flight."""
        if not self.estimating:
            return
        closed = self._log.close()
        self._pending += closed
        now = perf_counter()
        if self._last_begin is not None and closed:
            self._periods.append((now - self._last_begin, all(s.exchange == "dense" for s in closed)))
        self._last_begin = now
        learned = False
        if self.probed_at is None or step - self.probed_at >= self.probe_every:
            self.chooser.estimator.observe_all(probe_collectives(self.probe_sizes, self.group))
            self.probed_at = step
            learned = True
        if self._agrees_at(step) and self._pending:
            self._agree_on_measurements()
            learned = True
        if learned:
            self.chooser.refresh()
        if self.controller:
            if self._gain_energy is not None:
                self._decide_density(step)
            elif learned and self._gains is not None:
                self._update_density(step)  # new costs, the last agreed gain curve
            self.measuring_gain = self.controller.measure_at(step)
        if learned:
            self.chooser.replan(self.density, self.world_size)

    def _agrees_at(self, step: int) -> bool:
        """Every ``flex_interval`` steps, and at steps 1, 2, 4, ... before the first such step:
        the uncalibrated model decides only the first step, not the first ``flex_interval``."""
        return step % self.flex_interval == 0 or (step < self.flex_interval and step & (step - 1) == 0)

    def plan(self, bucket_index: int, numel: int, value_bytes: int, step: int) -> Plan:
        """How this bucket is exchanged at ``step``."""
        density = self.density
        world = self.world_size
        # Under density="auto", density 1.0 means dense: sending every index would only add bytes.
        if step < self.warmup_steps or (self.controller is not None and density >= 1.0):
            exchange = "dense"
        elif self.exchange is not None:
            exchange = self.exchange
        else:
            exchange = self.chooser.choice(bucket_index, numel, density, world, value_bytes, step).exchange
        if not self.estimating:
            return Plan(exchange, density)
        self.chooser.sizes.setdefault(bucket_index, (numel, value_bytes))
        predicted = self.chooser.predicted(bucket_index, exchange, density, world)
        self._log.entered(step, bucket_index, exchange, density, numel, value_bytes, predicted)
        return Plan(exchange, density, predicted)

    def observe_gain(self, bucket_index: int, accumulated: torch.Tensor, workspace: TopkWorkspace) -> None:
        """Add one bucket's kept energy per candidate density (and its total) to this step's curve."""
        assert self.controller is not None
        energy = kept_energy(accumulated, self.controller.candidates, workspace) + [total_energy(accumulated)]
        self._gain_energy = energy if self._gain_energy is None else [a + b for a, b in zip(self._gain_energy, energy)]

    def observe_exchange(self, step: int, bucket_index: int, observation: Observation, t_compress: float | None) -> None:
        """Note a finished exchange: its collective's sample and its local work (0 for dense)."""
        if self.estimating:
            self._log.finished(step, bucket_index, observation, t_compress or 0.0)

    def _decide_density(self, step: int) -> None:
        """Agree on the gain curve (sum over ranks), then let the controller pick."""
        assert self.controller is not None
        energy = allreduce_floats(self._gain_energy, self.group, dist.ReduceOp.SUM)
        self._gain_energy = None
        *kept, total = energy
        if not all(math.isfinite(e) for e in energy) or total <= 0.0:
            return  # a non-finite or all-zero step says nothing about the trade-off
        self._gains = [math.sqrt(k / total) for k in kept]
        self._update_density(step)

    def _update_density(self, step: int) -> None:
        """The controller's decision on the last agreed gains and the predicted step time of every candidate."""
        assert self.controller is not None and self._gains is not None
        world = self.world_size
        simulated = [self.chooser.step_seconds(c, world, self.exchange) for c in self.controller.candidates]
        if not all(math.isfinite(t) for t in simulated):
            return
        # Whole steps, so that the controller's slack is a share of the step, not of its exchanges.
        now = self.chooser.step_seconds(self.density, world, self.exchange)
        rest = max(0.0, self.step_period - now) if self.step_period is not None else 0.0
        self.controller.update(step, self._gains, [rest + t for t in simulated])

    def _agree_on_measurements(self) -> None:
        """Feed every rank the same step samples (see :mod:`flexcomm.control.step_log`).

        One allreduce(MAX) carries all: service and gap negated (-max(-t) = min t), block and the
        median step periods (the slowest rank's; all steps, all-dense steps, the others; 0: none)
        as they are.
        """
        samples = sorted(self._pending, key=lambda s: (s.step, s.bucket))
        self._pending = []
        n = len(samples)
        periods = [_median([t for t, _ in self._periods]), _median([t for t, dense in self._periods if dense]),
                   _median([t for t, dense in self._periods if not dense])]
        self._periods = []
        agreed = allreduce_floats([-s.service for s in samples] + [-s.gap for s in samples] + [s.block for s in samples]
                                  + periods, self.group, dist.ReduceOp.MAX)
        service, gap, block = [-t for t in agreed[:n]], [-t for t in agreed[n:2 * n]], agreed[2 * n:3 * n]
        period, dense_period, other_period = agreed[3 * n:]
        if period > 0.0:
            self.step_period = period
        self.chooser.observe_steps(samples[-1].step, dense_period or None, other_period or None)
        # The collectives' own times are clean network samples (the raw ones counted queueing).
        self.chooser.estimator.observe_all(s.observation._replace(seconds=t) for s, t in zip(samples, service))
        last = samples[-1].step
        self.chooser.sizes = {s.bucket: (s.numel, s.value_bytes) for s in samples if s.step == last}
        for step in sorted({s.step for s in samples}):
            self.chooser.observe(step, [
                StepSample(s.bucket, s.exchange, s.density, b, c, g)
                for s, c, g, b in zip(samples, service, gap, block) if s.step == step and s.bucket in self.chooser.sizes
            ], self.world_size)
        self.prediction_log.extend((s.exchange, s.predicted, b + c) for s, c, b in zip(samples, service, block)
                                   if math.isfinite(s.predicted))

    def fingerprint(self) -> dict[str, object]:
        """The decision settings that must be equal on every rank, one key per option (the error names it)."""
        controller = self.controller
        settings = {f"controller.{name}": value for name, value in controller.settings().items()} if controller else {}
        if self.estimating:
            settings.update({f"chooser.{name}": value for name, value in self.chooser.settings().items()})
        return {"density": "auto" if controller else self.fixed_density, **settings, "warmup_steps": self.warmup_steps}

    def state_dict(self) -> dict[str, Any]:
        return {
            "chooser": self.chooser.state_dict(),
            "probed_at": self.probed_at,
            "controller": self.controller.state_dict() if self.controller else None,
            "gains": self._gains,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["controller"] is None) != (self.controller is None):
            raise ValueError("checkpoint and this run disagree on density='auto'")
        self.chooser.load_state_dict(state["chooser"])
        self.probed_at = state["probed_at"]
        self._gains = state["gains"]
        if self.controller:
            self.controller.load_state_dict(state["controller"])


def _median(values: Sequence[float]) -> float:
    """The median, 0.0 for none (a value every rank can send)."""
    return statistics.median(values) if values else 0.0
