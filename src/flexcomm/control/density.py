"""Dynamic compression ratio: move the density along the Pareto front of gain and time.

For each candidate density c the controller knows two objectives, agreed by all ranks:

* statistical efficiency, the compression gain ``g(c) = ||C_c(a)||_2 / ||a||_2`` of the
  error-corrected gradient (from one top-k pass, see :mod:`flexcomm.compress.gain`;
  summed over buckets and ranks), to maximize;
* parallel efficiency, ``t(c) = t_comp(c) + t_sync(c)``: the measured selection time plus
  the cost model's time of the exchange at c, summed over buckets, to minimize.

The candidates that no other candidate beats on both objectives form the Pareto front;
one of them is picked by a rule:

``tta``            the candidate with the least predicted time to accuracy,
                   ``J(c) = t(c) * g(c) ** (-2 p)``: time per step times the steps it costs
                   relative to dense.  With error feedback what a density leaves behind is
                   sent later, not lost, so the steps to a target grow far slower than the
                   ``1 / g**2`` that goodput charges.  Measured on this project's runs
                   (ResNet-18 x0.125 at AR-Topk densities 0.1 ... 0.001, ResNet-18 and the
                   MLP at 0.01 and 0.1 over three seeds; steps to 0.85-0.95 x dense's best
                   against the run's mean ``g**2``): steps(c) / steps(dense) =
                   ``(1 / g**2) ** p`` with p between 0.2 and 0.3 (median 0.26; e.g.
                   ``g**2`` = 0.05 at density 0.01 took 1.6-2.5x dense's steps where
                   ``1 / g**2`` says 19x).  ``ef_exponent`` is p (default 0.25).  Not the
                   default: end to end (``benchmarks/adaptive_e2e.py --group mlp``, 5 seeds)
                   it reached the target later than ``goodput`` (median 2.03x vs 1.64x the
                   fastest static setting) and ended further below dense (-3.2 vs -2.0
                   points): early in training, where the target is reached, a low gain
                   costs more steps than the whole-run fit says.
``goodput``        (default) the candidate that delivers the most gradient energy per second,
                   ``g(c)**2 / t(c)``: ``g**2`` is the share of the error-corrected gradient's
                   energy a step applies (top-k's contraction factor in error-feedback
                   analyses), so this is goodput in Pollux's sense, throughput times
                   statistical efficiency.  Dense wins while the exchange is a small part of
                   the step (``1 / t(1)`` beats every ``g**2 / t(c)``), a sparse density once
                   dense's exchange dominates; among sparse densities it stops where halving
                   the bytes no longer buys back the energy left behind.
``asf``            achievement scalarizing: normalize both objectives to [0, 1] over the
                   front (0 = best), minimize ``max(w_t * t_n, w_g * g_n)`` plus a tiny
                   sum term that breaks ties toward the Pareto-better point;
                   ``w_t = time_weight`` (0.6), ``w_g = 1 - time_weight`` (0.4).
``min-time``       the fastest candidate (every candidate it sees meets the accuracy floor).
``knee``           the front point farthest from the line joining its two ends.
``near-fastest``   epsilon-constraint: the candidate with the highest gain among
                   those whose predicted step time is within ``time_slack`` (10%) of the
                   fastest candidate's.  It gives up at most that much speed to send as much
                   of the gradient as it can: dense where the network is fast enough that
                   compression saves nothing, the sparsest needed where it is slow.  Unlike
                   ``asf`` it compares absolute times, so a 2 ms difference on a 100 ms step
                   counts as the 2% it is, not as the whole range of the front.

Accuracy floor (every rule): a candidate whose measured gain is below ``min_gain`` (default
0.7) is not chosen; the densest candidate (gain 1) always qualifies.  Sparse densities cost
accuracy that none of the rules above prices in.  On this project's runs (2 ranks, 400 steps,
final accuracy as the mean of the last 3 full evaluations, against dense of the same seed)
the statics whose run-mean gain was 0.72-0.84 ended on average 0.3-1.3 points below dense
(MLP AG-Topk 0.1, gain 0.83: -0.3 over 5 seeds; AR-Topk 0.1, 0.73: -0.6 over 5; ResNet-18
AG-Topk 0.1, 0.75: -1.3 over 3), ResNet-18 AR-Topk 0.1 at 0.62: -1.5 over 4, and those at
0.22-0.32 lost 2.6-5.2 points (MLP AG- and AR-Topk 0.01: -2.6 and -3.1 over 5 seeds;
ResNet-18: -3.3 and -5.2 over 4).  So under the floor a slow link gets the sparsest density
that still keeps dense's accuracy, not the one that is fastest per step; ``min_gain=0`` turns
the floor off.  The gains are measured on the error-corrected gradient, whose residual the
density running built: a sparse density's residual lowers every candidate's measured gain
(MLP, 2 ranks: the gain at 0.1 read 0.92 after dense steps and 0.69 after 40 steps at 0.033),
so a density that falls under the floor may always step up to the next denser candidate,
whatever its gain reads, and the rule chooses between it and those that meet the floor.
Before, the only candidate left was dense: 80 steps of dense at 100 Mbit, 115 ms against 20 ms
(one seed of ``benchmarks/adaptive_e2e.py --group mlp`` at 8faf288), until dense's flushed
residual raised the gains and the controller went sparse again.

The same bias, read the other way, sets how each candidate is held to the floor.  A reading
taken on the residual of a denser density overstates what a sparser candidate keeps once it
runs and builds its own, larger residual: in the MLP group at ec3866e, 0.033 read 0.74-0.79
after dense steps and 0.48-0.58 after 40 steps of its own; 0.1 read 0.84-0.91 and then
0.68-0.75.  So a candidate sparser than the density running must read ``min_gain +
admit_margin`` (default 0.1) to qualify; a denser one, whose reading understates it, the floor
itself.  And a curve measured before the last switch, or at its first step (on the residual
the old density left), describes another residual: until a curve measured at the
``settle_steps``-th step (default 10) of the new density or later comes in (the controller asks
for it then, not ``measure_every`` steps later), the density running keeps qualifying (it
qualified when chosen).  Before, a curve read under 0.033's residual, reused
when the link's times moved 10 steps after the step up to 0.1, put 0.1 (0.68) under the floor
and ran dense for 70 steps at 100 Mbit, 115-130 ms against 60-70 ms (seeds 3 and 4 there).

Start (no dense warm-up by default): the controller holds density 1.0 only until its first
decision, which comes at the first agreement point after one gain measurement (step 1 under
the planner's schedule), so where the measured step says dense is slow the first sparse step
is step 1 or 2.  ``warmup_steps`` (default 0) delays that first decision; ``ramp_steps``
(default 0: off) then allows one candidate sparser every ``ramp_steps`` steps.  Dense was the
expensive choice to start with on a slow link (8-20x a sparse step), and the ramp's creep
down cost hundreds of steps at densities the measurements had already ruled out.

Stability: it re-decides when the gain at the current density has moved by more than
``gain_change`` (relative), the predicted time of any candidate by more than
``cost_change``, or ``redecide_every`` steps have passed; it switches only if the new
choice beats the current density by ``hysteresis`` in the rule's own terms, and not within
``min_dwell`` steps of its last switch (each switch disturbs the residual), unless the link
changed: some candidate's predicted time moved by more than ``link_change`` (relative) since
the last decision, which is followed at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from flexcomm.control.front import Candidate, asf_scores, goodput, knee_index, pareto_front

RULES = ("goodput", "tta", "near-fastest", "asf", "min-time", "knee")
DEFAULT_CANDIDATES = (1.0, 0.1, 0.033, 0.011, 0.004, 0.001)
#: How many of the newest decisions the controller keeps (and checkpoints).  One decision
#: with six candidates is ~1.3 KB of Python objects (tracemalloc): 1000 of them would grow a long run by
#: ~1.3 MB, in a soak over its first hour; the step records carry the density of every step anyway.
DECISION_LOG = 128


class DensityController:
    """Picks the density for the next steps; a deterministic function of agreed inputs.

    Args:
        candidates: densities in (0, 1] to choose from (1.0 means a dense exchange).
        rule: one of :data:`RULES`.
        ef_exponent: ``tta``'s p: steps to accuracy grow as ``g ** (-2 p)``, in (0, 1].
        time_slack: ``near-fastest``'s allowance over the fastest candidate's time, >= 0.
        time_weight: ``asf``'s weight on time, in (0, 1); the gain's is ``1 - time_weight``.
        min_gain: the accuracy floor, in [0, 1]: no candidate whose gain is below it is chosen.
        admit_margin: how much more than ``min_gain`` a candidate sparser than the density
            running must read, in [0, 1].
        settle_steps: the new density's step, after a switch, at which the gain curve is measured
            again, >= 1.
        measure_every: least steps between gain measurements (each costs one top-k per
            bucket and one small allreduce).
        warmup_steps: steps at density 1.0 before the controller's first decision.
        ramp_steps: after warm-up, steps per candidate the floor descends by (0: no ramp).
        redecide_every, gain_change, cost_change: when to re-decide (see the module docstring).
        hysteresis: margin a new choice must win by, in the rule's terms (``asf``: score;
            ``min-time``: relative time); a density that left the front is left at once.
        min_dwell: least steps between two switches, unless the link changed.
        link_change: relative move of some candidate's time since the last decision that
            counts as a changed link (re-decide at once, dwell or not).
    """

    def __init__(
        self,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        rule: str = "goodput",
        ef_exponent: float = 0.25,
        time_slack: float = 0.1,
        time_weight: float = 0.6,
        min_gain: float = 0.7,
        admit_margin: float = 0.1,
        settle_steps: int = 10,
        measure_every: int = 50,
        warmup_steps: int = 0,
        ramp_steps: int = 0,
        redecide_every: int = 500,
        gain_change: float = 0.10,
        cost_change: float = 0.25,
        hysteresis: float = 0.05,
        min_dwell: int = 30,
        link_change: float = 0.5,
    ) -> None:
        if not candidates or any(isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c <= 1.0 for c in candidates):
            raise ValueError(f"candidates must be densities in (0, 1], got {candidates!r}")
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct, got {candidates!r}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
        if isinstance(ef_exponent, bool) or not isinstance(ef_exponent, (int, float)) or not 0.0 < ef_exponent <= 1.0:
            raise ValueError(f"ef_exponent must be a number in (0, 1], got {ef_exponent!r}")
        if isinstance(time_slack, bool) or not isinstance(time_slack, (int, float)) or not time_slack >= 0.0:
            raise ValueError(f"time_slack must be a number >= 0, got {time_slack!r}")
        if not 0.0 < time_weight < 1.0:
            raise ValueError(f"time_weight must be in (0, 1), got {time_weight}")
        if not 0.0 <= min_gain <= 1.0:
            raise ValueError(f"min_gain must be in [0, 1], got {min_gain}")
        if isinstance(admit_margin, bool) or not isinstance(admit_margin, (int, float)) or not 0.0 <= admit_margin <= 1.0:
            raise ValueError(f"admit_margin must be a number in [0, 1], got {admit_margin!r}")
        for name, value in (("measure_every", measure_every), ("redecide_every", redecide_every),
                            ("settle_steps", settle_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("warmup_steps", warmup_steps), ("ramp_steps", ramp_steps), ("min_dwell", min_dwell)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.candidates = tuple(sorted((float(c) for c in candidates), reverse=True))
        self.rule = rule
        self.ef_exponent = float(ef_exponent)
        self.time_slack = float(time_slack)
        self.time_weight = time_weight
        self.min_gain = min_gain
        self.admit_margin = float(admit_margin)
        self.settle_steps = settle_steps
        self.measure_every = measure_every
        self.warmup_steps = warmup_steps
        self.ramp_steps = ramp_steps
        self.redecide_every = redecide_every
        self.gain_change = gain_change
        self.cost_change = cost_change
        self.hysteresis = hysteresis
        self.min_dwell = min_dwell
        self.link_change = link_change
        self.density = self.candidates[0]
        #: The newest ``DECISION_LOG`` decisions (a long run must not grow without bound).
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISION_LOG)
        self._last: dict[str, Any] | None = None
        self._switched_at: int | None = None

    def settings(self) -> dict[str, object]:
        """Every option that changes a decision: ranks whose settings differ would choose differently."""
        return {"candidates": self.candidates, "rule": self.rule, "ef_exponent": self.ef_exponent,
                "time_slack": self.time_slack,
                "time_weight": self.time_weight, "min_gain": self.min_gain, "admit_margin": self.admit_margin,
                "settle_steps": self.settle_steps, "measure_every": self.measure_every,
                "warmup_steps": self.warmup_steps, "ramp_steps": self.ramp_steps,
                "redecide_every": self.redecide_every, "gain_change": self.gain_change,
                "cost_change": self.cost_change, "hysteresis": self.hysteresis, "min_dwell": self.min_dwell,
                "link_change": self.link_change}

    def measure_due(self, step: int, last: int | None) -> bool:
        """Whether a decision at ``step`` wants a fresh gain curve (``last``: the step of the newest one):
        every ``measure_every`` steps, and once the density chosen at the last switch has run
        ``settle_steps - 1`` steps (the curve is measured the step before ``step``), if the
        newest curve was measured on the residual of the density before it."""
        if step < self.warmup_steps:
            return False
        if last is None or step - last >= self.measure_every:
            return True
        return self._predates_switch(last) and step - self._switched_at >= self.settle_steps

    def _predates_switch(self, gains_step: int) -> bool:
        """Whether a curve read at ``gains_step`` ran on another density's residual: it was measured the
        step before, on the gradient plus the residual of the step before that."""
        return self._switched_at is not None and gains_step <= self._switched_at + 1

    def floor_density(self, step: int) -> float:
        """The smallest density the ramp allows at ``step``."""
        if step < self.warmup_steps:
            return self.candidates[0]
        if not self.ramp_steps:
            return self.candidates[-1]
        allowed = min(len(self.candidates) - 1, 1 + (step - self.warmup_steps) // self.ramp_steps)
        return self.candidates[allowed]

    def update(self, step: int, gains: Sequence[float], seconds: Sequence[float], gains_step: int | None = None) -> float:
        """Take the agreed objectives of every candidate (in ``self.candidates`` order); return the density.

        ``gains_step``: the step whose agreement point read the gain curve (``step`` if None).
        """
        if len(gains) != len(self.candidates) or len(seconds) != len(self.candidates):
            raise ValueError("need one gain and one time per candidate")
        if not self._should_redecide(step, gains, seconds):
            return self.density
        floor = self.floor_density(step)
        stale = self._predates_switch(step if gains_step is None else gains_step)
        allowed = self._accurate([Candidate(c, g, t) for c, g, t in zip(self.candidates, gains, seconds) if c >= floor],
                                 stale)
        front = pareto_front(allowed)
        chosen = self._pick(front)
        kept = next((c for c in front if c.density == self.density), None)
        if kept is not None and chosen is not kept and not self._clearly_better(chosen, kept, front):
            chosen = kept
        # A density that fell below the accuracy floor is left at once, dwell or not.
        under_floor = all(c.density != self.density for c in allowed)
        held = chosen.density != self.density and not under_floor and self._dwelling(step, seconds)
        if chosen.density != self.density and not held:
            self._switched_at = step
        self.density = self.density if held else chosen.density
        # A held choice is reconsidered when the dwell ends, whether or not the inputs move again.
        self._last = {"step": step, "gains": list(gains), "seconds": list(seconds), "held": held}
        self.decisions.append({
            "step": step,
            "density": self.density,
            "held": held,
            "floor": floor,
            "candidates": [asdict(Candidate(c, g, t)) for c, g, t in zip(self.candidates, gains, seconds)],
            "front": [c.density for c in front],
        })
        return self.density

    def _accurate(self, candidates: list[Candidate], stale: bool) -> list[Candidate]:
        """The candidates that meet the accuracy floor (see the module docstring: a sparser one by
        ``admit_margin`` more, the one running always while ``stale``), and the next one denser than the
        density running (its gain was measured on the residual a sparser density built); the
        highest-gain one if none."""
        def qualifies(c: Candidate) -> bool:
            if c.density == self.density:
                return stale or c.gain >= self.min_gain
            return c.gain >= self.min_gain + (self.admit_margin if c.density < self.density else 0.0)

        allowed = [c for c in candidates if qualifies(c)]
        step_up = min((c for c in candidates if c.density > self.density), key=lambda c: c.density, default=None)
        if step_up is not None and step_up not in allowed:
            allowed.append(step_up)
        return allowed or [max(candidates, key=lambda c: (c.gain, c.density))]

    def _dwelling(self, step: int, seconds: Sequence[float]) -> bool:
        """Within ``min_dwell`` steps of the last switch, on a link that did not change since the last decision."""
        if self._switched_at is None or step - self._switched_at >= self.min_dwell:
            return False
        before = self._last["seconds"] if self._last else seconds
        return not any(_moved(now, old, self.link_change) for now, old in zip(seconds, before))

    def _should_redecide(self, step: int, gains: Sequence[float], seconds: Sequence[float]) -> bool:
        last = self._last
        if last is None or step - last["step"] >= self.redecide_every:
            return True
        if last["held"] and step - self._switched_at >= self.min_dwell:
            return True  # the dwell that held the last choice is over
        if self.floor_density(step) < self.floor_density(last["step"]):
            return True  # the ramp just allowed a sparser candidate
        # Any candidate's time, not only the current one's: a faster network moves dense's
        # time a lot and a sparse density's hardly at all.
        current = self.candidates.index(self.density)
        return _moved(gains[current], last["gains"][current], self.gain_change) or any(
            _moved(now, before, self.cost_change) for now, before in zip(seconds, last["seconds"]))

    def _pick(self, front: list[Candidate]) -> Candidate:
        if self.rule == "tta":
            return min(front, key=lambda c: (self._time_to_accuracy(c), -c.density))
        if self.rule == "goodput":
            return max(front, key=lambda c: (goodput(c), c.density))
        if self.rule == "near-fastest":
            return max(self._near_fastest(front), key=lambda c: (c.gain, c.density))
        if self.rule == "min-time":
            return min(front, key=lambda c: (c.seconds, -c.density))
        if self.rule == "knee":
            return front[knee_index(front)]
        scores = asf_scores(front, self.time_weight)
        return front[min(range(len(front)), key=lambda i: (scores[i], i))]

    def _near_fastest(self, front: list[Candidate]) -> list[Candidate]:
        """The front's candidates within ``time_slack`` of its fastest (the front holds the fastest of all)."""
        fastest = min(c.seconds for c in front)
        return [c for c in front if c.seconds <= fastest * (1.0 + self.time_slack)]

    def _clearly_better(self, chosen: Candidate, current: Candidate, front: list[Candidate]) -> bool:
        """Hysteresis, in the rule's own terms: leave a density still on the front only for a clear gain."""
        if self.rule == "tta":
            return self._time_to_accuracy(chosen) < self._time_to_accuracy(current) * (1.0 - self.hysteresis)
        if self.rule == "goodput":
            return goodput(chosen) > goodput(current) * (1.0 + self.hysteresis)
        if self.rule == "near-fastest":
            if current not in self._near_fastest(front):
                return True  # too slow now: leave at once
            return chosen.gain > current.gain * (1.0 + self.hysteresis)
        if self.rule == "asf":
            scores = dict(zip((c.density for c in front), asf_scores(front, self.time_weight)))
            return scores[current.density] - scores[chosen.density] > self.hysteresis
        if self.rule == "min-time":
            return chosen.seconds < current.seconds * (1.0 - self.hysteresis)
        return True  # the knee is a discrete point: no margin to apply

    def _time_to_accuracy(self, c: Candidate) -> float:
        """``t(c) * g(c) ** (-2 p)``: relative time to accuracy (infinite for a candidate that sends nothing)."""
        if c.gain <= 0.0:
            return math.inf
        return c.seconds * c.gain ** (-2.0 * self.ef_exponent)

    def state_dict(self) -> dict[str, Any]:
        return {"density": self.density, "last": self._last, "switched_at": self._switched_at,
                "decisions": list(self.decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["density"] not in self.candidates:
            raise ValueError(f"checkpoint density {state['density']} is not among the candidates {self.candidates}")
        self.density = state["density"]
        self._last = state["last"]
        self._switched_at = state["switched_at"]
        self.decisions = deque(state["decisions"], maxlen=DECISION_LOG)


def _moved(now: float, before: float, threshold: float) -> bool:
    if before == 0.0:
        return now != 0.0
    return abs(now - before) / abs(before) > threshold
