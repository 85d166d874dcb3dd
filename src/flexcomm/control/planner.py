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

* ``flex``: the :class:`~flexcomm.control.exchange.ExchangeChooser` picks per bucket the
  cheapest of dense, AG-Topk and AR-Topk by the alpha-beta model plus measured compression
  time.  (alpha, beta) are estimated online: a probe of a few message sizes at start and
  every ``probe_every`` steps, and the exchanges' own timings, agreed across ranks every
  ``flex_interval`` steps (min over ranks for collectives, max for compression).
* ``density="auto"``: every ``measure_every`` steps each bucket's gain curve over the
  candidates is computed from one top-k pass, summed over buckets and ranks by one
  allreduce, and the :class:`~flexcomm.control.density.DensityController` picks.
* the first ``warmup_steps`` steps, and density 1.0 under ``auto``, are dense.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.comm import allreduce_floats, probe_collectives
from flexcomm.compress import TopkWorkspace
from flexcomm.compress.gain import kept_energy, total_energy
from flexcomm.control.density import DensityController
from flexcomm.control.exchange import ExchangeChooser
from flexcomm.cost import CostEstimator, Observation


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
        #: The step of the last probe (``None`` before the first).
        self.probed_at: int | None = None
        self.measuring_gain = False
        # Gain curve of this step (density="auto"): kept energy per candidate, then the total.
        self._gain_energy: list[float] | None = None
        self._bucket_sizes: dict[int, tuple[int, int]] = {}
        # Filled as exchanges finish, agreed across ranks at the next agreement point.
        self._measured_comm: list[tuple[tuple[int, int], Observation]] = []
        self._measured_compress: list[tuple[tuple[int, int], float]] = []

    @property
    def density(self) -> float:
        """The density in force now (the controller's choice under ``density="auto"``)."""
        return self.controller.density if self.controller else self.fixed_density

    @property
    def estimating(self) -> bool:
        """Whether decisions need the online cost estimate (``flex`` or ``auto``)."""
        return self.exchange is None or self.controller is not None

    def begin_step(self, step: int) -> None:
        """The agreement points of a step, at its first bucket, when no exchange is in flight."""
        if not self.estimating:
            return
        if self.probed_at is None or step - self.probed_at >= self.probe_every:
            self.chooser.estimator.observe_all(probe_collectives(self.probe_sizes, self.group))
            self.probed_at = step
            self.chooser.refresh()
        elif step % self.flex_interval == 0 and (self._measured_comm or self._measured_compress):
            self._agree_on_measurements()
            self.chooser.refresh()
        if self.controller:
            if self._gain_energy is not None:
                self._decide_density(step)
            self.measuring_gain = self.controller.measure_at(step)

    def plan(self, bucket_index: int, numel: int, value_bytes: int, step: int) -> Plan:
        """How this bucket is exchanged at ``step``."""
        density = self.density
        # Under density="auto", density 1.0 means dense: sending every index would only add bytes.
        if step < self.warmup_steps or (self.controller is not None and density >= 1.0):
            return Plan("dense", density)
        if self.exchange is not None:
            return Plan(self.exchange, density)
        choice = self.chooser.choose(bucket_index, numel, density, dist.get_world_size(self.group), value_bytes)
        self.chooser.keep(bucket_index, choice.exchange)
        return Plan(choice.exchange, density, choice.predicted[choice.exchange])

    def observe_gain(self, bucket_index: int, accumulated: torch.Tensor, workspace: TopkWorkspace) -> None:
        """Add one bucket's kept energy per candidate density (and its total) to this step's curve."""
        assert self.controller is not None
        energy = kept_energy(accumulated, self.controller.candidates, workspace) + [total_energy(accumulated)]
        self._gain_energy = energy if self._gain_energy is None else [a + b for a, b in zip(self._gain_energy, energy)]
        self._bucket_sizes[bucket_index] = (accumulated.numel(), accumulated.element_size())

    def observe_exchange(self, step: int, bucket_index: int, observation: Observation, t_compress: float | None) -> None:
        """Keep a finished exchange's network sample (and local compression work, if any)."""
        if not self.estimating:
            return
        key = (step, bucket_index)
        self._measured_comm.append((key, observation))
        if t_compress is not None:
            self._measured_compress.append((key, t_compress))

    def _decide_density(self, step: int) -> None:
        """Agree on the gain curve (sum over ranks), predict each candidate's time, let the controller pick."""
        assert self.controller is not None
        energy = allreduce_floats(self._gain_energy, self.group, dist.ReduceOp.SUM)
        self._gain_energy = None
        *kept, total = energy
        if not all(math.isfinite(e) for e in energy) or total <= 0.0:
            return  # a non-finite or all-zero step says nothing about the trade-off
        world = dist.get_world_size(self.group)
        seconds = [
            sum(self.chooser.predicted_seconds(i, numel, c, world, vb, self.exchange) for i, (numel, vb) in self._bucket_sizes.items())
            for c in self.controller.candidates
        ]
        self.controller.update(step, [math.sqrt(k / total) for k in kept], seconds)

    def _agree_on_measurements(self) -> None:
        """Feed every rank the same timings: min over ranks for collectives, max for compression.

        One allreduce(MAX) carries both: the collectives' times negated (-max(-t) = min t).
        """
        comm = sorted(self._measured_comm, key=lambda item: item[0])
        compress = sorted(self._measured_compress, key=lambda item: item[0])
        self._measured_comm, self._measured_compress = [], []
        agreed = allreduce_floats([-obs.seconds for _, obs in comm] + [t for _, t in compress], self.group, dist.ReduceOp.MAX)
        self.chooser.estimator.observe_all(obs._replace(seconds=-t) for (_, obs), t in zip(comm, agreed))
        for ((_, bucket), _), t in zip(compress, agreed[len(comm):]):
            self.chooser.observe_compression(bucket, t)

    def fingerprint(self) -> dict[str, object]:
        """The decision settings that must be equal on every rank."""
        controller = self.controller
        return {
            "density": "auto" if controller else self.fixed_density,
            "controller": (controller.candidates, controller.rule, controller.time_weight, controller.measure_every,
                           controller.warmup_steps, controller.ramp_steps) if controller else None,
            "warmup_steps": self.warmup_steps,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "chooser": self.chooser.state_dict(),
            "probed_at": self.probed_at,
            "controller": self.controller.state_dict() if self.controller else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["controller"] is None) != (self.controller is None):
            raise ValueError("checkpoint and this run disagree on density='auto'")
        self.chooser.load_state_dict(state["chooser"])
        self.probed_at = state["probed_at"]
        if self.controller:
            self.controller.load_state_dict(state["controller"])
