"""What a sparse exchange delivers: the extra steps it costs, relative to each rank's own top-k.

At one density the sparse exchanges send different things.  AG-Topk sends each rank's own
top-k of its accumulated gradient; AR-Topk sends every rank's values at *one* rank's indices,
so the followers send less of their gradient than their own top-k would.  With error feedback
what is left out is sent later, not lost, but progress per step still falls with the energy
fraction ``delta = ||sent||^2 / ||a||^2`` kept (the contraction constant of the compressor in
the error-feedback analyses).  The model used to compare them, after the issue's
``J = t (1 + kappa (1/gain^2 - 1))``: the steps to a target accuracy scale as

    steps(delta) ~ 1 + kappa * (1 / delta - 1),

so an exchange that keeps ``delta_sent`` where each rank's own top-k keeps ``delta_own``
costs ``factor = steps(delta_sent) / steps(delta_own)`` times the steps (>= 1; 1 for
AG-Topk and the dense exchanges, whose choice between them is the step time's alone).  The
planner minimises ``step time * factor``.

Measured per AR-Topk exchange and agreed across ranks: ``delta_sent`` is the smallest
``gain^2`` over ranks (a follower's, at the leader's indices), ``delta_own`` the largest (the
leader's own top-k).

``KAPPA``: from ``benchmarks/adaptive_e2e.py --group mlp`` (2 ranks, 5 seeds each, at
8faf288): steps to 0.95x dense's best ~ 61 for dense, ~250 for AG-Topk 0.01 (mean
``gain^2`` 0.10), ~314 for AR-Topk 0.01 (0.082): ``1 + kappa (1/delta - 1)`` = 4.1 and 5.2
give kappa = 0.34 and 0.37.  (AR-Topk 0.01 needed 1.26x AG-Topk's steps; its mean step was
1.17x, so the time to target was 1.47x.)  The ResNet-18 group says the same in direction:
AR-Topk 0.01 kept 0.056 against AG-Topk's 0.079 and never reached the target.
"""

from __future__ import annotations

import math

#: Weight of the compression error in the steps a run needs (see the module docstring).
KAPPA = 0.35


def steps(delta: float, kappa: float = KAPPA) -> float:
    """Relative steps to a target at kept energy fraction ``delta`` (1 for ``delta = 1``)."""
    if not 0.0 < delta <= 1.0:
        raise ValueError(f"delta must be in (0, 1], got {delta}")
    return 1.0 + kappa * (1.0 / delta - 1.0)


def steps_factor(sent: float, own: float, kappa: float = KAPPA) -> float | None:
    """``steps(sent) / steps(own)``, at least 1; ``None`` when a value is missing (NaN) or not positive.

    Values a rounding error above 1 count as 1.
    """
    if not all(math.isfinite(v) and v > 0.0 for v in (sent, own)):
        return None
    return max(1.0, steps(min(sent, 1.0), kappa) / steps(min(own, 1.0), kappa))
