"""The guard: whole-step periods of all-dense steps against the plan's, measured, not simulated.

The step simulation (:mod:`flexcomm.control.step_model`) treats collectives and compute as
running side by side; on CPUs they share cores, and a dense allreduce that "hides" behind
backward slows it down.  So the agreed median periods of whole steps are kept apart for
all-dense steps (plain DDP's behaviour) and the others; when all-dense steps measured faster,
the plan is all-dense.  Every ``guard_every`` steps ``GUARD_TRIAL_STEPS`` steps run the plan
the guard is not using (all-dense only while the model rates it within ``GUARD_MARGIN`` of the
plan), so both stay measured.

A period takes a new value whole when it differs from the old one by more than a factor
``JUMP``: a change of regime (a link that dropped or came back), not noise to average away.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The guard tries all-dense steps only while the model rates them within this factor of the plan's:
#: what it corrects (compute and collectives sharing the CPU) is tens of percent, and after a
#: drop the model can rate dense several times too fast (a 3-step trial at 20 Mbit cost 12 s).
GUARD_MARGIN = 1.5
#: Consecutive steps of a guard trial: the agreed median of a few steps, not one noisy step.
GUARD_TRIAL_STEPS = 3
#: A period this many times above or below the smoothed one replaces it (a change of regime).
JUMP = 3.0


def jumped(old: float, value: float) -> bool:
    """``value`` is more than ``JUMP`` times above or below ``old``: a change of regime, not noise."""
    return not old / JUMP <= value <= old * JUMP


def smoothed_periods(periods: Mapping[str, tuple[float, int]], step: int, dense: float | None, other: float | None,
                     smoothing: float) -> dict[str, tuple[float, int]]:
    """``periods`` ("dense" / "other" -> (seconds, step)) after the new agreed medians (None: none ran).

    Each is an EWMA (``smoothing``: the old value's weight), taken whole when it jumps; when
    one jumps, the other, measured before the change, is dropped unless re-measured too: the
    guard compares the two again only once both are measured under the new regime.
    """
    new = {kind: seconds for kind, seconds in (("dense", dense), ("other", other)) if seconds is not None}
    changed = {kind for kind, seconds in new.items() if kind in periods and jumped(periods[kind][0], seconds)}
    result = dict(periods)
    for kind in changed:
        unmeasured = "other" if kind == "dense" else "dense"
        if unmeasured not in new:
            result.pop(unmeasured, None)
    for kind, seconds in new.items():
        old = result.get(kind)
        fresh = old is None or kind in changed
        result[kind] = (seconds, step) if fresh else (smoothing * old[0] + (1.0 - smoothing) * seconds, step)
    return result
