"""What a compressed exchange delivers: the extra steps it costs (AR-Topk against each rank's own top-k, low-rank against dense).

At one density the sparse exchanges send different things.  AG-Topk sends each rank's own
top-k of its accumulated gradient; AR-Topk sends every rank's values at *one* rank's indices,
so the followers send less of their gradient than their own top-k would.  Progress per step
is charged by the energy fraction ``delta = gain^2 = ||sent||^2 / ||a||^2`` sent (top-k's
contraction factor in the error-feedback analyses), as ``density="auto"``'s default rule
charges it (goodput ``gain^2 / t``, :mod:`flexcomm.control.density`): an exchange that sends
``delta_sent`` where each rank's own top-k sends ``delta_own`` costs

    factor = delta_own / delta_sent   (>= 1)

times the steps.  1 for AG-Topk and the dense exchanges, whose choice between them is the
step time's alone; the planner minimises ``step time * factor``.  Measured per AR-Topk
exchange and agreed across ranks: ``delta_sent`` is the smallest ``gain^2`` over ranks (a
follower's, at the leader's indices), ``delta_own`` the largest (the leader's own top-k); on
more than 2 ranks the smallest follower's, which charges AR-Topk a little more than the mean.

Evidence (steps to 0.95x dense's best, evaluations every 25 or 50 steps, 2 ranks, at
601b888 and 2026-12-04): AR-Topk (STAR) against AG-Topk at the same density needed

==========================  ==========  ==========================  ================
group, density              seeds       AR / AG steps (mean)        AG / AR ``gain^2``
==========================  ==========  ==========================  ================
MLP x0.5, 0.01              5           315 / 245 = 1.29            0.101 / 0.082 = 1.23
MLP x0.5, 0.1               5           205 / 125 = 1.64            0.689 / 0.546 = 1.26
ResNet-18 x0.125, 0.1       3           300 / 300 = 1.0             0.557 / 0.410 = 1.36
ResNet-18 x0.125, 0.01      3           never / 350 (2 of 3)        0.079 / 0.057 = 1.39
==========================  ==========  ==========================  ================

so the energy ratio sits inside the measured spread.  (A milder charge, the issue's
``1 + kappa (1/gain^2 - 1)`` with kappa ~ 0.12-0.15 fitted to the same groups' dense and
0.01 steps, gives 1.04-1.13 on the MLP and keeps AR-Topk on 2 ranks, where in these groups'
means it never reached the target sooner: at equal bytes it runs two collectives one after
the other and sends less.)
"""

from __future__ import annotations

import math


def steps_factor(sent: float, own: float) -> float | None:
    """``own / sent``, at least 1; ``None`` when a value is missing (NaN) or not positive."""
    if not all(math.isfinite(v) and v > 0.0 for v in (sent, own)):
        return None
    return max(1.0, own / sent)


#: The lowest quality a factor is computed from (a cosine near 0 would make the factor unbounded).
MIN_QUALITY = 0.05


def quality_factor(quality: float) -> float:
    """The low-rank exchange's steps factor, ``1 / cos(update, mean gradient)``, at least 1.

    Measured (``benchmarks/quality_signal.py``, 5 seeds, MLP, 2 simulated workers): relative to
    dense, top-k needed ``1 / cos^1.1-1.2`` the steps (AG-Topk 0.1: cos 0.82, 1.25x; 0.03: 0.65,
    1.67x; 0.01: 0.48, 2.34x) and low-rank r4 fewer than that (0.80, 1.17x), where the energy
    fraction sent (0.146 for r4) would have charged it like top-k at a density near 0.02.  The
    factor is relative to dense, so against AG-Topk (factor 1 here) the low-rank exchange is
    charged conservatively.  1 before the first measurement (a quality of 1): it gets tried.
    """
    if not math.isfinite(quality):
        return 1.0
    return 1.0 / min(1.0, max(MIN_QUALITY, quality))


#: ``flex`` measures the low-rank quality on every this many steps (and on every exploration).
QUALITY_EVERY = 5


def measures_quality(step: int, explored: bool) -> bool:
    """Whether a low-rank exchange at ``step`` carries the quality sample (the same on every rank: the
    second allreduce's length depends on it).

    The sample (1024 values of ``g / N`` per bucket) rides on the second allreduce; every step it
    added 8 KB to the demo MLP's two buckets, whose factors are 49.6 KB: 16% more bytes on the
    links where low-rank runs.  Every ``QUALITY_EVERY``-th step keeps two readings per agreement
    interval of 10 steps (the quality moves over hundreds of steps) for 3% more bytes; an
    exploration always measures, since its one step is all the chooser learns from.
    """
    return explored or step % QUALITY_EVERY == 0
