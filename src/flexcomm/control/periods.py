"""Whole-step periods measured per density, and every candidate's predicted period from them.

:class:`RecentPeriods` holds this rank's periods until an agreement point's allreduce agrees
on their medians; :class:`StepPeriods` keeps the agreed ones and predicts from them.

A step's period is the wall time from its first bucket to the next step's first bucket: the
exchanges the step simulation (:func:`~flexcomm.control.exchange.simulate_step`) models
plus what it leaves out (forward, the backward before the first bucket, the optimizer).
For each density ``d`` the table keeps ``P[d]``, the agreed median period of steps run at
``d`` (EWMA over agreement points; a value more than ``JUMP`` times off replaces it whole: a
new regime), and ``S[d]``, the median of the simulated steps those same steps ran under
(a period over which the link changed, so that the model that learned from it simulates
their plan far from what they ran under, is not kept, unless it is the density's first: then it is
paired with the model now, :meth:`StepPeriods.agreed`).
A candidate ``c`` is predicted from a measurement at the *same* density wherever one exists,
moved by what the model learned since (``S_now``, the simulated step now):

    T(c) = carry(P[c], S[c], S_now(c))                                c measured under its plan now
    T(c) = carry(carry(P[a], S[a], S_now(a)), S_now(a), S_now(c))     else, a the newest such density
    T(c) = S_now(c)                                                   nothing measured yet

``carry(P, S, S')`` moves a period by the model's change: ``P + (S' - S)`` when the model's
step got longer (a slower link adds its extra exchange time to the whole step), and
``max(P + S' - S, P * S' / S)`` when it got shorter (never below the proportional shrink,
so never <= 0).  ``P[d] - S[d]`` is what the model leaves out, measured at ``d`` and paired
step by step with the model the steps ran under, so it keeps forward and optimizer whatever
the link did since.  (The old prediction, ``max(0, P - S_now(cur)) + S_now(c)`` with ``P``
measured at whatever density last ran and ``S_now(cur)`` simulated at the density just
chosen, mixed densities and moments: right after a link drop ``S_now`` had learned the
drop while ``P`` had not, the difference clamped to 0, every candidate lost forward and
optimizer, and single steps jumped to the sparsest density.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from flexcomm.control.guard import jumped

#: A period whose plan the model, once it learned from those steps, simulates this many times
#: slower or faster than when they ran spans a change of link: it is not kept (:meth:`StepPeriods.agreed`).
REGIME_CHANGE = 1.5


def carry(period: float, then: float, now: float) -> float:
    """A period measured when the model simulated ``then``, moved to a model that simulates ``now``."""
    if now >= then or then <= 0.0:
        return period + (now - then)
    return max(period + (now - then), period * now / then)


class StepPeriods:
    """Agreed step periods per density, each with the simulated step of its agreement point.

    Args:
        smoothing: EWMA weight of the old period.
    """

    def __init__(self, smoothing: float = 0.7) -> None:
        self.smoothing = smoothing
        # density -> (period P, simulated S at the same agreement point, step of the measurement,
        # the plan the steps ran: one exchange per bucket, () where unknown)
        self._measured: dict[float, tuple[float, float, int, tuple[str, ...]]] = {}

    def observe(self, step: int, density: float, period: float, simulated: float, plan: tuple[str, ...] = ()) -> None:
        """An agreed median period of steps run at ``density`` under ``plan``, and the simulated step they ran under.
        A period of another plan, or more than ``JUMP`` times off, replaces the old one whole."""
        old = self._measured.get(density)
        if old is not None and old[3] == plan and not jumped(old[0], period):
            period = self.smoothing * old[0] + (1.0 - self.smoothing) * period
            simulated = self.smoothing * old[1] + (1.0 - self.smoothing) * simulated
        self._measured[density] = (period, simulated, step, plan)

    def agreed(self, step: int, density: float, period: float, ran_under: float, now: float,
               plan: tuple[str, ...] = ()) -> None:
        """:meth:`observe` an agreed period that ran under the simulated step ``ran_under`` (0: before the model knew
        any bucket; paired with ``now``), unless the model now simulates its plan at ``now``, more than
        ``REGIME_CHANGE`` times off: the link changed while it ran.  (Kept, 114 ms of dense steps after a drop to
        100 Mbit, paired with the 1 Gbit model's 11 ms, left that density's prediction 2-8x too slow once the link
        came back.)  A density's first period is kept all the same, paired with ``now``: the model that learned
        from its steps describes them better than the one they ran under, and without it the density is
        predicted by the simulation alone, which leaves out forward and optimizer.  (Dropped, the first
        periods of a run, whose samples calibrated a model fitted to the probes, left the decisions at
        steps 4 and 8 predicting 1-8 ms for steps of 13-23 ms: MLP group at 38da885.)"""
        if ran_under and not ran_under / REGIME_CHANGE <= now <= ran_under * REGIME_CHANGE:
            if density in self._measured:
                return
            ran_under = now
        self.observe(step, density, period, ran_under or now, plan)

    def predict(self, densities: Sequence[float], simulated: Sequence[float],
                plans: Sequence[tuple[str, ...]] | None = None) -> list[float]:
        """The predicted period of every density, from ``simulated`` (the model's step at each, now) and
        ``plans`` (the plan it simulates at each).

        A density measured under another plan than its plan now is predicted like an unmeasured one:
        its period holds that plan's errors, not this one's.  (Kept, two early all-dense16 steps of a
        model still learning the link, 57 ms against the 20 ms it simulated, priced density 1.0 at
        54-180 ms for the rest of a run whose plan there had become 22 ms of low-rank steps.)
        """
        now = dict(zip(densities, simulated))
        current = dict(zip(densities, plans or ()))
        carried = {d: carry(p, s, now[d]) for d, (p, s, _, _) in self._measured.items() if d in now}
        if not carried:
            return list(simulated)
        own = {d: t for d, t in carried.items()
               if not self._measured[d][3] or self._measured[d][3] == current.get(d, self._measured[d][3])}
        anchors = own or carried
        return [own[c] if c in own else carry(anchors[a], now[a], now[c])
                for c, a in ((c, self._anchor(c, anchors)) for c in densities)]

    def _anchor(self, density: float, carried: dict[float, float]) -> float:
        """The newest measured density, the nearest (in log density) among equally new ones."""
        return max(carried, key=lambda d: (self._measured[d][2], -abs(math.log(d / density))))

    def state_dict(self) -> dict[str, Any]:
        return {"measured": [[d, p, s, at, list(plan)] for d, (p, s, at, plan) in sorted(self._measured.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint written before plans were kept has four fields: its plans are unknown.
        self._measured = {float(d): (float(p), float(s), int(at), tuple(rest[0]) if rest else ())
                          for d, p, s, at, *rest in state["measured"]}


class RecentPeriods:
    """This rank's whole-step periods since the last agreement point: the period slots of its
    measurement allreduce.

    Each period is the wall time from a step's first bucket to the next step's first bucket,
    kept with whether every bucket of the step went dense, the step's density and the
    model's simulated step at that density when the step ran (0: none).
    """

    def __init__(self) -> None:
        self._last_begin: float | None = None
        self._periods: list[tuple[float, bool, float, float]] = []

    def step_began(self, now: float, ended: tuple[bool, float, float] | None) -> None:
        """A step began at ``now``; ``ended``: (all dense, density, simulated) of the step that ended, or
        ``None`` to keep no period for it."""
        if self._last_begin is not None and ended is not None:
            self._periods.append((now - self._last_begin, *ended))
        self._last_begin = now

    def clear(self) -> None:
        """The periods went into an agreement point's allreduce."""
        self._periods = []

    def medians(self, candidates: Sequence[float]) -> list[float]:
        """The period slots, a fixed number for ``candidates`` (0: none).

        The medians of all-dense steps and of the others (the guard's); for each candidate
        density the median period of the steps run at it and the median of the simulated
        steps they ran under (the same on every rank).  Combined by MAX: the slowest rank's.
        """
        periods = [_median([t for t, dense, _, _ in self._periods if dense]),
                   _median([t for t, dense, _, _ in self._periods if not dense])]
        periods += [_median([t for t, _, d, _ in self._periods if d == c]) for c in candidates]
        periods += [_median([sim for _, _, d, sim in self._periods if d == c]) for c in candidates]
        return periods

    def state_dict(self, now: float) -> dict[str, Any]:
        """The periods, and the open step's age at ``now`` (a clock reading does not survive a restart)."""
        return {"step_periods": [list(p) for p in self._periods],
                "since_begin": None if self._last_begin is None else now - self._last_begin}

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        self._periods = [(float(t), bool(dense), float(d), float(sim)) for t, dense, d, sim in state["step_periods"]]
        since = state["since_begin"]
        self._last_begin = None if since is None else now - since


def _median(values: Sequence[float]) -> float:
    """The median, 0.0 for none (a value every rank can send)."""
    return statistics.median(values) if values else 0.0
