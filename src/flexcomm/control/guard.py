"""The guard: whole-step periods of all-dense steps against the plan's, measured, not simulated.

The step simulation (:mod:`flexcomm.control.step_model`) treats collectives and compute as
running side by side; on CPUs they share cores, and a dense allreduce that "hides" behind
backward slows it down.  So the agreed median periods of whole steps are kept apart for
all-dense steps (plain DDP's behaviour, or the fp16 hook's where ``flex`` may send dense16: see
:attr:`~flexcomm.control.ExchangeChooser.guard_exchange`) and the others; when all-dense steps
measured faster, the plan is all-dense.  Every ``guard_every`` steps ``GUARD_TRIAL_STEPS`` steps run the plan
the guard is not using (all-dense only while the model rates it within ``GUARD_MARGIN`` of the
plan), so both stay measured.  The interval backs off as explorations do
(:func:`~flexcomm.control.exploration.backed_off`, up to 4x): doubled at each agreement point
after a trial's period came in and the same side kept running, back to ``guard_every`` when the
side changes, the density changes or a period jumped (a new link).  On loopback, flex at
density 1.0 ran 3 all-dense16 steps every 25 (the fp16 casts cost more than the bytes they
save there: PyTorch's fp16 hook measured 1.13-1.18x plain DDP) the whole run long, each
trial confirming the fp32 plan.

The all-dense steps are dense16 on every bucket where ``flex`` may send dense16 on every
bucket (what PyTorch's fp16 hook sends), else fp32 dense (:func:`arm_exchange`).  With fp32
as the arm, a plan of fp32 dense on one bucket and dense16 on the other, which the simulation
rated fast because the fp32 bucket "hid" behind backward, ran 20-21 ms steps against 16 ms
all-dense16 for 50 steps at 1 Gbit, and the trials ran 27-32 ms fp32 steps (MLP group, seed 3,
at 809c9e4).

The comparison is in the planner's units, time to accuracy: a plan period is charged the plan's
steps factor (:func:`~flexcomm.control.step_model.plan_factor`; low-rank and AR-Topk buckets send
less than each rank's own top-k), the all-dense steps none.  Compared raw, a plan of dense16 and
low-rank buckets (quality 0.8-0.9) ran 13-23 ms steps at 1 Gbit, as PyTorch's fp16 hook did, and
kept its 1.1-1.25x steps for the whole phase (MLP group, seed 5, at 70d1f80).  A plan that gives up
quality (steps factor over 1) must beat all-dense by the hysteresis to stay; a tie goes to all-dense
(:func:`all_dense_wins`).

A period more than a factor ``JUMP`` off the old one is a change of regime (a link that dropped
or came back), not noise to average away: both periods start over (:func:`smoothed_periods`).

The same holds between two plans that are not all-dense: the agreed period of every plan that ran
is kept per (density, plan) (:func:`remember_plan`), and a plan the model proposes is replaced by
one measured faster in the planner's units (:func:`measured_choice`).  The simulation rated a
plan of low-rank on both of the MLP's buckets faster than dense16 on the first and low-rank on the
second; measured, its steps took 17 ms against 14 ms, at a lower quality, and it ran for 54 of the
88 steps of the 1 Gbit phase (MLP group, seed 1, at 8042009).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from flexcomm.control.step_model import BucketCosts, plan_cost, plan_factor, simulate_step
from flexcomm.cost import HALF_BYTES

#: The guard tries all-dense steps only while the model rates them within this factor of the plan's:
#: what it corrects (compute and collectives sharing the CPU) is tens of percent, and after a
#: drop the model can rate dense several times too fast (a 3-step trial at 20 Mbit cost 12 s).
GUARD_MARGIN = 1.5
#: Consecutive steps of a guard trial: the agreed median of a few steps, not one noisy step.
GUARD_TRIAL_STEPS = 3
#: A period this many times above or below the smoothed one replaces it (a change of regime).
JUMP = 3.0
#: A plan's measured period counts for this many steps after it last ran; then the model decides alone.
PLAN_MEMORY = 200

#: (density, plan in hook order) -> (seconds, the step of the agreement point that measured them).
PlanPeriods = dict[tuple[float, tuple[str, ...]], tuple[float, int]]


def jumped(old: float, value: float) -> bool:
    """``value`` is more than ``JUMP`` times above or below ``old``: a change of regime, not noise."""
    return not old / JUMP <= value <= old * JUMP


def _folded(old: tuple[float, int] | None, seconds: float, step: int, smoothing: float) -> tuple[float, int]:
    """``(seconds, step)``, or with ``old`` an EWMA of its seconds (``smoothing``: the old value's weight)."""
    return (seconds, step) if old is None else (smoothing * old[0] + (1.0 - smoothing) * seconds, step)


def smoothed_periods(periods: Mapping[str, tuple[float, int]], step: int, dense: float | None, other: float | None,
                     smoothing: float) -> dict[str, tuple[float, int]]:
    """``periods`` ("dense" / "other" -> (seconds, step)) after the new agreed medians (None: none ran).

    Each is an EWMA (``smoothing``: the old value's weight).  When either jumps (a change of
    regime) both are dropped, the new medians too: the interval that saw the change mixes the
    two regimes in them, and the guard compares the two again once both are measured after it.
    Keeping them had the guard decide on that mix: a plan step from before a drop (MLP group,
    seed 5, at 639773f: the plan's median 18 ms against all-dense16's 117 ms after the drop to
    100 Mbit/s, all-dense16 for another interval), or the transition's steps after it (seed 4 at
    9bd6434: the plan's median 189 ms, all-dense16's 121, and all-dense16 for 20 steps and more,
    where the low-rank plan took 20-25 ms in the other runs).
    """
    new = {kind: seconds for kind, seconds in (("dense", dense), ("other", other)) if seconds is not None}
    if any(kind in periods and jumped(periods[kind][0], seconds) for kind, seconds in new.items()):
        return {}
    result = dict(periods)
    for kind, seconds in new.items():
        result[kind] = _folded(result.get(kind), seconds, step, smoothing)
    return result


def remember_plan(periods: PlanPeriods, step: int, density: float, plan: tuple[str, ...], seconds: float,
                  smoothing: float) -> PlanPeriods:
    """``periods`` after the agreed median period ``seconds`` of steps that ran ``plan`` at ``density``: an EWMA
    (``smoothing``: the old value's weight), replaced where it jumped; entries older than ``PLAN_MEMORY`` dropped."""
    result = {key: value for key, value in periods.items() if step - value[1] <= PLAN_MEMORY}
    old = result.get((density, plan))
    result[(density, plan)] = _folded(None if old is None or jumped(old[0], seconds) else old, seconds, step, smoothing)
    return result


def measured_choice(periods: PlanPeriods, step: int, density: float, proposed: tuple[str, ...],
                    cost: Callable[[tuple[str, ...]], float], hysteresis: float) -> tuple[str, ...]:
    """The plan to run where the model proposes ``proposed`` at ``density``: the one measured fastest in the
    planner's units, its period times ``cost(plan)`` (its steps factor; ``inf``: no longer usable), when that
    beats ``proposed``'s own measured period by more than ``hysteresis``.  An unmeasured ``proposed`` runs (so
    it gets measured); measurements older than ``PLAN_MEMORY`` steps do not count."""
    def charged(plan: tuple[str, ...]) -> float:
        seconds, at = periods[(density, plan)]
        return seconds * cost(plan) if step - at <= PLAN_MEMORY else math.inf

    if (density, proposed) not in periods or not math.isfinite(own := charged(proposed)):
        return proposed
    measured = [plan for d, plan in sorted(periods) if d == density and len(plan) == len(proposed)]
    best = min(measured, key=charged)
    return best if charged(best) < own * (1.0 - hysteresis) else proposed


def all_dense_wins(dense: float, plan: float, factor: float, hysteresis: float) -> bool:
    """Whether all-dense steps of period ``dense`` replace a plan of period ``plan`` and steps factor ``factor``.

    A plan that gives up quality (``factor > 1``) stays only where its charged period beats all-dense by
    ``hysteresis``: a tie buys no time for the quality it gives up (the MLP group at 5498488 ran low-rank
    and dense16 + low-rank plans at 1 Gbit at the fp16 hook's step, 18-20 ms, and reached the target
    later: seed 2, 2.55 s against 1.61 s).  Between equals (dense and dense16 buckets) all-dense must
    win by it.
    """
    if factor > 1.0:
        return not plan * factor < dense * (1.0 - hysteresis)
    return dense < plan * (1.0 - hysteresis)


def arm_exchange(value_bytes: Iterable[int], dense16: bool) -> str:
    """The exchange of the guard's all-dense steps: ``dense16`` where it is allowed and every bucket's
    gradients are wider than 16 bits, else ``dense``."""
    widths = list(value_bytes)
    return "dense16" if dense16 and widths and all(vb > HALF_BYTES for vb in widths) else "dense"


def guard_trial(step: int, every: int, plan: Mapping[int, str], simulated: Mapping[int, str], arm: Mapping[int, str],
                costs: Callable[[], Sequence[BucketCosts]], measured: float | None = None) -> Mapping[int, str] | None:
    """The plan of ``step`` if it is a guard trial, else None.

    Every ``every`` steps (0: never), ``GUARD_TRIAL_STEPS`` steps run the plan the guard is not
    using: the ``simulated`` plan while the plan in force is the ``arm`` (all-dense), else the arm
    if the model (``costs``, in hook order) rates it within ``GUARD_MARGIN`` of the plan, each charged
    its steps factor (:func:`~flexcomm.control.step_model.plan_cost`).

    Whole steps, where the plan's period was ``measured``: what the simulation leaves out of it
    (forward, optimizer: ``measured`` less the plan's simulated step) is added to the arm's simulated
    step too.  Compared on the simulation alone, all-dense16 at 1 Gbit/s (~11 ms of allreduce on the
    MLP group's model) was rated over 1.5x a low-rank plan and never tried, while whole steps of the
    two measured 17.8 and 18.6 ms (seed 3 at 57c572a: the low-rank plan ran 116 steps).
    """
    order = sorted(arm)
    if not every or step % every >= GUARD_TRIAL_STEPS or set(plan) != set(order):
        return None
    if plan == arm:
        return simulated if set(simulated) == set(order) and simulated != arm else None
    buckets = costs()
    planned, dense = [plan[b] for b in order], [arm[b] for b in order]
    if measured is None:
        return arm if plan_cost(buckets, dense) <= GUARD_MARGIN * plan_cost(buckets, planned) else None
    unmodelled = max(0.0, measured - simulate_step(buckets, planned))
    whole_arm = (simulate_step(buckets, dense) + unmodelled) * plan_factor(buckets, dense)
    return arm if whole_arm <= GUARD_MARGIN * measured * plan_factor(buckets, planned) else None
