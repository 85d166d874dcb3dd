"""Leader policies: which rank's selection AR-Topk's ranks all use (the index source).

In AR-Topk one rank r selects the top-k indices of its ``|a_r|`` and every rank sends its
values at those indices.  The policy picks r for a bucket at a step, identically on every
rank, from the step counter or from statistics every rank received in the same
collective:

``round-robin`` (STAR-Topk)  ``r = step mod N``: every rank leads equally often.
``statistic``   (VAR-Topk)   ``r`` = the rank whose smoothed gradient statistic is largest,
                             ties to the lowest rank; rank 0 while nothing was measured.
                             Each rank's statistic (``||a_i||_2``, the authors' choice, or
                             the variance of ``a_i``) rides in the values' allreduce (N
                             extra slots, only rank i's non-zero), so after the exchange
                             every rank holds every rank's statistic and updates the same
                             EWMA ``s <- smoothing * s + (1 - smoothing) * x``.

Every policy counts how often each rank led (the paper's Fig. 4: STAR is flat, VAR uneven).
"""

from __future__ import annotations

from typing import Any

import torch

from flexcomm.compress.stats import variance

LEADER_POLICIES = ("round-robin", "statistic")
STATISTICS = ("norm", "variance")


class LeaderPolicy:
    """Base: counts leaders; subclasses say who leads and whether a statistic rides along."""

    #: Whether each rank's statistic rides in the values' allreduce (N extra slots).
    rides_statistic = False

    def __init__(self) -> None:
        self.counts: list[int] = []

    def leader(self, bucket_index: int, step: int, world_size: int) -> int:
        raise NotImplementedError

    def take(self, bucket_index: int, step: int, world_size: int) -> int:
        """The leader of this bucket's exchange, counted."""
        leader = self.leader(bucket_index, step, world_size)
        self.counts.extend([0] * (world_size - len(self.counts)))
        self.counts[leader] += 1
        return leader

    def statistic(self, a: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """This rank's statistic of ``a``, a 0-d device tensor (only for policies whose statistic rides along)."""
        raise NotImplementedError

    def observe(self, bucket_index: int, statistics: list[float]) -> None:
        """Every rank's statistic for a bucket, as the allreduce delivered them."""

    def state_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = list(state["counts"])


class RoundRobin(LeaderPolicy):
    """STAR-Topk: ``r = step mod N``."""

    def leader(self, bucket_index: int, step: int, world_size: int) -> int:
        return step % world_size


class GradientStatistic(LeaderPolicy):
    """VAR-Topk: the rank with the largest EWMA of a gradient statistic (see the module docstring)."""

    rides_statistic = True

    def __init__(self, statistic: str = "norm", smoothing: float = 0.9) -> None:
        super().__init__()
        if statistic not in STATISTICS:
            raise ValueError(f"var_statistic must be one of {', '.join(STATISTICS)}; got {statistic!r}")
        self.kind = statistic
        self.smoothing = smoothing
        self.ewma: dict[int, list[float]] = {}

    def leader(self, bucket_index: int, step: int, world_size: int) -> int:
        ewma = self.ewma.get(bucket_index)
        if ewma is None:
            return 0
        return max(range(len(ewma)), key=lambda r: (ewma[r], -r))

    def statistic(self, a: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        return norm if self.kind == "norm" else variance(a)

    def observe(self, bucket_index: int, statistics: list[float]) -> None:
        previous = self.ewma.get(bucket_index)
        s = self.smoothing
        self.ewma[bucket_index] = statistics if previous is None else [s * p + (1.0 - s) * x for p, x in zip(previous, statistics)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ewma": {i: list(v) for i, v in self.ewma.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ewma = {int(i): list(v) for i, v in state["ewma"].items()}


def make_leader_policy(name: str, statistic: str = "norm", smoothing: float = 0.9) -> LeaderPolicy:
    """The policy called ``name`` (one of :data:`LEADER_POLICIES`)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "statistic":
        return GradientStatistic(statistic, smoothing)
    raise ValueError(f"leader policy must be one of {', '.join(LEADER_POLICIES)}; got {name!r}")
