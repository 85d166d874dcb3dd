"""``density="auto"``'s gain curve: how much of the error-corrected gradient each candidate density keeps.

At a measurement step every bucket adds, per candidate density ``c``, the energy its top-k at
``c`` keeps, and its total energy (one top-k pass per bucket, :func:`~flexcomm.compress.gain.energy_curve`;
a tensor on the bucket's device, never read on the host before the allreduce).
The step's sums travel in the next agreement point's allreduce (summed over ranks); the agreed
curve is ``g(c) = sqrt(kept(c) / total)``, the compression gain ``||C_c(a)|| / ||a||`` over all
buckets and ranks.  Pure bookkeeping: the planner decides when to measure and issues the collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from flexcomm.compress import TopkWorkspace
from flexcomm.compress.gain import energy_curve


class GainCurve:
    """This step's summed energies (while measuring) and the last agreed gain of every candidate."""

    def __init__(self) -> None:
        #: Whether this step's buckets add their energies (decided at the step's first bucket).
        self.measuring = False
        #: This step's kept energy per candidate, then the total (fp64, on the buckets' device); ``None``
        #: until a bucket adds.
        self.energy: torch.Tensor | None = None
        #: The last agreed gain per candidate (``None`` before the first), and the step it was agreed at.
        self.gains: list[float] | None = None
        self.agreed_at: int | None = None

    def add(self, accumulated: torch.Tensor, candidates: Sequence[float], workspace: TopkWorkspace) -> None:
        """Add one bucket's kept energy per candidate density and its total energy to this step's sums."""
        energy = energy_curve(accumulated, candidates, workspace)
        self.energy = energy if self.energy is None else energy + self.energy.to(energy.device)

    def take_energy(self) -> torch.Tensor | None:
        """This step's sums, for the agreement point's allreduce; the next step starts from none."""
        energy, self.energy = self.energy, None
        return energy

    def agree(self, step: int, energy: Sequence[float]) -> None:
        """The sums over ranks of a measured step: the new curve, unless they say nothing about the trade-off."""
        *kept, total = energy
        if not all(math.isfinite(e) for e in energy) or total <= 0.0:
            return  # a non-finite or all-zero step
        self.gains = [math.sqrt(k / total) for k in kept]
        self.agreed_at = step

    def state_dict(self) -> dict[str, Any]:
        return {"gains": self.gains, "gains_at": self.agreed_at, "measuring_gain": self.measuring,
                "gain_energy": None if self.energy is None else self.energy.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gains, self.agreed_at, self.measuring = state["gains"], state["gains_at"], state["measuring_gain"]
        energy = state["gain_energy"]
        self.energy = None if energy is None else torch.tensor(energy, dtype=torch.float64)
