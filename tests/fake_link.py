"""A StepPlanner driven step by step on a simulated link: a fake clock, modelled collectives.

One bucket of ``M`` floats per step, exchanged on a 2-rank link that follows the alpha-beta
model exactly (so the planner's model can be right): forward + backward, the bucket's
selection and exchange, then the optimizer and any per-density ``extra`` the model cannot
see.  Clock advances are multiples of 2**-20 s, so differences of clock readings are exact.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from flexcomm.comm import PendingFloats
from flexcomm.compress import TopkWorkspace, k_for
from flexcomm.control import DensityController, StepPlanner
from flexcomm.cost import CostParams, LinkParams, Observation, predict_exchange_times, predicted_probe

M = 200_000
WORLD = 2
#: What each exchange reports: (collective kind, payload bytes per element sent).
REPORTED = {"dense": ("allreduce", 4), "dense16": ("allreduce", 2), "agtopk": ("allgather", 8), "artopk": ("allreduce", 4)}
Patch = Callable[[Any, str, Any], None]


def _tick(seconds: float) -> float:
    return round(seconds * 2**20) / 2**20


class FakeLink:
    """The clock, the link and the collectives a :class:`StepPlanner` sees, one process per rank.

    Args:
        rate_bps: the link's bandwidth (change it with :attr:`rate_bps` between steps).
        compute: forward + backward + optimizer seconds of a step.
        select: seconds of a sparse exchange's selection.
        cast: seconds of dense16's casts (to fp16 and back).
        extra: seconds a step at a density spends beyond what the planner's model sees.
        identity: the agreement allreduces are identities (one process); else the real
            ``allreduce_floats_async`` runs (ranks of a real group).
        jitter: seconds added to every third step's compute (ranks measuring different times).
        probe_cost: seconds the probes take (at step 0 and every ``probe_every`` steps).
    """

    def __init__(self, patch: Patch, rate_bps: float, compute: float = 0.1, select: float = 0.004,
                 extra: dict[float, float] | None = None, alpha: float = 1e-4, identity: bool = True,
                 jitter: float = 0.0, cast: float = 0.001, probe_cost: float = 0.0) -> None:
        self.rate_bps, self.alpha = rate_bps, alpha
        self.compute, self.select, self.extra, self.jitter = compute, select, extra or {}, jitter
        self.cast, self.probe_cost = cast, probe_cost
        self.clock = 0.0
        gen = torch.Generator().manual_seed(0)
        self.grad = torch.randn(M, generator=gen) * torch.rand(M, generator=gen).pow(6)
        self.workspace = TopkWorkspace()
        planner = importlib.import_module("flexcomm.control.planner")
        patch(planner, "perf_counter", lambda: self.clock)
        patch(importlib.import_module("flexcomm.control.step_log"), "perf_counter", lambda: self.clock)
        patch(planner, "probe_collectives", lambda sizes, group, algorithms: self.probe(sizes))
        patch(StepPlanner, "world_size", property(lambda _: WORLD))
        if identity:
            patch(importlib.import_module("flexcomm.control.agreement_point"), "allreduce_floats_async",
                  lambda values, group, op: PendingFloats.completed(values))
            patch(planner, "allreduce_floats", lambda values, group, op: list(values))

    @property
    def params(self) -> CostParams:
        return CostParams.uniform(LinkParams.from_bandwidth(self.alpha, self.rate_bps))

    def probe(self, sizes: tuple[int, ...]) -> list[Observation]:
        self.clock += _tick(self.probe_cost)
        return [Observation(kind, nbytes, WORLD, seconds)
                for kind, nbytes, seconds in predicted_probe(sizes, WORLD, self.params)]

    def run(self, planner: StepPlanner, steps: range, rates: dict[int, float] | None = None) -> list[tuple[float, str]]:
        """Run ``steps``; the link takes rate ``rates[s]`` from step ``s`` on.  Returns what each step ran."""
        ran = []
        for step in steps:
            self.rate_bps = (rates or {}).get(step, self.rate_bps)
            ran.append(self.step(planner, step))
        return ran

    def step(self, planner: StepPlanner, step: int) -> tuple[float, str]:
        """One training step; returns the (density, exchange) it ran."""
        planner.begin_step(step)
        self.clock += _tick(0.8 * self.compute + self.jitter * (step % 3))
        plan = planner.plan(0, M, 4, step)
        if planner.measuring_gain:
            planner.observe_gain(0, self.grad, self.workspace)
        kind, per_element = REPORTED[plan.exchange]
        nbytes = per_element * (M if plan.exchange in ("dense", "dense16") else k_for(M, plan.density))
        comm = _tick(predict_exchange_times(M, plan.density, WORLD, self.params, 4)[plan.exchange])
        block = {"dense": 0.0, "dense16": _tick(self.cast)}.get(plan.exchange, _tick(self.select))
        self.clock += block + comm
        planner.observe_exchange(step, 0, Observation(kind, nbytes, WORLD, comm), None if plan.exchange == "dense" else block)
        planner.end_step(step)  # as the state does once the step's last exchange is issued
        self.clock += _tick(0.2 * self.compute + self.extra.get(plan.density, 0.0))
        return plan.density, plan.exchange


def make_planner(exchange: str | None, controller: DensityController | None, density: float | None = None,
                 flex_interval: int = 10, probe_every: int = 1000) -> StepPlanner:
    """A planner as :class:`flexcomm.FlexState` builds it, on the default group (not touched by a fake link)."""
    return StepPlanner(exchange, density, controller, warmup_steps=0, flex_interval=flex_interval,
                       probe_every=probe_every, probe_sizes=(65536, 1 << 20), forgetting=0.9, group=None)


def agreement_points(steps: int, flex_interval: int = 10) -> set[int]:
    """The steps at which the planner agrees (every flex_interval, and 1, 2, 4, ... before)."""
    return {s for s in range(steps) if s % flex_interval == 0 or (s < flex_interval and s & (s - 1) == 0)}


def spy_updates(controller: DensityController, calls: list | None = None) -> list[tuple[int, list[float]]]:
    """Record ``(step, seconds)`` of every call to ``controller.update`` (into ``calls`` if given)."""
    calls = [] if calls is None else calls
    update = controller.update

    def recorded(step: int, gains: Any, seconds: Any, gains_step: int | None = None) -> float:
        calls.append((step, list(seconds)))
        return update(step, gains, seconds, gains_step)

    controller.update = recorded  # type: ignore[method-assign]
    return calls
