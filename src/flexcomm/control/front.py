"""The Pareto front of (gain, time) candidates and the scalarisations that pick a point of it.

Pure functions of the candidates; :class:`~flexcomm.control.density.DensityController`
holds the rules that use them (see its module docstring for what each rule means).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    density: float
    gain: float
    seconds: float


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates not dominated (another at least as good on both, better on one), densest first."""
    def dominated(c: Candidate) -> bool:
        return any(
            o.gain >= c.gain and o.seconds <= c.seconds and (o.gain > c.gain or o.seconds < c.seconds)
            for o in candidates
        )

    return sorted((c for c in candidates if not dominated(c)), key=lambda c: -c.density)


def _normalized(front: Sequence[Candidate]) -> list[tuple[float, float]]:
    """(time, gain shortfall) of each front point scaled to [0, 1]; 0 is the best on the front."""
    t_lo, t_hi = min(c.seconds for c in front), max(c.seconds for c in front)
    g_lo, g_hi = min(c.gain for c in front), max(c.gain for c in front)
    return [
        ((c.seconds - t_lo) / (t_hi - t_lo) if t_hi > t_lo else 0.0, (g_hi - c.gain) / (g_hi - g_lo) if g_hi > g_lo else 0.0)
        for c in front
    ]


def asf_scores(front: Sequence[Candidate], time_weight: float, rho: float = 1e-3) -> list[float]:
    """Achievement scalarizing score of each front point (lower is better)."""
    gain_weight = 1.0 - time_weight
    return [
        max(time_weight * t, gain_weight * g) + rho * (time_weight * t + gain_weight * g)
        for t, g in _normalized(front)
    ]


def knee_index(front: Sequence[Candidate]) -> int:
    """Index of the front point farthest from the chord between the front's ends."""
    if len(front) < 3:
        return 0
    points = _normalized(front)
    (x0, y0), (x1, y1) = points[0], points[-1]
    length = math.hypot(x1 - x0, y1 - y0) or 1.0
    distances = [abs((x1 - x0) * (y0 - y) - (x0 - x) * (y1 - y0)) / length for x, y in points]
    return max(range(len(front)), key=lambda i: (distances[i], -i))


def goodput(c: Candidate) -> float:
    """Gradient energy share applied per second of step."""
    return c.gain * c.gain / c.seconds if c.seconds > 0.0 else math.inf
